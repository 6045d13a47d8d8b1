"""Encode/decode parity with the Hugging Face reference on the corpus and on the documented edge cases."""
from __future__ import annotations

import pytest

from tests.tokenizer.conftest import corpus_files, read_corpus

CORPUS = corpus_files()


def test_corpus_is_multilingual_and_small():
    names = {p.name for p in CORPUS}
    assert {"zh_prose.txt", "english.txt", "code.txt", "emoji.txt", "combining.txt", "whitespace.txt",
            "specials.txt", "dropped_bytes.txt", "unicode_new.txt"} <= names
    assert sum(p.stat().st_size for p in CORPUS) < 500_000


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_lines_encode_like_reference(tok, ref_ids, path):
    text = read_corpus(path)
    for number, line in enumerate(text.split("\n"), 1):
        assert tok.encode_ids(line) == ref_ids(line), f"{path.name}:{number}: {line!r}"


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_file_encodes_like_reference_as_one_text(tok, ref_ids, path):
    text = read_corpus(path)
    assert tok.encode_ids(text) == ref_ids(text)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
@pytest.mark.parametrize("skip", [False, True])
def test_corpus_decodes_like_reference(tok, reference, ref_ids, path, skip):
    ids = ref_ids(read_corpus(path))
    assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text, expected", [
    ("x  1", [104, 256, 33]),  # whitespace before a digit is its own piece (Digits step)
    ("!\x04!", [10095]),  # byte 0x04 is not in the vocabulary: dropped before merging
])
def test_documented_facts(tok, ref_ids, text, expected):
    assert ref_ids(text) == expected
    assert tok.encode_ids(text) == expected


@pytest.mark.parametrize("text", [
    "三", "三十", "1三2", "第3章", "x\t\t1", " 1", "  1", "a 1 b  22",  # CJK numerals are letters
    "IT'S it's It'S we'll they'D", "'s's's", "''", "'",
    "<|im_start|", "<|im_start|>>", "<<|endoftext|>>", "<|im_start|><|im_end|>",
    "\U00010940", "a\U00010940b", " \U00010940", "1\U00011de02", "\U0001246f",
    "", " ", "\n", "\r\n", "\t", "\u3000", "\x00", "\ufffd", "\ufeffBOM",
])
def test_edge_cases(tok, ref_ids, text):
    assert tok.encode_ids(text) == ref_ids(text)


@pytest.mark.parametrize("text", [
    "中" * 20_000,  # one 60 KB piece: the chunker cuts it, every chunk hits the cache
    "a" * 20_000,  # one ASCII piece that cannot be cut: the heap merge
    "ab" * 5_000 + "中文" * 2_000,
    " " * 10_000 + "x",
    "é" * 5_000,
    "😀" * 3_000,
])
def test_long_runs(tok, ref_ids, text):
    assert tok.encode_ids(text) == ref_ids(text)
