"""Tiny byte-level BPE vocabularies, one per pre-tokenizer family, as a Hugging Face folder and a GGUF.

`vocab_files(family)` returns a VocabFiles: `folder` (tokenizer.json + tokenizer_config.json, as the
`tokenizers` library saves a tokenizer trained offline here on the embedded multilingual corpus plus
this file's own source) and `gguf` (the same vocabulary as llama.cpp's converter writes it:
tokenizer.ggml.model "gpt2", .pre, .tokens, .token_type, .merges, the special ids, the chat template,
and the few llama-architecture keys llama.cpp reads before it stops at ``vocab_only=True``; no tensors).

The pre-tokenizer is what the real tokenizer.json files of the families carry:
Sequence[Split(regex, "Isolated"), ByteLevel(use_regex=False)], with ``ignore_merges`` set on the
model for Llama 3. Families (FAMILY_SPECS): gpt2 (GGUF pre "gpt-2", no chat template), llama-bpe,
qwen2, and spm: SentencePiece-style BPE in Llama 2's layout (<unk> <s> </s>, the 256 <0xXX> byte
tokens, then the trained pieces; tokenizer.json BPE(byte_fallback) with the normalizer Prepend("▁") +
Replace(" ", "▁") and the decoder Replace/ByteFallback/Fuse/Strip; the GGUF has tokenizer.ggml.model
"llama" with scores and leaves add_bos_token and add_space_prefix to llama.cpp's defaults, both on).
Cached under var/vocabs/<family>-<hash of the spec, the corpus, this file, the libraries>.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from services.tokenizer.pretokenize import FAMILIES
from shared.config import ROOT_DIR
from testing.cache import built_once

CACHE = Path(ROOT_DIR) / "var" / "vocabs"
MERGES = 3000

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's 2024-11-29, isn't it? We'll see; they've said so.
She'd rather not. I'm sure you're right: THE DOG'S BONE, the cat's toy, it'S fine, we'LL go.
Numbers: 1, 22, 333, 4444, 55555, 3.14159, 2.71828, 1e-9, 0x1F, 100%, $9.99, #42, v1.2.3.
Le renard brun rapide saute par-dessus le chien paresseux. C'est l'été, n'est-ce pas ? À bientôt !
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übung, Äpfel und Öl.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la niña? ¡Mañana será otro día!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Всё хорошо, спасибо.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Καλημέρα κόσμε!
敏捷的棕色狐狸跳过了懒狗。中文分词测试，这是一个没有空格的很长的句子。我们今天去公园散步吧。
日本語の文章です。東京は日本の首都です。ひらがなとカタカナ、そして漢字を使います。
한국어 문장입니다. 서울은 대한민국의 수도입니다. 안녕하세요, 반갑습니다!
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم، كيف حالك اليوم؟ ١٢٣ ٤٥٦
השועל החום המהיר קופץ מעל הכלב העצלן. שלום עולם!
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। नमस्ते दुनिया! १२३४
Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧 🇫🇷 🇯🇵 ❤️ ✨ 🚀 — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ∞ ≠ ≤ ≥.
    def fibonacci(n: int) -> int:
        if n < 2:
            return n
        return fibonacci(n - 1) + fibonacci(n - 2)

\tfor (int i = 0; i < 10; ++i) { printf("%d\\n", i); }
<html><body class="main"><p>Hello, world!</p></body></html>
{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;
   trailing spaces   \t\t
\r\nwindows line\r\nanother\r\n
"""


@dataclass(frozen=True)
class FamilySpec:
    gguf_pre: str  # tokenizer.ggml.pre as llama.cpp names it
    specials: tuple[str, ...]  # special tokens (ids 0..), first the end of text
    bos: str | None
    eos: str
    chat_template: str | None
    add_bos: bool


_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
           "{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
           "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

_LLAMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
SPM_PIECES = 700  # vocabulary size the SentencePiece-style trainer aims at (before the byte tokens)

FAMILY_SPECS = {
    "gpt2": FamilySpec("gpt-2", ("<|endoftext|>",), "<|endoftext|>", "<|endoftext|>", None, False),
    "llama-bpe": FamilySpec("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                          "<|end_header_id|>", "<|eot_id|>"),
                            "<|begin_of_text|>", "<|eot_id|>", _LLAMA3, True),
    "qwen2": FamilySpec("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", _CHATML,
                        False),
    "spm": FamilySpec("", ("<unk>", "<s>", "</s>"), "<s>", "</s>", _LLAMA2, True),
}


@dataclass(frozen=True)
class VocabFiles:
    family: str
    folder: Path  # tokenizer.json + tokenizer_config.json
    gguf: Path


def training_text() -> str:
    return CORPUS + Path(__file__).read_text(encoding="utf-8")


def _key(family: str) -> str:
    import gguf
    import tokenizers

    digest = hashlib.sha256(json.dumps([family, FAMILY_SPECS[family].__dict__, MERGES, tokenizers.__version__,
                                        gguf.__version__ if hasattr(gguf, "__version__") else ""]).encode())
    digest.update(Path(__file__).read_bytes())
    return f"{family}-{digest.hexdigest()[:16]}"


