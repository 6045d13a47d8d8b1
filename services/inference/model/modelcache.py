"""The served model's prepared folder: what the weight formats load, once per model.

Run: python -m services.inference.model.modelcache [--model PATH]   (what `make model` does)

A model source (shared/modelfile.py) is prepared into var/models/<key>/:
  GGUF    dequantized (ggufmodel.py) into config.json + model.safetensors, which then load in ~0.1 s
          where the dequantization takes seconds; keel-source.json names the GGUF and its digest (the
          gguf formats read the blocks from it, ggufindex.py its tensor table); hf-tokenizer/ is the
          tokenizer.json the grammar engine reads (engine/grammar.py), made by transformers' GGUF
          tokenizer conversion (the one use of transformers here)
  folder  links to its config.json, safetensors and tokenizer files, nothing converted
The inference stage prepares a model it finds unprepared at start, in a child process running this
module (server.py says why); `make model` does it ahead for the configured one. A folder is written
under a temporary name and renamed, so a start that is killed half-way, or two replicas preparing at
once, never leave a partial folder.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.inference.model import ggufindex, ggufmodel
from shared import modelfile
from shared.modelfile import GGUF, ModelSource

SOURCE_FILE = "keel-source.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "hf-tokenizer"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def is_prepared(source: ModelSource) -> bool:
    """Whether `source`'s folder is prepared from these bytes at this path: a folder's links and a GGUF's
    record point at where the model was, which may be gone (a model folder moved or copied elsewhere)."""
    try:
        recorded = json.loads((source.cache_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (recorded.get("digest"), recorded.get("path")) == (source.digest, str(source.path))


def prepared(source: ModelSource | None = None) -> Path:
    """The prepared folder of `source` (default: the served model), prepared now unless `is_prepared`."""
    source = source or modelfile.source()
    out = source.cache_dir
    if is_prepared(source):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{source.key}-", dir=out.parent))
    try:
        (_convert_gguf if source.kind == GGUF else _link_folder)(source, work)
        (work / SOURCE_FILE).write_text(json.dumps({"gguf": str(source.path) if source.kind == GGUF else None,
                                                    **source.as_dict()}))
        if out.exists():  # a stale or partial folder of the same key: replaced whole
            shutil.rmtree(out, ignore_errors=True)
        os.replace(work, out)
    except OSError:
        if not (out / SOURCE_FILE).exists():  # another process did not win the race either
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if source.kind == GGUF:
        ggufindex.index(out, source.path)  # the gguf formats' tensor table (kept while it matches the file)
    return out


def _convert_gguf(source: ModelSource, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    src = source.path
    model = ggufmodel.load(src)  # Keel's own reading: every tensor dequantized exactly (gguf-py)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the embedding matrix is lm_head's weight
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_json(), indent=1))
    # bandit B615 does not apply: a local GGUF.
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)  # nosec B615
    tokenizer.save_pretrained(out / TOKENIZER_DIR)


def _link_folder(source: ModelSource, out: Path) -> None:
    names = ["config.json", "generation_config.json"] + [p.name for p in source.path.glob("*.safetensors")]
    for name in names:
        if (source.path / name).exists():
            (out / name).symlink_to(source.path / name)
    (out / TOKENIZER_DIR).mkdir()
    for name in _TOKENIZER_FILES:
        if (source.path / name).exists():
            (out / TOKENIZER_DIR / name).symlink_to(source.path / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF or a folder (default: the served model)")
    args = ap.parse_args(argv)
    print(f"model prepared at {prepared(modelfile.source(args.model))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
