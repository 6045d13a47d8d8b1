"""The tokenizer's identity for replay records: a vocabulary hash and a chat-template hash,
reported with every Encode; each changes exactly when what it covers changes."""
from __future__ import annotations

import copy
import re

import pytest

from keel.tokenizer.v1 import tokenizer_pb2
from services.tokenizer import fileformat as ff
from services.tokenizer.bpe import CacheOptions
from services.tokenizer.core import Tokenizer
from tests.tokenizer.test_servicer import MESH, stub  # noqa: F401 - the fixture

HEX64 = re.compile(r"[0-9a-f]{64}")


class Identity:
    def __init__(self, hashes: tuple[str, str]):
        self.vocab_sha256, self.chat_template_sha256 = hashes


def variant(tok: Tokenizer, *, meta=None, flip_section: bytes | None = None) -> Identity:
    """The identity of a copy of ``tok`` with its meta replaced or one byte of a section changed
    (what warm-up computes; the copy's tables may be unusable for encoding, so only that)."""
    image = bytearray(tok._image)
    if flip_section is not None:
        off, _ = tok._header.sections[flip_section]
        image[off] ^= 0x01
    return Identity(Tokenizer(memoryview(bytes(image)), tok._header, meta or tok._meta, CacheOptions())._identity())


def test_the_hashes_are_set_by_warmup_and_stable(tok, compiled_file):
    assert HEX64.fullmatch(tok.vocab_sha256) and HEX64.fullmatch(tok.chat_template_sha256)
    again = Tokenizer.open(compiled_file)
    assert again.vocab_sha256 == ""                    # not on the open path: warm-up computes them
    again.warmup()
    assert (again.vocab_sha256, again.chat_template_sha256) == (tok.vocab_sha256, tok.chat_template_sha256)


def test_a_changed_template_changes_only_the_template_hash(tok):
    meta = copy.deepcopy(tok._meta)
    meta["chat_template"] += "{# a comment #}"
    other = variant(tok, meta=meta)
    assert other.chat_template_sha256 != tok.chat_template_sha256 and other.vocab_sha256 == tok.vocab_sha256


@pytest.mark.parametrize("section", [ff.TOKEN_BYTES, ff.RANK_IDS, ff.PAIR_KEYS])
def test_a_changed_vocabulary_or_merge_table_changes_the_vocabulary_hash(tok, section):
    other = variant(tok, flip_section=section)
    assert other.vocab_sha256 != tok.vocab_sha256 and other.chat_template_sha256 == tok.chat_template_sha256


def test_changed_special_tokens_change_the_vocabulary_hash(tok):
    meta = copy.deepcopy(tok._meta)
    meta["special_tokens"] = [[t, i] for t, i in meta["special_tokens"]][:-1]
    assert variant(tok, meta=meta).vocab_sha256 != tok.vocab_sha256


@pytest.mark.asyncio
async def test_every_encode_reports_them(stub, tok):  # noqa: F811
    resp = await stub.Encode(tokenizer_pb2.EncodeRequest(text=b"hello"), metadata=MESH)
    assert (resp.vocab_sha256, resp.chat_template_sha256) == (tok.vocab_sha256, tok.chat_template_sha256)
