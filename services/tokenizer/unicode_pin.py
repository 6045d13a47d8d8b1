"""Unicode character classes pinned to the reference tokenizer, not to whatever the `regex` module ships.

The Hugging Face reference splits text with two engines of its own: Oniguruma (ByteLevel's ``\\p{L}``)
knows Unicode 16.0 letters, and Rust's ``char::is_numeric`` (the Digits step) knows Unicode 17.0
numerics. The `regex` module follows a newer Unicode, under which ~17k newly assigned code points
would split differently. ``pinned_patterns`` (run by the compiler) turns these tables into the
exceptions for the installed `regex` version, which go into the compiled file; workers never import
this module.

Regenerate (only when the reference tokenizer moves to another Unicode version)::

    pip install --target /tmp/ud16 unicodedata2==16.0.0
    pip install --target /tmp/ud17 unicodedata2==17.0.0
    python -m services.tokenizer.unicode_pin /tmp/ud16 /tmp/ud17 > ranges.txt  # paste below
"""
from __future__ import annotations

import importlib
import sys

import regex

from services.tokenizer.pretokenize import FAMILIES, FAST_PATTERN, Family, PinnedPatterns
from shared.errors import PreconditionFailed

# "start+length" in hex, ranges of code points whose general category is L (Unicode 16.0) / N (17.0).
LETTERS_16_0 = (
    "41+1a 61+1a aa+1 b5+1 ba+1 c0+17 d8+1f f8+1ca 2c6+c 2e0+5 2ec+1 2ee+1 370+5 376+2 37a+4 "
    "37f+1 386+1 388+3 38c+1 38e+14 3a3+53 3f7+8b 48a+a6 531+26 559+1 560+29 5d0+1b 5ef+4 620+2b "
    "66e+2 671+63 6d5+1 6e5+2 6ee+2 6fa+3 6ff+1 710+1 712+1e 74d+59 7b1+1 7ca+21 7f4+2 7fa+1 "
    "800+16 81a+1 824+1 828+1 840+19 860+b 870+18 889+6 8a0+2a 904+36 93d+1 950+1 958+a 971+10 "
    "985+8 98f+2 993+16 9aa+7 9b2+1 9b6+4 9bd+1 9ce+1 9dc+2 9df+3 9f0+2 9fc+1 a05+6 a0f+2 a13+16 "
    "a2a+7 a32+2 a35+2 a38+2 a59+4 a5e+1 a72+3 a85+9 a8f+3 a93+16 aaa+7 ab2+2 ab5+5 abd+1 ad0+1 "
    "ae0+2 af9+1 b05+8 b0f+2 b13+16 b2a+7 b32+2 b35+5 b3d+1 b5c+2 b5f+3 b71+1 b83+1 b85+6 b8e+3 "
    "b92+4 b99+2 b9c+1 b9e+2 ba3+2 ba8+3 bae+c bd0+1 c05+8 c0e+3 c12+17 c2a+10 c3d+1 c58+3 c5d+1 "
    "c60+2 c80+1 c85+8 c8e+3 c92+17 caa+a cb5+5 cbd+1 cdd+2 ce0+2 cf1+2 d04+9 d0e+3 d12+29 d3d+1 "
    "d4e+1 d54+3 d5f+3 d7a+6 d85+12 d9a+18 db3+9 dbd+1 dc0+7 e01+30 e32+2 e40+7 e81+2 e84+1 e86+5 "
    "e8c+18 ea5+1 ea7+a eb2+2 ebd+1 ec0+5 ec6+1 edc+4 f00+1 f40+8 f49+24 f88+5 1000+2b 103f+1 "
    "1050+6 105a+4 1061+1 1065+2 106e+3 1075+d 108e+1 10a0+26 10c7+1 10cd+1 10d0+2b 10fc+14d "
    "124a+4 1250+7 1258+1 125a+4 1260+29 128a+4 1290+21 12b2+4 12b8+7 12c0+1 12c2+4 12c8+f "
    "12d8+39 1312+4 1318+43 1380+10 13a0+56 13f8+6 1401+26c 166f+11 1681+1a 16a0+4b 16f1+8 "
    "1700+12 171f+13 1740+12 1760+d 176e+3 1780+34 17d7+1 17dc+1 1820+59 1880+5 1887+22 18aa+1 "
    "18b0+46 1900+1f 1950+1e 1970+5 1980+2c 19b0+1a 1a00+17 1a20+35 1aa7+1 1b05+2f 1b45+8 1b83+1e "
    "1bae+2 1bba+2c 1c00+24 1c4d+3 1c5a+24 1c80+b 1c90+2b 1cbd+3 1ce9+4 1cee+6 1cf5+2 1cfa+1 "
    "1d00+c0 1e00+116 1f18+6 1f20+26 1f48+6 1f50+8 1f59+1 1f5b+1 1f5d+1 1f5f+1f 1f80+35 1fb6+7 "
    "1fbe+1 1fc2+3 1fc6+7 1fd0+4 1fd6+6 1fe0+d 1ff2+3 1ff6+7 2071+1 207f+1 2090+d 2102+1 2107+1 "
    "210a+a 2115+1 2119+5 2124+1 2126+1 2128+1 212a+4 212f+b 213c+4 2145+5 214e+1 2183+2 2c00+e5 "
    "2ceb+4 2cf2+2 2d00+26 2d27+1 2d2d+1 2d30+38 2d6f+1 2d80+17 2da0+7 2da8+7 2db0+7 2db8+7 "
    "2dc0+7 2dc8+7 2dd0+7 2dd8+7 2e2f+1 3005+2 3031+5 303b+2 3041+56 309d+3 30a1+5a 30fc+4 "
    "3105+2b 3131+5e 31a0+20 31f0+10 3400+19c0 4e00+568d a4d0+2e a500+10d a610+10 a62a+2 a640+2f "
    "a67f+1f a6a0+46 a717+9 a722+67 a78b+43 a7d0+2 a7d3+1 a7d5+8 a7f2+10 a803+3 a807+4 a80c+17 "
    "a840+34 a882+32 a8f2+6 a8fb+1 a8fd+2 a90a+1c a930+17 a960+1d a984+2f a9cf+1 a9e0+5 a9e6+a "
    "a9fa+5 aa00+29 aa40+3 aa44+8 aa60+17 aa7a+1 aa7e+32 aab1+1 aab5+2 aab9+5 aac0+1 aac2+1 "
    "aadb+3 aae0+b aaf2+3 ab01+6 ab09+6 ab11+6 ab20+7 ab28+7 ab30+2b ab5c+e ab70+73 ac00+2ba4 "
    "d7b0+17 d7cb+31 f900+16e fa70+6a fb00+7 fb13+5 fb1d+1 fb1f+a fb2a+d fb38+5 fb3e+1 fb40+2 "
    "fb43+2 fb46+6c fbd3+16b fd50+40 fd92+36 fdf0+c fe70+5 fe76+87 ff21+1a ff41+1a ff66+59 ffc2+6 "
    "ffca+6 ffd2+6 ffda+3 10000+c 1000d+1a 10028+13 1003c+2 1003f+f 10050+e 10080+7b 10280+1d "
    "102a0+31 10300+20 1032d+14 10342+8 10350+26 10380+1e 103a0+24 103c8+8 10400+9e 104b0+24 "
    "104d8+24 10500+28 10530+34 10570+b 1057c+f 1058c+7 10594+2 10597+b 105a3+f 105b3+7 105bb+2 "
    "105c0+34 10600+137 10740+16 10760+8 10780+6 10787+2a 107b2+9 10800+6 10808+1 1080a+2c "
    "10837+2 1083c+1 1083f+17 10860+17 10880+1f 108e0+13 108f4+2 10900+16 10920+1a 10980+38 "
    "109be+2 10a00+1 10a10+4 10a15+3 10a19+1d 10a60+1d 10a80+1d 10ac0+8 10ac9+1c 10b00+36 "
    "10b40+16 10b60+13 10b80+12 10c00+49 10c80+33 10cc0+33 10d00+24 10d4a+1c 10d6f+17 10e80+2a "
    "10eb0+2 10ec2+3 10f00+1d 10f27+1 10f30+16 10f70+12 10fb0+15 10fe0+17 11003+35 11071+2 "
    "11075+1 11083+2d 110d0+19 11103+24 11144+1 11147+1 11150+23 11176+1 11183+30 111c1+4 111da+1 "
    "111dc+1 11200+12 11213+19 1123f+2 11280+7 11288+1 1128a+4 1128f+f 1129f+a 112b0+2f 11305+8 "
    "1130f+2 11313+16 1132a+7 11332+2 11335+5 1133d+1 11350+1 1135d+5 11380+a 1138b+1 1138e+1 "
    "11390+26 113b7+1 113d1+1 113d3+1 11400+35 11447+4 1145f+3 11480+30 114c4+2 114c7+1 11580+2f "
    "115d8+4 11600+30 11644+1 11680+2b 116b8+1 11700+1b 11740+7 11800+2c 118a0+40 118ff+8 11909+1 "
    "1190c+8 11915+2 11918+18 1193f+1 11941+1 119a0+8 119aa+27 119e1+1 119e3+1 11a00+1 11a0b+28 "
    "11a3a+1 11a50+1 11a5c+2e 11a9d+1 11ab0+49 11bc0+21 11c00+9 11c0a+25 11c40+1 11c72+1e 11d00+7 "
    "11d08+2 11d0b+26 11d46+1 11d60+6 11d67+2 11d6a+20 11d98+1 11ee0+13 11f02+1 11f04+d 11f12+22 "
    "11fb0+1 12000+39a 12480+c4 12f90+61 13000+430 13441+6 13460+f9b 14400+247 16100+1e 16800+239 "
    "16a40+1f 16a70+4f 16ad0+1e 16b00+30 16b40+4 16b63+15 16b7d+13 16d40+2d 16e40+40 16f00+4b "
    "16f50+1 16f93+d 16fe0+2 16fe3+1 17000+17f8 18800+4d6 18cff+a 1aff0+4 1aff5+7 1affd+2 "
    "1b000+123 1b132+1 1b150+3 1b155+1 1b164+4 1b170+18c 1bc00+6b 1bc70+d 1bc80+9 1bc90+a "
    "1d400+55 1d456+47 1d49e+2 1d4a2+1 1d4a5+2 1d4a9+4 1d4ae+c 1d4bb+1 1d4bd+7 1d4c5+41 1d507+4 "
    "1d50d+8 1d516+7 1d51e+1c 1d53b+4 1d540+5 1d546+1 1d54a+7 1d552+154 1d6a8+19 1d6c2+19 "
    "1d6dc+1f 1d6fc+19 1d716+1f 1d736+19 1d750+1f 1d770+19 1d78a+1f 1d7aa+19 1d7c4+8 1df00+1f "
    "1df25+6 1e030+3e 1e100+2d 1e137+7 1e14e+1 1e290+1e 1e2c0+2c 1e4d0+1c 1e5d0+1e 1e5f0+1 "
    "1e7e0+7 1e7e8+4 1e7ed+2 1e7f0+f 1e800+c5 1e900+44 1e94b+1 1ee00+4 1ee05+1b 1ee21+2 1ee24+1 "
    "1ee27+1 1ee29+a 1ee34+4 1ee39+1 1ee3b+1 1ee42+1 1ee47+1 1ee49+1 1ee4b+1 1ee4d+3 1ee51+2 "
    "1ee54+1 1ee57+1 1ee59+1 1ee5b+1 1ee5d+1 1ee5f+1 1ee61+2 1ee64+1 1ee67+4 1ee6c+7 1ee74+4 "
    "1ee79+4 1ee7e+1 1ee80+a 1ee8b+11 1eea1+3 1eea5+5 1eeab+11 20000+a6e0 2a700+103a 2b740+de "
    "2b820+1682 2ceb0+1d31 2ebf0+26e 2f800+21e 30000+134b 31350+1060 "
)

