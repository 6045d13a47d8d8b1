"""GGUFs of the weight types people download, made by llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`), built once and cached like testing/tinymodels.py's models.

    quantized(source, "Q4_K_M")   # source: a float GGUF (F32); -> var/quantized/<stem>-Q4_K_M-<hash>/model.gguf
    smollm2("Q6_K")               # the shipped SmolLM2, from an F32 GGUF of its weights
    tiny("Q5_K_M")                # tiny_model_files("llama-wide", "F32"), hidden 256: the K-quants fit it

The quantizer chooses per tensor as llama-quantize does: Q4_K_M keeps attn_v and half the ffn_down in
Q6_K, the tied embedding in Q6_K, and a matrix whose rows are not a multiple of 256 (SmolLM2's hidden
576) falls back to Q5_0 (for Q4_K), Q5_1 (Q5_K) or Q8_0 (Q6_K): these are mixed files, as downloaded.
The shipped SmolLM2 is Q4_1, so its F32 GGUF is made first by the same quantizer with ftype ALL_F32 and
allow_requantize, the exact dequantization of those blocks (what `make model`'s float32 holds); every
other type is quantized from that F32 file, never re-quantized from Q4_1's blocks.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path

from shared.config import ROOT_DIR
from shared.modelfile import shipped_gguf
from testing.cache import built_once
from testing.tinymodels import tiny_model_files

CACHE = Path(ROOT_DIR) / "var" / "quantized"
# llama-quantize's names (llama_cpp.LLAMA_FTYPE_<...>): what Keel serves, and two it refuses.
SERVED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")
REFUSED = ("Q3_K_M", "Q2_K")
THREADS = 2


def _ftype(name: str) -> int:
    import llama_cpp

    return getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if name == "F32" else f"LLAMA_FTYPE_MOSTLY_{name}")


def _quantize(source: Path, out: Path, ftype: str, requantize: bool = False) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = _ftype(ftype), THREADS, requantize
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source.name} -> {ftype}) returned {rc}")


def _key(source: Path, ftype: str) -> str:
    """The source file (path, size, mtime), the type, llama.cpp's version and this file's source."""
    import llama_cpp

    st = source.stat()
    blob = json.dumps({"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "ftype": ftype, "llama_cpp": llama_cpp.__version__})
    return hashlib.sha256(blob.encode() + Path(__file__).read_bytes()).hexdigest()[:12]


def quantized(source: Path, ftype: str, requantize: bool = False) -> Path:
    """`source` quantized to `ftype` (a llama-quantize name) by llama.cpp, cached."""
    stem = source.parent.name if source.name == "model.gguf" else source.stem
    out = built_once(CACHE / f"{stem}-{ftype}-{_key(source, ftype)}",
                     lambda folder: _quantize(source, folder / "model.gguf", ftype, requantize))
    return out / "model.gguf"


def smollm2(ftype: str) -> Path:
    """SmolLM2-135M in `ftype`, quantized from the F32 GGUF of the shipped Q4_1 file's weights."""
    f32 = quantized(shipped_gguf(), "F32", requantize=True)
    return f32 if ftype == "F32" else quantized(f32, ftype)


def tiny(ftype: str) -> Path:
    """The wide tiny llama (testing/tinymodels.py) in `ftype`."""
    f32 = tiny_model_files("llama-wide", "F32").gguf
    return f32 if ftype == "F32" else quantized(f32, ftype)
