"""Fixtures for the tokenizer tests: the compiled file (built once per session into a tmp dir),
the Keel tokenizer on it, and the Hugging Face reference with the hub's pre-tokenizer restored."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.tokenizer.compiler import compile_vocab
from services.tokenizer.core import Tokenizer
from shared.modelfile import shipped_gguf
from shared.modelfile import source as model_source

HF_TOKENIZER_DIR = model_source().cache_dir / "hf-tokenizer"
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def corpus_files() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.txt"))


def read_corpus(path: Path) -> str:
    return path.read_bytes().decode("utf-8")  # no newline translation: \r stays as written


@pytest.fixture(scope="session")
def compiled_file(tmp_path_factory) -> Path:
    return compile_vocab(shipped_gguf(), tmp_path_factory.mktemp("tokenizer") / "vocab.kvoc")


@pytest.fixture(scope="session")
def tok(compiled_file) -> Tokenizer:
    tokenizer = Tokenizer.open(compiled_file)
    tokenizer.self_check()
    tokenizer.warmup()
    return tokenizer


@pytest.fixture(scope="session")
def reference():
    """tokenizers.Tokenizer as the hub configures SmolLM2: Digits(individual) then ByteLevel.

    transformers' GGUF conversion (which wrote tokenizer.json) drops the Digits step; restoring
    it here is what makes this the reference.
    """
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import pre_tokenizers

    if not (HF_TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.fail("reference tokenizer missing: run `make model` (make test does it first)")
    ref = HfTokenizer.from_file(str(HF_TOKENIZER_DIR / "tokenizer.json"))
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return ref


@pytest.fixture(scope="session")
def ref_ids(reference):
    """text -> reference ids (special tokens matched, nothing added)."""
    return lambda text: reference.encode(text, add_special_tokens=False).ids