NUMBERS_17_0 = (
    "30+a b2+2 b9+1 bc+3 660+a 6f0+a 7c0+a 966+a 9e6+a 9f4+6 a66+a ae6+a b66+a b72+6 be6+d c66+a "
    "c78+7 ce6+a d58+7 d66+13 de6+a e50+a ed0+a f20+14 1040+a 1090+a 1369+14 16ee+3 17e0+a 17f0+a "
    "1810+a 1946+a 19d0+b 1a80+a 1a90+a 1b50+a 1bb0+a 1c40+a 1c50+a 2070+1 2074+6 2080+a 2150+33 "
    "2185+5 2460+3c 24ea+16 2776+1e 2cfd+1 3007+1 3021+9 3038+3 3192+4 3220+a 3248+8 3251+f "
    "3280+a 32b1+f a620+a a6e6+a a830+6 a8d0+a a900+a a9d0+a a9f0+a aa50+a abf0+a ff10+a 10107+2d "
    "10140+39 1018a+2 102e1+1b 10320+4 10341+1 1034a+1 103d1+5 104a0+a 10858+8 10879+7 108a7+9 "
    "108fb+5 10916+6 109bc+2 109c0+10 109d2+2e 10a40+9 10a7d+2 10a9d+3 10aeb+5 10b58+8 10b78+8 "
    "10ba9+7 10cfa+6 10d30+a 10d40+a 10e60+1f 10f1d+a 10f51+4 10fc5+7 11052+1e 110f0+a 11136+a "
    "111d0+a 111e1+14 112f0+a 11450+a 114d0+a 11650+a 116c0+a 116d0+14 11730+c 118e0+13 11950+a "
    "11bf0+a 11c50+1d 11d50+a 11da0+a 11de0+a 11f50+a 11fc0+15 12400+6f 16130+a 16a60+a 16ac0+a "
    "16b50+a 16b5b+7 16d70+a 16e80+17 16ff4+3 1ccf0+a 1d2c0+14 1d2e0+14 1d360+19 1d7ce+32 1e140+a "
    "1e2f0+a 1e4f0+a 1e5f1+a 1e8c7+9 1e950+a 1ec71+3b 1ecad+3 1ecb1+4 1ed01+2d 1ed2f+f 1f100+d "
    "1fbf0+a "
)


