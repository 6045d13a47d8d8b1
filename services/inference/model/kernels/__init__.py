"""Keel's CPU kernels: matmul over GGUF-quantized weight blocks, and the block formats' layer ops.

    from services.inference.model.kernels import load, KernelUnavailable, SUPPORTED_TYPES
    k = load()                     # builds on first use, then loads the cached library
    y = k.matmul(x, w, 3, n)       # gguf_mm.cpp: x [M, K] float32, w [n, K/32*20] uint8 Q4_1 blocks -> y [M, n]
                                   # (any of MM_TYPES: F32, F16, BF16, Q4_0..Q8_0, Q4_K, Q5_K, Q6_K)
    y = k.matmul_q8(x, wp, 3, n)   # gguf_q8.cpp: the same blocks interleaved by 16 rows (blocks.pack_x16),
                                   # activations quantized to 8 bits per block, integer dot products
    torch.ops.keel.rms_norm, .rope_store, .decode_attention_   # layer_ops.cpp: the step's other work
    torch.ops.keel.layer_attention, .layer_mlp                 # layer.cpp: a decoder layer in two calls
    torch.ops.keel.gguf_rows(w, ids, 3, x16)                   # gguf_rows.cpp: rows of w dequantized (the embedding)
    torch.ops.keel.row_stats(logits, scores, tokens, -1)       # rowstats.cpp: the sampler's max, sum, entropy, argmax

The library is compiled once per source (torch.utils.cpp_extension, -O3, no -march=native: the
SIMD paths are chosen at run time) and cached under ``ROOT_DIR/build/kernels/<hash>/``, the hash
covering the sources, the flags and the torch version. A build happens in a private temporary folder
that is renamed into place, so two processes building at once cannot leave a half-written cache; a
later process only loads the ``.so``. ``python -m services.inference.model.kernels`` builds it ahead of time.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from shared.config import ROOT_DIR

__all__ = ["BLOCK", "ISAS", "K_TYPES", "MM_TYPES", "Q8_ISAS", "SUPPORTED_TYPES", "KernelUnavailable", "Kernels",
           "QuantType", "load"]


class QuantType(NamedTuple):
    name: str
    block_bytes: int  # bytes per block of BLOCK weights
    scale_bytes: int  # of which the fp16 scales at its start: d and m (Q4_1, Q5_1), d (the others)


BLOCK = 32  # weights per ggml block, along the input dimension K
# gguf_q8_mm's types (blocks.pack_x16's layout)
SUPPORTED_TYPES: dict[int, QuantType] = {2: QuantType("Q4_0", 18, 2), 3: QuantType("Q4_1", 20, 4),
                                         6: QuantType("Q5_0", 22, 2), 7: QuantType("Q5_1", 24, 4),
                                         8: QuantType("Q8_0", 34, 2)}
# The ggml type ids keel::gguf_mm computes (their block layouts: gguf_mm.cpp; sizes: gguf.GGML_QUANT_SIZES):
# F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16.
MM_TYPES = (0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30)
K_TYPES = (12, 13, 14)  # Q4_K, Q5_K, Q6_K: keel::gguf_q8k_mm's, on superblocks.pack_x16k's layout
ISAS = ("portable", "avx2", "avx512")  # a path's position here is its code in keel::gguf_mm's isa
Q8_ISAS = ("portable", "avx2", "avx512_vnni")  # the same for keel::gguf_q8_mm

SOURCES = tuple(Path(__file__).with_name(f)
                for f in ("gguf_mm.cpp", "gguf_rows.cpp", "gguf_q8.cpp", "gguf_q8k.cpp", "layer_ops.cpp", "layer.cpp",
                          "rowstats.cpp"))
# Included by the sources: part of the build's hash.
HEADERS = tuple(Path(__file__).with_name(f) for f in ("common.h", "deq32.h", "expf.h", "ops.h", "q8act.h"))
LIB_NAME = "keel_gguf_mm"
# -ffp-contract=off: no fused multiply-adds the source did not write. -fopenmp: at::parallel_for is
# torch's OpenMP loop, inlined into the kernel; without the flag it runs on one thread.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
CACHE_DIR = ROOT_DIR / "build" / "kernels"


class KernelUnavailable(Exception):
    """The kernel library cannot be built or loaded on this host; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Kernels:
    """The loaded library. ``isas`` / ``q8_isas``: the paths of gguf_mm / gguf_q8_mm this host can run,
    best first; ``isa``: gguf_mm's default."""

    isas: tuple[str, ...]
    q8_isas: tuple[str, ...]
    path: Path  # the .so

    @property
    def isa(self) -> str:
        return self.isas[0]

    def matmul(self, x: torch.Tensor, w: torch.Tensor, ggml_type: int, n: int, isa: str | None = None) -> torch.Tensor:
        """y [M, n] = x [M, K] @ dequant(w [n, K/E*bytes]).T, w of a type in MM_TYPES; ``isa`` None runs the
        best path."""
        if isa is not None and isa not in ISAS:
            raise ValueError(f"unknown isa {isa!r}; known: {', '.join(ISAS)}")
        return torch.ops.keel.gguf_mm(x, w, ggml_type, n, -1 if isa is None else ISAS.index(isa))

    def matmul_q8(self, x: torch.Tensor, w: torch.Tensor, ggml_type: int, n: int,
                  isa: str | None = None) -> torch.Tensor:
        """y [M, n] ~= x [M, K] @ dequant(w).T, w [ceil(n/16), K/32*16*bytes] (blocks.pack_x16), with x
        quantized to 8 bits per 32-block; ``isa`` None runs the best path."""
        if isa is not None and isa not in Q8_ISAS:
            raise ValueError(f"unknown isa {isa!r}; known: {', '.join(Q8_ISAS)}")
        return torch.ops.keel.gguf_q8_mm(x, w, ggml_type, n, -1 if isa is None else Q8_ISAS.index(isa))


    def matmul_q8k(self, x: torch.Tensor, w: torch.Tensor, ggml_type: int, n: int,
                   isa: str | None = None) -> torch.Tensor:
        """y [M, n] ~= x [M, K] @ dequant(w).T for a K-quant w [ceil(n/16), K/256 * U] (superblocks.pack_x16k),
        x quantized to 8 bits per 32-block; ``isa`` None runs the best path."""
        if isa is not None and isa not in Q8_ISAS:
            raise ValueError(f"unknown isa {isa!r}; known: {', '.join(Q8_ISAS)}")
        return torch.ops.keel.gguf_q8k_mm(x, w, ggml_type, n, -1 if isa is None else Q8_ISAS.index(isa))


