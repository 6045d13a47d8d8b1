"""Load the serving model in one weight format and build a tiny random one for tests.

Formats: float32, bfloat16, float16 (the whole model cast), int8 and int4 (weight-only: every Linear,
lm_head included, swapped for a quantized module from quant.py; the rest stays float32), and gguf and
gguf_f32 (the model file's own blocks, of whichever types it holds, on Keel's C++ kernels with 8-bit or
float32 activations, blocks.py; read from the GGUF, never converted from another format; the rest stays
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

from services.inference.model import blocks, ggufmodel, kernels, llama
from services.inference.model.quant import QUANTIZED, quantize_linears
from shared.errors import InvalidInput

FORMATS = ("float32", "bfloat16", "float16") + QUANTIZED + blocks.FORMATS
# Formats whose models cannot be converted to another format: the others are loaded from the files.
FROM_FILE_ONLY = QUANTIZED + blocks.FORMATS
AUTO = "auto"  # the stage picks a format at start (formats/selection.py); a model is never "auto"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_format(format: str, device: str = "cpu", allow_auto: bool = False, model_dir: Path | None = None) -> None:
    """InvalidInput unless `format` runs on `device` (and, given `model_dir`, a prepared folder or a GGUF
    file, can load that model)."""
    if format == AUTO and allow_auto:
        return
    if format not in FORMATS:
        expected = ((AUTO,) if allow_auto else ()) + FORMATS
        raise InvalidInput(f"unknown format {format!r}; expected one of {expected}", reason="UNKNOWN_FORMAT",
                           metadata={"format": format})
    if format in FROM_FILE_ONLY and device != "cpu":
        # The weight-only kernels used here (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu, Keel's
        # gguf_mm) are CPU ones; on another device the dequantized formats (float32, bfloat16) serve.
        raise InvalidInput(f"{format} runs on CPU only", reason="UNSUPPORTED_FORMAT",
                           metadata={"format": format, "device": device})
    if format in blocks.FORMATS:
        try:
            kernels.load()
        except kernels.KernelUnavailable as exc:
            raise InvalidInput(f"{format} needs Keel's C++ kernel, which is unavailable here: {exc.reason}",
                               reason="KERNEL_UNAVAILABLE", metadata={"format": format}) from exc
        if model_dir is not None:
            blocks.check_file(Path(model_dir), format)


def convert_model(model: torch.nn.Module, format: str, device: str = "cpu") -> torch.nn.Module:
    """Return `model` in `format` (a copy when a conversion is needed); quantized models cannot be converted."""
    check_format(format, device)
    if model.format == format:
        return model
    if model.format in FROM_FILE_ONLY or format in blocks.FORMATS:
        raise InvalidInput(f"a {model.format} model cannot be converted to {format} (load it from the files)",
                           reason="UNSUPPORTED_FORMAT", metadata={"format": format})
    return _to_format(copy.deepcopy(model), format, device)


def model_in_format(reference: torch.nn.Module, format: str, model_dir: Path, device: str = "cpu") -> torch.nn.Module:
    """`reference` (float32) in `format`: converted, or for the gguf formats read from the model's GGUF."""
    if format in blocks.FORMATS:
        return load_model(model_dir, format, device)
    return convert_model(reference, format, device)


def residual_dtype(model: torch.nn.Module) -> torch.dtype:
    """The torch dtype of the residual stream (embeddings, norms, attention): the norms' weights' dtype."""
    return model.model.norm.weight.dtype


def load_model(path: str | Path, format: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load a Llama-family causal LM (llama.ARCHITECTURES) in eval mode, without grad, from a safetensors
    directory (`make model`'s) or a .gguf file (ggufmodel.py: the float formats dequantize its tensors,
    the block formats compute on them)."""
    check_format(format, device)
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        if format in blocks.FORMATS:
            return blocks.load_gguf(path, format)
        return _to_format(ggufmodel.load(path), format, device)
    if not (path / "config.json").exists():
        raise InvalidInput(f"no model at {path} (config.json missing); run `make model`",
                           reason="MODEL_NOT_FOUND", metadata={"path": str(path)})
    if format in blocks.FORMATS:
        return blocks.load(path, format)
    return _to_format(llama.load(path), format, device)


def _to_format(model: torch.nn.Module, format: str, device: str) -> torch.nn.Module:
    """A float model (llama.load's, or a copy of one) in `format`, which it carries from here on."""
    model.format = format
    if format in QUANTIZED:
        model = quantize_linears(model.to(dtype=torch.float32), format).eval()
        # The float tensors left (embedding, norms) may still be views of the mmapped weight file;
        # copies let the whole mapping go, so the process keeps only what the format needs.
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    elif model.device == torch.device(device) and residual_dtype(model) == _TORCH_DTYPES[format]:
        return model.eval()  # nothing converted, nothing freed: no collection to pay for (~0.2 s)
    else:
        model = model.to(device=device, dtype=_TORCH_DTYPES[format]).eval()
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