def parse_ranges(table: str) -> list[tuple[int, int]]:
    """``"41+1a 61+1a"`` -> ``[(0x41, 0x5a), (0x61, 0x7a)]`` (inclusive bounds)."""
    out = []
    for item in table.split():
        start, length = item.split("+")
        first = int(start, 16)
        out.append((first, first + int(length, 16) - 1))
    return out


_LETTER, _NUMBER, _OTHER, _SPACE = 1, 2, 3, 4


def _escape(cp: int) -> str:
    return f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def _class_body(code_points: list[int]) -> str:
    """Sorted code points -> the inside of a character class, as ranges."""
    parts, i = [], 0
    while i < len(code_points):
        j = i
        while j + 1 < len(code_points) and code_points[j + 1] == code_points[j] + 1:
            j += 1
        first, last = code_points[i], code_points[j]
        parts.append(_escape(first) if first == last else f"{_escape(first)}-{_escape(last)}")
        i = j + 1
    return "".join(parts)


def _classes_from_regex() -> bytearray:
    """Class of every code point as the installed `regex` module sees it (one findall per class)."""
    text = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp < 0xE000)
    table = bytearray([_OTHER]) * 0x110000
    for pattern, cls in ((r"\p{L}", _LETTER), (r"\p{N}", _NUMBER), (r"\s", _SPACE)):
        for ch in regex.findall(pattern, text):
            table[ord(ch)] = cls
    return table


