"""What the stages need to know about the served model, read from the model itself.

One `ModelCard` per model source (shared/modelfile.py), from the GGUF's header (shared/ggufmeta.py,
~0.2 s) or a Hugging Face folder's config.json, generation_config.json, tokenizer_config.json and
tokenizer.json:
  architecture        general.architecture / config.json model_type
  context_tokens      the trained context: <arch>.context_length / max_position_embeddings
  stop_token_ids      the ids that end a generation: the end-of-sequence, end-of-turn and end-of-message
                      ids the file names, and every control token whose text is one of llama.cpp's
                      end-of-generation texts (EOG_TEXTS, as llama-vocab.cpp marks them), so Keel stops
                      where llama.cpp stops on the same file
  chat_template       the model's Jinja template, or None (the tokenizer stage then renders plainly)
The tokenizer stage compiles the vocabulary itself (services/tokenizer/compiler.py); this card holds
only what other stages read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType

from shared import ggufmeta
from shared.config import ConfigError
from shared.modelfile import GGUF, ModelSource

# Token texts llama.cpp treats as end of generation (llama-vocab.cpp, the common chat families).
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                       "<EOT>", "_<EOT>", "<|end_of_text|>"})
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens


@dataclass(frozen=True)
class ModelCard:
    source: ModelSource
    name: str                         # the name the metadata gives (general.name), else the model id
    architecture: str
    context_tokens: int
    stop_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, int] = field(default_factory=dict)  # text -> id of control/added tokens
    weight_types: tuple[str, ...] = ()  # a GGUF's tensor types (ggml names); a folder's safetensors dtypes

    def as_dict(self) -> dict:
        return {**self.source.as_dict(), "name": self.name, "architecture": self.architecture,
                "context_tokens": self.context_tokens, "stop_token_ids": list(self.stop_token_ids),
                "chat_template": "model" if self.chat_template else "plain", "weight_types": list(self.weight_types)}


def read(source: ModelSource) -> ModelCard:
    """The card of `source`; ConfigError naming model.path when the file lacks what every stage needs."""
    return _from_gguf(source) if source.kind == GGUF else _from_folder(source)


def _eog(special: dict[str, int], named: list[int | None]) -> tuple[int, ...]:
    ids = {i for i in named if isinstance(i, int) and i >= 0}
    ids |= {i for text, i in special.items() if text in EOG_TEXTS}
    return tuple(sorted(ids))


def _from_gguf(source: ModelSource) -> ModelCard:
    try:
        h = ggufmeta.read(source.path)
    except ggufmeta.GgufError as exc:
        raise ConfigError(f"field 'model.path' breaks rule 'model': {exc}") from exc
    context = h.arch("context_length")
    if not isinstance(context, int) or context <= 0:
        raise ConfigError(f"field 'model.path' breaks rule 'model': {source.path.name} has no "
                          f"{h.architecture or '<architecture>'}.context_length")
    tokens, types = h.get("tokenizer.ggml.tokens") or [], h.get("tokenizer.ggml.token_type") or []
    special = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k in (GGUF_CONTROL, GGUF_USER_DEFINED)}
    named = [h.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    types = tuple(sorted({_type_name(t.ggml_type) for t in h.tensors.values()}))
    return ModelCard(source, str(h.get("general.name") or source.model_id), h.architecture, context,
                     _eog(special, named), h.get("tokenizer.chat_template"), special, types)


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:  # a type newer than the gguf package
        return str(ggml_type)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"field 'model.path' breaks rule 'model': {path.name} is unreadable: {exc}") from exc


def _from_folder(source: ModelSource) -> ModelCard:
    folder = source.path
    config, generation = _json(folder / "config.json"), _json(folder / "generation_config.json")
    tok_config, tok = _json(folder / "tokenizer_config.json"), _json(folder / "tokenizer.json")
    context = config.get("max_position_embeddings")
    if not isinstance(context, int) or context <= 0:
        raise ConfigError(f"field 'model.path' breaks rule 'model': {folder.name}/config.json has no "
                          "max_position_embeddings")
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    special |= {t["content"]: int(i) for i, t in (tok_config.get("added_tokens_decoder") or {}).items()
                if t.get("special")}
    named: list = []
    for eos in (generation.get("eos_token_id"), config.get("eos_token_id")):
        named += eos if isinstance(eos, list) else [eos]
    eos_text = tok_config.get("eos_token")
    eos_text = eos_text.get("content") if isinstance(eos_text, dict) else eos_text
    named.append(special.get(eos_text) if isinstance(eos_text, str) else None)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    return ModelCard(source, str(config.get("_name_or_path") or source.model_id), str(config.get("model_type", "")),
                     context, _eog(special, named), tok_config.get("chat_template"), special,
                     (dtype,) if dtype else ())
