"""The base model an adapter is bound to, as named fields: any bound field that differs refuses the adapter.

Bound fields: the weights hash (model/digest.py model_sha256: sha256 over the model folder's config and
weight files, computed once per process start and shared with the engine fingerprint), the
config.json values an adapter's training depends on (rope_theta, vocab_size, tie_word_embeddings and
the shape), the hashes of Keel's tokenizer vocabulary and chat template, and the torch, transformers
and peft versions. `digest` is the sha256 of the bound fields (the registry's matrix key and
ListAdapters.base_fingerprint).

The fields also carry `format`, the weight format the check run was made in (FORMAT_FIELD). It is
recorded, not bound: an adapter belongs to the weights, and the format a stage serves them in is a
choice made at start (`engine.format: auto`). When the serving format differs from the one the golden
outputs were made in, the start-up checks judge the adapter by the drift gate instead of by exact
greedy equality (registry._judge).
"""
from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from pathlib import Path

CONFIG_FIELDS = ("rope_theta", "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def config_values(config: dict) -> dict[str, str]:
    """The CONFIG_FIELDS of a config.json (rope_theta may sit under rope_parameters)."""
    values = dict(config)
    if "rope_theta" not in values:
        values["rope_theta"] = (values.get("rope_parameters") or {}).get("rope_theta")
    return {k: json.dumps(values.get(k)) for k in CONFIG_FIELDS}


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def tokenizer_hashes(tokenizer) -> dict[str, str]:
    """The tokenizer's identity (services/tokenizer/core.py computes both hashes at its warm-up)."""
    return {"tokenizer_vocab_sha256": tokenizer.vocab_sha256, "chat_template_sha256": tokenizer.chat_template_sha256}


def base_fields(weights_sha256: str, config: dict, tokenizer: dict[str, str], format: str) -> dict[str, str]:
    return {"weights_sha256": weights_sha256, **config_values(config), **tokenizer, "format": format,
            # Installed versions, read from the packages' metadata: importing transformers and peft would
            # cost the stage seconds at every start.
            **{name: version(name) for name in ("torch", "transformers", "peft")}}


FORMAT_FIELD = "format"


def bound(fields: dict[str, str]) -> dict[str, str]:
    """The fields an adapter is bound to: all but the format the check run was made in."""
    return {k: v for k, v in fields.items() if k != FORMAT_FIELD}


def digest(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(bound(fields), sort_keys=True).encode()).hexdigest()


def differing(recorded: dict[str, str], running: dict[str, str]) -> list[str]:
    """Names of the bound fields whose values differ (or exist on one side only), sorted."""
    recorded, running = bound(recorded), bound(running)
    return sorted(k for k in set(recorded) | set(running) if recorded.get(k) != running.get(k))


def open_tokenizer(path: Path):
    """Keel's tokenizer (the stage's own code, services/tokenizer), warmed up so it renders chats."""
    from services.tokenizer.core import Tokenizer
    tokenizer = Tokenizer.open(Path(path))
    tokenizer.warmup()
    return tokenizer
