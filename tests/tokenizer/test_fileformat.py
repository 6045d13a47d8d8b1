"""The compiled file: layout, every way it can be damaged, and the idempotent compile step."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest

from services.tokenizer import fileformat as ff
from services.tokenizer.compiler import compile_vocab
from services.tokenizer.core import Tokenizer
from shared.errors import Fatal, PreconditionFailed
from shared.modelfile import shipped_gguf


def sections_of(path) -> tuple[dict[bytes, bytes], ff.SourceInfo]:
    image = path.read_bytes()
    header = ff.parse_header(image)
    return {tag: image[o:o + n] for tag, (o, n) in header.sections.items()}, header.source


def rewrite(src, dst, change_meta=None, **replace):
    """Copy a compiled file with sections replaced, through the real writer (so the CRC is valid)."""
    sections, source = sections_of(src)
    if change_meta is not None:
        meta = json.loads(sections[ff.META])
        change_meta(meta)
        sections[ff.META] = json.dumps(meta).encode()
    for tag, data in replace.items():
        sections[tag.encode()] = data
    ff.write(dst, sections, source)
    return dst


def open_error(path) -> str:
    with pytest.raises(ff.CompiledFileError) as err:
        Tokenizer.open(path)
    return err.value.reason


def test_layout(compiled_file):
    image = compiled_file.read_bytes()
    magic, version, header_size, n_sections, crc, sha, size, _ = ff.HEADER.unpack_from(image)
    assert (magic, version) == (b"KEELTOK\x00", ff.FORMAT_VERSION)
    assert header_size % ff.ALIGN == 0 and crc == ff.file_crc32(image)
    header = ff.parse_header(image)
    assert set(ff.REQUIRED) <= set(header.sections) and len(header.sections) == n_sections
    assert all(offset % ff.ALIGN == 0 for offset, _ in header.sections.values())
    assert size == shipped_gguf().stat().st_size


def test_source_hash_is_the_gguf_sha256(compiled_file):
    digest = hashlib.sha256(shipped_gguf().read_bytes()).digest()
    assert ff.parse_header(compiled_file.read_bytes()).source.sha256 == digest


def test_is_a_compiled_error_and_a_fatal():
    assert issubclass(ff.CompiledFileError, Fatal)


def test_bad_magic(compiled_file, tmp_path):
    bad = tmp_path / "bad.kvoc"
    bad.write_bytes(b"GGUF" + compiled_file.read_bytes()[4:])
    assert open_error(bad) == "COMPILED_FILE_BAD_MAGIC"


def test_wrong_version(compiled_file, tmp_path):
    image = bytearray(compiled_file.read_bytes())
    struct.pack_into("<I", image, 8, ff.FORMAT_VERSION + 1)
    bad = tmp_path / "v2.kvoc"
    bad.write_bytes(image)
    assert open_error(bad) == "COMPILED_FILE_VERSION"


@pytest.mark.parametrize("keep", [0, 7, ff.HEADER.size, 300, 0.5, -1])
def test_truncated(compiled_file, tmp_path, keep):
    image = compiled_file.read_bytes()
    cut = int(len(image) * keep) if isinstance(keep, float) else (len(image) + keep if keep < 0 else keep)
    bad = tmp_path / "cut.kvoc"
    bad.write_bytes(image[:cut])
    assert open_error(bad) == "COMPILED_FILE_TRUNCATED"


def test_trailing_garbage(compiled_file, tmp_path):
    bad = tmp_path / "long.kvoc"
    bad.write_bytes(compiled_file.read_bytes() + b"\x00" * ff.ALIGN)
    assert open_error(bad) == "COMPILED_FILE_CORRUPT"


def test_missing_file(tmp_path):
    assert open_error(tmp_path / "nope.kvoc") == "COMPILED_FILE_UNREADABLE"


def test_missing_section(compiled_file, tmp_path):
    sections, source = sections_of(compiled_file)
    del sections[ff.PAIR_KEYS]
    ff.write(tmp_path / "partial.kvoc", sections, source)
    assert open_error(tmp_path / "partial.kvoc") == "COMPILED_FILE_CORRUPT"


def test_wrong_section_size(compiled_file, tmp_path):
    bad = rewrite(compiled_file, tmp_path / "short.kvoc", TFLG=b"\x00" * 10)
    assert open_error(bad) == "COMPILED_FILE_CORRUPT"


def test_stale_regex_version(compiled_file, tmp_path):
    bad = rewrite(compiled_file, tmp_path / "stale.kvoc", lambda m: m.update(regex_version="1999.1.1"))
    assert open_error(bad) == "COMPILED_FILE_STALE"


def test_flipped_byte_fails_the_self_check(compiled_file, tmp_path):
    image = bytearray(compiled_file.read_bytes())
    offset, _ = ff.parse_header(image).sections[ff.RANK_IDS]
    image[offset + 4] ^= 0x01
    bad = tmp_path / "flip.kvoc"
    bad.write_bytes(image)
    damaged = Tokenizer.open(bad)  # opening reads only the header: the damage shows in self_check
    with pytest.raises(Fatal) as err:
        damaged.self_check()
    assert err.value.reason == "SELF_CHECK_FAILED"


def test_self_check_catches_a_wrong_probe(compiled_file, tmp_path):
    def break_probe(meta):
        meta["probes"][0][1] = meta["probes"][0][1][::-1]

    bad = rewrite(compiled_file, tmp_path / "probe.kvoc", break_probe)
    with pytest.raises(Fatal) as err:
        Tokenizer.open(bad).self_check()
    assert err.value.reason == "SELF_CHECK_FAILED"


def test_self_check_catches_wrong_merges(compiled_file, tmp_path):
    """Valid checksum, wrong table: the probes computed by the compiler's own BPE disagree."""
    sections, _ = sections_of(compiled_file)
    bad = rewrite(compiled_file, tmp_path / "ranks.kvoc", RKID=sections[ff.RANK_IDS][::-1])
    with pytest.raises(Fatal):
        Tokenizer.open(bad).self_check()