def _classes_pinned(reference_spaces: bytearray) -> bytearray:
    table = bytearray([_OTHER]) * 0x110000
    for ranges, cls in ((LETTERS_16_0, _LETTER), (NUMBERS_17_0, _NUMBER)):
        for first, last in parse_ranges(ranges):
            table[first:last + 1] = bytes([cls]) * (last - first + 1)
    for cp, cls in enumerate(reference_spaces):
        if cls == _SPACE:  # White_Space has been stable for a decade: take it from `regex`
            table[cp] = _SPACE
    return table


def pinned_patterns(family: Family = FAMILIES["smollm"]) -> PinnedPatterns:
    """The exceptions for the installed `regex` module and the family's pattern; run once by the
    compiler (~1 s). The same tables pin every family (letters 16.0, numerics 17.0)."""
    seen = _classes_from_regex()
    pinned = _classes_pinned(seen)
    differ = [cp for cp in range(0x110000) if seen[cp] != pinned[cp] and not 0xD800 <= cp < 0xE000]
    if not differ:
        return PinnedPatterns("", family.fast_pattern, [], family.fast_pattern)
    if any(seen[cp] == _SPACE or pinned[cp] == _SPACE or cp < 0x80 for cp in differ):
        raise PreconditionFailed(f"regex {regex.__version__} classifies whitespace or ASCII differently from "
                                 "the reference; the pinning here does not handle that",
                                 reason="UNSUPPORTED_REGEX_VERSION")
    rare = _class_body(differ)

    def pinned_class(base: str, cls: int) -> str:
        extra = [cp for cp in differ if pinned[cp] == cls]
        return f"[[{base}--[{rare}]]{_class_body(extra)}]"

    letters = pinned_class(r"\p{L}", _LETTER)
    numbers = pinned_class(r"\p{N}", _NUMBER)
    others = pinned_class(r"[^\s\p{L}\p{N}]", _OTHER)
    if family.fast_pattern == FAST_PATTERN:
        exact = (rf" ?{letters}+|'(?:[stmd]|re|ve|ll)|{numbers}| ?{others}+"
                 rf"|\s+(?!{letters}|{others})|\s+")
    else:
        exact = _rewrite_classes(family.fast_pattern, letters, numbers, others)
    leads3 = sorted({0xE0 | cp >> 12 for cp in differ if 0x800 <= cp < 0x10000})
    return PinnedPatterns(f"[{rare}]", exact, leads3, family.fast_pattern)