def vocab_files(family: str) -> VocabFiles:
    """The family's tiny vocabulary, trained and written once, then read from the cache."""
    out = built_once(CACHE / _key(family), lambda folder: _build(family, folder))
    return VocabFiles(family, out, out / "vocab.gguf")


def _build(family: str, out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if family == "spm":
        return _build_spm(out)
    spec, fam = FAMILY_SPECS[family], FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(fam.hf_split or fam.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(spec.specials) + MERGES, min_frequency=1,
                                  special_tokens=list(spec.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text().splitlines(keepends=True), trainer)
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = fam.ignore_merges
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec.bos, "eos_token": spec.eos,
              "add_bos_token": spec.add_bos, "add_eos_token": False, "model_max_length": 8192}
    if spec.chat_template:
        config["chat_template"] = spec.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    _write_gguf(out / "vocab.gguf", data, spec)


def _gguf_writer(path: Path, name: str, n_vocab: int):
    """A GGUF writer with the few llama-architecture keys llama.cpp reads before it stops at
    ``vocab_only=True`` (no tensors needed)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name(name)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    return writer


def write_gguf_user_defined(family: str, path: Path) -> Path:
    """A byte-level family's vocabulary as a GGUF whose added tokens are USER_DEFINED (4), as llama.cpp's
    converter writes a Hugging Face added token that is not special (Qwen2.5's tool-call markers, say)."""
    data = json.loads((vocab_files(family).folder / "tokenizer.json").read_text(encoding="utf-8"))
    _write_gguf(path, data, FAMILY_SPECS[family], special_type=4)
    return path


def write_gguf_with_ids_from(family: str, path: Path, first_id: int) -> Path:
    """A byte-level family's vocabulary as a GGUF whose real tokens start at id `first_id`: ids below are
    filler tokens no merge or piece produces, so a text's ids are the family's plus `first_id` (large
    vocabularies, Llama 3's 128k and Qwen2's 152k, without shipping one)."""
    data = json.loads((vocab_files(family).folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    data["model"]["vocab"] = {**{f"<filler-{i}>": i for i in range(first_id)},
                              **{t: i + first_id for t, i in vocab.items()}}
    _write_gguf(path, data, FAMILY_SPECS[family])
    return path


def _write_gguf(path: Path, data: dict, spec: FamilySpec, special_type: int = 3) -> None:
    import gguf

    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids are not dense"
    special = set(spec.specials)
    writer = _gguf_writer(path, f"keel-tiny-{spec.gguf_pre}", len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.gguf_pre)
    writer.add_token_list(tokens)
    writer.add_token_types([special_type if t in special else int(gguf.TokenType.NORMAL) for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    if spec.bos is not None:
        writer.add_bos_token_id(vocab[spec.bos])
    writer.add_eos_token_id(vocab[spec.eos])
    writer.add_add_bos_token(spec.add_bos)
    writer.add_add_eos_token(False)
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _build_spm(out: Path) -> None:
    """Merges as transformers derives them from a SentencePiece model (every split of a piece into two
    pieces, ordered by the piece's id), scores -id, so llama.cpp's score-driven merging and the
    folder's rank-driven one agree."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    spec = FAMILY_SPECS["spm"]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    # Training splits before ▁ (as SentencePiece does), so no piece holds ▁ after its first character;
    # few characters make the alphabet, so the byte fallback is exercised.
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=SPM_PIECES, special_tokens=[], show_progress=False, limit_alphabet=120,
                                  min_frequency=2)
    trainer_tok.train_from_iterator(training_text().splitlines(keepends=True), trainer)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trained = sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [*spec.specials, *byte_tokens, *(t for t, _ in trained if t not in byte_tokens + list(spec.specials))]
    ids = {t: i for i, t in enumerate(tokens)}
    first = len(spec.specials) + 256
    merges = []
    for piece in tokens[first:]:
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        merges += sorted((ids[a], ids[b], a, b) for a, b in splits if ids.get(a, 0) >= first and ids.get(b, 0) >= first)
    tok = Tokenizer(models.BPE(vocab=ids, merges=[(a, b) for _, _, a, b in merges], byte_fallback=True,
                               unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.specials])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", ids["<s>"])])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": spec.bos, "eos_token": spec.eos,
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "chat_template": spec.chat_template,
              "legacy": True, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")

    import gguf

    writer = _gguf_writer(out / "vocab.gguf", "keel-tiny-spm", len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    writer.add_token_types([int(t) for t in types] + [int(gguf.TokenType.NORMAL)] * (len(tokens) - first))
    writer.add_token_scores([0.0] * first + [float(-i) for i in range(first, len(tokens))])
    writer.add_unk_token_id(ids["<unk>"])
    writer.add_bos_token_id(ids["<s>"])
    writer.add_eos_token_id(ids["</s>"])
    writer.add_chat_template(spec.chat_template)  # add_bos_token, add_space_prefix: llama.cpp's defaults
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
