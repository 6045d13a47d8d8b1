"""Load the serving model in one weight format and build a tiny random one for tests.

Formats: float32, bfloat16, float16 (the whole model cast), int8 and int4 (weight-only: every Linear,
lm_head included, swapped for a quantized module from quant.py; the rest stays float32), and gguf and
gguf_f32 (the model file's own Q4_1/Q8_0 blocks on Keel's C++ kernels with 8-bit or float32
activations, blocks.py; read from the GGUF, never converted from another format; the rest stays
float32). The engine
only relies on the Llama module layout (embed_tokens, layers[i].self_attn.{q,k,v,o}_proj, mlp,
input/post_attention_layernorm, norm, rotary_emb, lm_head) and calls the modules; see forward.py.
The module is Keel's own (llama.py): the serving process never imports transformers.
"""
from __future__ import annotations

import copy
import ctypes
import gc
from pathlib import Path

import torch

from shared.errors import InvalidInput

from services.inference.model import blocks, kernels, llama
from services.inference.model.quant import QUANTIZED, quantize_linears, weight_format

DTYPES = ("float32", "bfloat16", "float16") + QUANTIZED + blocks.FORMATS
# Formats whose models cannot be converted to another format: the others are loaded from the files.
FROM_FILE_ONLY = QUANTIZED + blocks.FORMATS
AUTO = "auto"  # the stage picks a format at start (formats.py); a model is never "auto"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(dtype: str, device: str = "cpu", allow_auto: bool = False) -> None:
    if dtype == AUTO and allow_auto:
        return
    if dtype not in DTYPES:
        expected = ((AUTO,) if allow_auto else ()) + DTYPES
        raise InvalidInput(f"unknown dtype {dtype!r}; expected one of {expected}", reason="UNKNOWN_DTYPE",
                           metadata={"dtype": dtype})
    if dtype in FROM_FILE_ONLY and device != "cpu":
        # The weight-only kernels used here (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu, Keel's
        # gguf_mm) are CPU ones; on another device the dequantized formats (float32, bfloat16) serve.
        raise InvalidInput(f"{dtype} runs on CPU only", reason="UNSUPPORTED_DTYPE",
                           metadata={"dtype": dtype, "device": device})
    if dtype in blocks.FORMATS:
        try:
            kernels.load()
        except kernels.KernelUnavailable as exc:
            raise InvalidInput(f"{dtype} needs Keel's C++ kernel, which is unavailable here: {exc.reason}",
                               reason="KERNEL_UNAVAILABLE", metadata={"dtype": dtype}) from exc


def convert_model(model: torch.nn.Module, dtype: str, device: str = "cpu") -> torch.nn.Module:
    """Return `model` in `dtype` (a copy when a conversion is needed); quantized models cannot be converted."""
    check_dtype(dtype, device)
    if model_dtype(model) == dtype:
        return model
    if model_dtype(model) in FROM_FILE_ONLY or dtype in blocks.FORMATS:
        raise InvalidInput(f"a {model_dtype(model)} model cannot be converted to {dtype} (load it from the files)",
                           reason="UNSUPPORTED_DTYPE", metadata={"dtype": dtype})
    return _to_format(copy.deepcopy(model), dtype, device)


def model_in_format(reference: torch.nn.Module, dtype: str, model_dir: Path, device: str = "cpu") -> torch.nn.Module:
    """`reference` (float32) in `dtype`: converted, or for the gguf formats read from the model's GGUF."""
    return load_model(model_dir, dtype, device) if dtype in blocks.FORMATS else convert_model(reference, dtype, device)


def model_dtype(model: torch.nn.Module) -> str:
    """The format name load_model would use for this model."""
    by_dtype = {v: k for k, v in _TORCH_DTYPES.items()}
    return blocks.block_format(model) or weight_format(model) or by_dtype[residual_dtype(model)]


def residual_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the residual stream (embeddings, norms, attention): the norms' weights' dtype."""
    return model.model.norm.weight.dtype


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load a Llama-family causal LM from a safetensors directory, in eval mode, without grad."""
    check_dtype(dtype, device)
    path = Path(path)
    if not (path / "config.json").exists():
        raise InvalidInput(f"no model at {path} (config.json missing); run `make model`",
                           reason="MODEL_NOT_FOUND", metadata={"path": str(path)})
    if dtype in blocks.FORMATS:
        return blocks.load(path, dtype)
    return _to_format(llama.load(path), dtype, device)


def _to_format(model: torch.nn.Module, dtype: str, device: str) -> torch.nn.Module:
    if dtype in QUANTIZED:
        model = quantize_linears(model.to(dtype=torch.float32), dtype).eval()
        # The float tensors left (embedding, norms) may still be views of the mmapped weight file;
        # copies let the whole mapping go, so the process keeps only what the format needs.
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    elif model.device == torch.device(device) and model_dtype(model) == dtype:
        return model.eval()  # nothing converted, nothing freed: no collection to pay for (~0.2 s)
    else:
        model = model.to(device=device, dtype=_TORCH_DTYPES[dtype]).eval()
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Hand the heap pages the conversion freed (the float weights) back to the OS.

    glibc keeps freed heap memory for reuse, so without this a quantized model's process stays as
    large as the float32 one it was made from."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