def _rewrite_classes(pattern: str, letters: str, numbers: str, others: str) -> str:
    """The family's pattern with ``\\p{L}``, ``\\p{N}`` and the classes built on them pinned (V1 sets)."""
    out = pattern.replace(r"[^\s\p{L}\p{N}]", "\x00O").replace(r"[^\r\n\p{L}\p{N}]", "\x00R")
    if "\\p" in out.replace(r"\p{L}", "").replace(r"\p{N}", ""):
        raise ValueError(f"pattern has a Unicode class the pin does not rewrite: {pattern}")
    out = out.replace(r"\p{L}", letters).replace(r"\p{N}", numbers)
    return out.replace("\x00O", others).replace("\x00R", f"[^\\r\\n{letters}{numbers}]")


def _ranges_of(category, major: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = None
    for cp in range(0x110000):
        inside = category(chr(cp))[0] == major
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append((start, cp - start))
            start = None
    if start is not None:
        out.append((start, 0x110000 - start))
    return out


def _load_unicodedata2(folder: str):
    sys.path.insert(0, folder)
    try:
        module = importlib.import_module("unicodedata2")
    finally:
        sys.path.pop(0)
        sys.modules.pop("unicodedata2", None)
    return module


def _render(name: str, ranges: list[tuple[int, int]]) -> str:
    lines, line = [], ""
    for start, length in ranges:
        item = f"{start:x}+{length:x}"
        if len(line) + len(item) + 1 > 92:
            lines.append(line)
            line = ""
        line += (" " if line else "") + item
    lines.append(line)
    body = "\n".join(f'    "{text} "' for text in lines)
    return f"{name} = (\n{body}\n)\n"


def main(argv: list[str] | None = None) -> int:
    """Print both tables from two unicodedata2 installs (16.0.0 for letters, 17.0.0 for numerics)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m services.tokenizer.unicode_pin UD16_DIR UD17_DIR", file=sys.stderr)
        return 2
    ud16, ud17 = (_load_unicodedata2(folder) for folder in args)
    if (ud16.unidata_version, ud17.unidata_version) != ("16.0.0", "17.0.0"):
        print(f"need 16.0.0 and 17.0.0, got {ud16.unidata_version}, {ud17.unidata_version}", file=sys.stderr)
        return 2
    print(_render("LETTERS_16_0", _ranges_of(ud16.category, "L")))
    print(_render("NUMBERS_17_0", _ranges_of(ud17.category, "N")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