def test_compile_is_idempotent(compiled_file):
    before = compiled_file.stat().st_mtime_ns
    assert compile_vocab(shipped_gguf(), compiled_file) == compiled_file
    assert compiled_file.stat().st_mtime_ns == before


def test_compile_trusts_the_hash_when_the_mtime_differs(compiled_file, tmp_path):
    sections, source = sections_of(compiled_file)
    copy = tmp_path / "touched.kvoc"
    ff.write(copy, sections, ff.SourceInfo(source.sha256, source.size, source.mtime_ns + 1))
    before = copy.read_bytes()
    compile_vocab(shipped_gguf(), copy)
    assert copy.read_bytes() == before


@pytest.mark.slow
def test_compile_rebuilds_a_file_from_another_builder(compiled_file, tmp_path):
    old = rewrite(compiled_file, tmp_path / "old.kvoc", lambda m: m.update(builder="an older compiler"))
    compile_vocab(shipped_gguf(), old)
    assert old.read_bytes() == compiled_file.read_bytes()


@pytest.mark.slow
def test_compile_replaces_a_damaged_output(compiled_file, tmp_path):
    out = tmp_path / "garbage.kvoc"
    out.write_bytes(b"not a tokenizer")
    compile_vocab(shipped_gguf(), out)
    assert out.read_bytes() == compiled_file.read_bytes()  # deterministic build


def test_compile_without_a_gguf(tmp_path):
    with pytest.raises(PreconditionFailed) as err:
        compile_vocab(tmp_path / "missing.gguf", tmp_path / "out.kvoc")
    assert err.value.reason == "GGUF_NOT_FOUND"


def tiny_gguf(path, model="gpt2", merges=("a b", "ab ab"), types=None):
    """A 259-token byte-level vocabulary: <|end|> (special), the 256 bytes, "ab", "abab"."""
    import gguf

    from services.tokenizer.compiler import byte_to_unicode

    chars = byte_to_unicode()
    tokens = ["<|end|>"] + [chars[b] for b in range(256)] + ["ab", "abab"]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types or [3] + [1] * 258)
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_compile_a_tiny_gguf_end_to_end(tmp_path):
    out = compile_vocab(tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "tiny.kvoc")
    tiny = Tokenizer.open(out)
    tiny.self_check()
    tiny.warmup()
    byte = 1  # byte b is token 1 + b
    assert tiny.encode_ids("abab ab<|end|>x1") == [258, byte + 32, 257, 0, byte + ord("x"), byte + ord("1")]
    assert tiny.decode([258, 0, 257]) == "abab<|end|>ab"
    # This GGUF has no chat template: the documented plain rendering, reported as such.
    assert tiny.render_chat([("system", "be brief"), ("user", "hi")]) == "system: be brief\nuser: hi\nassistant:"
    assert tiny.render_chat([("user", "hi")], add_generation_prompt=False) == "user: hi\n"
    assert tiny.chat_template_kind == "plain" and tiny.chat_template_sha256 == hashlib.sha256(
        b"keel.chat.plain.v1").hexdigest()


@pytest.mark.parametrize("changes", [
    {"model": "llama"},  # SentencePiece, not byte-level BPE
    {"merges": ["a b c"]},
    {"merges": ["a zz"]},  # names a token the vocabulary lacks
    {"merges": ["a b", "a b"]},
    {"types": [3] + [1] * 257 + [4]},  # a user-defined token
])
def test_compile_rejects_what_it_does_not_implement(tmp_path, changes):
    with pytest.raises(PreconditionFailed) as err:
        compile_vocab(tiny_gguf(tmp_path / "bad.gguf", **changes), tmp_path / "bad.kvoc")
    assert err.value.reason == "UNSUPPORTED_TOKENIZER"
    assert not (tmp_path / "bad.kvoc").exists()