_lock = threading.Lock()
_loaded: Kernels | None = None


def load() -> Kernels:
    """The kernels, built if this source has no cached build yet. Raises KernelUnavailable."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _digest() -> str:
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        h.update(source.read_bytes())
    h.update(repr((CFLAGS, torch.__version__)).encode())
    return h.hexdigest()[:24]


def _registered() -> bool:
    try:
        torch.ops.keel.gguf_mm
    except (AttributeError, RuntimeError):
        return False
    return True


def _load() -> Kernels:
    final = CACHE_DIR / _digest()
    so = final / f"{LIB_NAME}.so"
    if not _registered():
        if not so.exists():
            _build(final, so)  # loads the library it builds
        if not _registered():
            try:
                torch.ops.load_library(str(so))
            except OSError as e:
                raise KernelUnavailable(f"cannot load {so}: {e}") from None
    return Kernels(isas=tuple(torch.ops.keel.gguf_isas()), q8_isas=tuple(torch.ops.keel.gguf_q8_isas()), path=so)


def _build(final: Path, so: Path) -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler: {cxx!r} is not on PATH")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    except OSError as e:
        raise KernelUnavailable(f"cannot create a build folder under {final.parent}: {e}") from None
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=LIB_NAME, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                           extra_ldflags=["-fopenmp"],
                           build_directory=str(tmp), is_python_module=False, verbose=False)
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            tmp.rename(final)
        except OSError:  # another process renamed its build into place first: keep that one
            if not so.exists():
                raise
    except Exception as e:  # compiler errors, ninja missing, unwritable cache: the caller gets a reason
        tail = "\n".join(str(e).strip().splitlines()[-20:])
        names = ", ".join(s.name for s in SOURCES)
        raise KernelUnavailable(f"building {names} failed: {type(e).__name__}: {tail}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
