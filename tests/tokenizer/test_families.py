"""Parity of every pre-tokenizer family: Keel on the GGUF == llama.cpp on the GGUF == `tokenizers` on the
Hugging Face folder == Keel on the folder, over a multilingual corpus (testing/vocabs.py's tiny
vocabularies), and the shipped SmolLM2 GGUF against llama.cpp. SentencePiece-style BPE (family spm)
also with BOS as its files say, and decoding (whole, streamed, round trip) against `tokenizers`."""
from __future__ import annotations

import json

import llama_cpp
import pytest

from services.tokenizer.compiler import compile_vocab
from services.tokenizer.core import Tokenizer
from shared.errors import PreconditionFailed
from shared.modelfile import shipped_gguf
from testing.vocabs import FAMILY_SPECS, vocab_files, write_gguf_user_defined, write_gguf_with_ids_from
from tests.tokenizer.conftest import corpus_files, read_corpus

EXTRA = [
    "It's John's, isn't it? We'll see: THEY'LL, she'S, I'M, you'RE, we'VE, he'D, 'll 's ''s",
    "digits 1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 ١٢٣٤٥ ١٢٣ 一二三 ½ ² x²",
    "spaces:  two   three    four\ttab\t\ttabs\n\nnewlines\n\n\n  indented\n\t\tx  \n trailing   ",
    "\r\n\r\nwindows\r\n  \r\n\t\r\nend\r",
    "   leading", "trailing   ", " ", "  ", "\n", "\t", "\n\n \n", "a\u00a0b\u2009c\u3000d",
    "def f(x):\n    return x**2  # 平方\n\n\nclass A:\n\tpass\n",
    "emoji 😀😃👍🏽 👨\u200d👩\u200d👧 🇫🇷🇯🇵 ❤️✨🚀!!",
    "中文分词测试，这是一个没有空格的很长的句子。日本語のテキスト、한국어 텍스트",
    "مرحبا بالعالم، كيف حالك؟ שלום עולם नमस्ते दुनिया Привет мир Γειά σου",
    "mixed123abc ABC123 a1b2c3 $9.99 100% #42 v1.2.3 e=mc^2 <tag attr=\"v\">",
    "'''quoted''' \"\"\"doc\"\"\" `code` ~~~ --- ...  ?!?! ",
]
TEXTS = [*EXTRA, *(read_corpus(path) for path in corpus_files())]
TEXTS += [line for text in list(TEXTS) for line in text.splitlines(keepends=True) if line.strip()]


def _specials_texts(family: str) -> list[str]:
    specials = FAMILY_SPECS[family].specials
    joined = "".join(specials)
    return [f"{specials[0]}hello{specials[-1]}", f" {joined} x {specials[0]}\n", f"<|{specials[-1][2:]}",
            f"text{specials[-1]}{specials[-1]}more {specials[0]}"]


def _open(path) -> Tokenizer:
    tok = Tokenizer.open(path)
    tok.self_check()
    tok.warmup()
    return tok


@pytest.fixture(scope="module", params=sorted(FAMILY_SPECS))
def family(request, tmp_path_factory):
    from tokenizers import Tokenizer as HfTokenizer

    name = request.param
    files = vocab_files(name)
    out = tmp_path_factory.mktemp(f"family-{name}")
    from_gguf = _open(compile_vocab(files.gguf, out / "gguf.kvoc"))
    from_folder = _open(compile_vocab(files.folder, out / "folder.kvoc"))
    llama = llama_cpp.Llama(model_path=str(files.gguf), vocab_only=True, verbose=False)
    hf = HfTokenizer.from_file(str(files.folder / "tokenizer.json"))
    return name, from_gguf, from_folder, llama, hf


def _mismatches(texts, *encoders) -> list[str]:
    out = []
    for text in texts:
        results = [encode(text) for encode in encoders]
        if any(r != results[0] for r in results[1:]):
            out.append(f"{text[:80]!r}: " + " | ".join(str(r[:40]) for r in results))
    return out


def test_keel_matches_llama_cpp_and_tokenizers(family):
    name, from_gguf, from_folder, llama, hf = family
    texts = TEXTS + _specials_texts(name)
    wrong = _mismatches(
        texts, from_gguf.encode_ids,
        lambda text: llama.tokenize(text.encode(), add_bos=False, special=True),
        lambda text: hf.encode(text, add_special_tokens=False).ids,
        from_folder.encode_ids)
    assert not wrong, f"{name}: {len(wrong)} of {len(texts)} texts differ (keel | llama.cpp | hf | keel-folder):\n" \
        + "\n".join(wrong[:10])


BYTE_LEVEL = sorted(f for f in FAMILY_SPECS if f != "spm")


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_a_vocabulary_past_65536_tokens_keeps_every_id(name, tmp_path):
    """Ids above 16 bits (Llama 3's 128k and Qwen2's 152k vocabularies): the family's tokens moved to
    70000 and up give the family's ids plus 70000, as llama.cpp gives on the same file."""
    from_gguf = _open(compile_vocab(vocab_files(name).gguf, tmp_path / "small.kvoc"))
    big = write_gguf_with_ids_from(name, tmp_path / "big.gguf", 70000)
    keel = _open(compile_vocab(big, tmp_path / "big.kvoc"))
    llama = llama_cpp.Llama(model_path=str(big), vocab_only=True, verbose=False)
    texts = EXTRA + _specials_texts(name)
    shifted = [[i + 70000 for i in from_gguf.encode_ids(t)] for t in texts]
    assert [keel.encode_ids(t) for t in texts] == shifted
    assert [llama.tokenize(t.encode(), add_bos=False, special=True) for t in texts] == shifted
    assert keel.decode(shifted[0]) == from_gguf.decode([i - 70000 for i in shifted[0]])


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_user_defined_tokens_are_matched_whole_as_llama_cpp_does(name, tmp_path):
    from_gguf = _open(compile_vocab(vocab_files(name).gguf, tmp_path / "small.kvoc"))
    path = write_gguf_user_defined(name, tmp_path / "user.gguf")
    keel = _open(compile_vocab(path, tmp_path / "user.kvoc"))
    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = _specials_texts(name) + EXTRA[:3]
    assert [keel.encode_ids(t) for t in texts] == [from_gguf.encode_ids(t) for t in texts]
    assert [keel.encode_ids(t) for t in texts] == [llama.tokenize(t.encode(), add_bos=False, special=True)
                                                   for t in texts]


def test_folder_and_gguf_compile_to_the_same_tokenizer(family):
    name, from_gguf, from_folder, _, _ = family
    if name != "spm":  # spm: the GGUF ranks merges by score, the folder by its list: same ids, other tables
        assert from_gguf.vocab_sha256 == from_folder.vocab_sha256
    assert from_gguf.chat_template_sha256 == from_folder.chat_template_sha256
    assert (from_gguf.bos_token_id, from_gguf.eos_token_id) == (from_folder.bos_token_id, from_folder.eos_token_id)
    assert from_gguf.add_bos_token == from_folder.add_bos_token == FAMILY_SPECS[name].add_bos
    messages = [("system", "Be brief."), ("user", "hi")]
    assert from_gguf.render_chat(messages) == from_folder.render_chat(messages)
    if FAMILY_SPECS[name].chat_template is None:
        assert from_gguf.chat_template_kind == "plain"
        assert from_gguf.render_chat(messages) == "system: Be brief.\nuser: hi\nassistant:"
    if FAMILY_SPECS[name].add_bos:  # encode() adds BOS once, as the file says; encode_ids never does
        ids = from_gguf.encode("hi").input_ids
        assert ids[0] == from_gguf.bos_token_id and ids[1:] == from_gguf.encode_ids("hi")
        assert from_gguf.encode(from_gguf.render_chat(messages)).input_ids.count(from_gguf.bos_token_id) == 1


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    from tokenizers import Tokenizer as HfTokenizer

    files = vocab_files("spm")
    out = tmp_path_factory.mktemp("family-spm-bos")
    from_gguf = _open(compile_vocab(files.gguf, out / "gguf.kvoc"))
    from_folder = _open(compile_vocab(files.folder, out / "folder.kvoc"))
    llama = llama_cpp.Llama(model_path=str(files.gguf), vocab_only=True, verbose=False)
    return from_gguf, from_folder, llama, HfTokenizer.from_file(str(files.folder / "tokenizer.json"))


def test_spm_with_bos_as_the_files_say_matches_llama_cpp_and_tokenizers(spm):
    from_gguf, from_folder, llama, hf = spm
    # The GGUF leaves add_bos_token and add_space_prefix unsaid: llama.cpp's defaults (both on) apply.
    assert from_gguf.add_bos_token and from_folder.add_bos_token and from_gguf.add_space_prefix
    texts = TEXTS + _specials_texts("spm") + ["▁x ▁▁y", "\u2581", "<s> after bos", "a</s>b<unk>c", "𝔘𝔫𝔦 ꙮ 𓀀"]
    texts = [text for text in texts if not text.startswith("<s>")]  # Keel does not add a second BOS
    wrong = _mismatches(
        texts, lambda text: from_gguf.encode(text).input_ids,
        lambda text: llama.tokenize(text.encode(), add_bos=True, special=True),
        lambda text: hf.encode(text).ids,
        lambda text: from_folder.encode(text).input_ids)
    assert not wrong, f"spm: {len(wrong)} of {len(texts)} texts differ (keel | llama.cpp | hf | keel-folder):\n" \
        + "\n".join(wrong[:10])


def test_spm_byte_fallback_and_space_prefix(spm):
    from_gguf, _, llama, _ = spm
    ids = from_gguf.encode_ids("ꙮ")  # a character no token has: its three <0xXX> tokens after "▁"
    assert [from_gguf.decode([i]) for i in ids[-3:]] == ["\ufffd"] * 3 and from_gguf.decode(ids) == "ꙮ"
    assert llama.tokenize("hi".encode(), add_bos=False, special=True) == from_gguf.encode_ids("hi")
    assert from_gguf.encode_ids("<s>hi")[1:] == from_gguf.encode_ids("hi")  # a prefix after a special token


@pytest.mark.parametrize("skip", [False, True])
def test_spm_decodes_like_tokenizers_and_round_trips(spm, skip):
    from_gguf, from_folder, _, hf = spm
    for text in TEXTS + _specials_texts("spm"):
        for keel in (from_gguf, from_folder):
            ids = keel.encode(text).input_ids
            assert keel.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), repr(text)
            stream = keel.stream_decoder(skip_special_tokens=skip)
            assert "".join(map(stream.push, ids)) + stream.finish() == keel.decode(ids, skip_special_tokens=skip)
            if skip and not any(special in text for special in FAMILY_SPECS["spm"].specials):
                assert keel.decode(ids, skip_special_tokens=True) == text, repr(text)


def test_shipped_smollm2_matches_llama_cpp(tok):
    llama = llama_cpp.Llama(model_path=str(shipped_gguf()), vocab_only=True, verbose=False)
    # Bytes SmolLM2's vocabulary lacks: Hugging Face (Keel's reference, test_parity) drops them and
    # merges across the gap ("!\x04!" -> "!!"), llama.cpp keeps the neighbours apart. Known divergence.
    texts = [text for text in TEXTS + _specials_texts("qwen2")
             if tok._bpe.without_dropped_bytes(text.encode()) == text.encode()]
    assert len(texts) >= 170
    wrong = _mismatches(texts, tok.encode_ids, lambda text: llama.tokenize(text.encode(), add_bos=False, special=True))
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ (keel | llama.cpp):\n" + "\n".join(wrong[:10])


def _folder(tmp_path, pre_tokenizer=None, model_type="BPE"):
    files = vocab_files("qwen2")
    spec = json.loads((files.folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["type"] = model_type
    if pre_tokenizer is not None:
        spec["pre_tokenizer"] = pre_tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("pre_tokenizer, model_type, named", [
    ({"type": "Metaspace", "replacement": "▁"}, "BPE", "Metaspace"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{L}+|\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
     "BPE", r"\\p{L}+|\\s+"),
    (None, "Unigram", "Unigram"),
])
def test_unknown_folder_tokenizers_are_refused_by_name(tmp_path, pre_tokenizer, model_type, named):
    with pytest.raises(PreconditionFailed) as err:
        compile_vocab(_folder(tmp_path, pre_tokenizer, model_type), tmp_path / "x.kvoc")
    assert err.value.reason == "UNSUPPORTED_TOKENIZER"
    assert named in str(err.value) and "supported" in str(err.value)


def test_spm_folder_with_the_metaspace_pre_tokenizer(tmp_path):
    """Metaspace(prepend_scheme="always") adds no ▁ before a segment that starts with one (unlike
    Prepend, and llama.cpp): Keel follows the folder."""
    from tokenizers import Tokenizer as HfTokenizer

    spec = json.loads((vocab_files("spm").folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    keel = _open(compile_vocab(tmp_path, tmp_path / "x.kvoc"))
    hf = HfTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = TEXTS + _specials_texts("spm")
    texts += ["▁x", " ▁y", "<s> z", "<s>▁z"]
    wrong = _mismatches(texts, keel.encode_ids, lambda text: hf.encode(text, add_special_tokens=False).ids)
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ (keel | hf):\n" + "\n".join(wrong[:10])


@pytest.mark.parametrize("change, named", [
    (lambda spec: spec.update(normalizer={"type": "NFKC"}), "NFKC"),
    (lambda spec: spec.update(decoder={"type": "ByteLevel"}), "ByteLevel"),
    (lambda spec: spec.update(normalizer=None, pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                                              "prepend_scheme": "first", "split": True}), "first"),
])
def test_unknown_spm_folders_are_refused_by_name(tmp_path, change, named):
    spec = json.loads((vocab_files("spm").folder / "tokenizer.json").read_text(encoding="utf-8"))
    change(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(PreconditionFailed) as err:
        compile_vocab(tmp_path, tmp_path / "x.kvoc")
    assert err.value.reason == "UNSUPPORTED_TOKENIZER"
    assert named in str(err.value) and "spm" in str(err.value)


def test_unknown_gguf_pre_tokenizer_is_refused_by_name(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-llm")
    writer.add_token_list(["a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PreconditionFailed) as err:
        compile_vocab(tmp_path / "x.gguf", tmp_path / "x.kvoc")
    assert err.value.reason == "UNSUPPORTED_TOKENIZER"
    assert "'deepseek-llm'" in str(err.value) and "llama-bpe" in str(err.value) and "qwen2" in str(err.value)
