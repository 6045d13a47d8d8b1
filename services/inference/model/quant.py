"""Weight-only int8 and int4 linear layers, swapped in for nn.Linear so the forward code stays format-agnostic.

Both keep the weights quantized in memory and feed the aten CPU kernels bfloat16 activations (the
kernels are 10-30x slower with float32 inputs); the result goes back to the caller's dtype, so the rest
of the model (embeddings, norms, attention, the residual stream) runs in float32 as in the reference.

* int8: one scale per output channel (symmetric, amax / 127), `aten._weight_int8pack_mm`.
* int4: asymmetric groups of `group_size` input channels (min/max -> 16 levels),
  `aten._weight_int4pack_mm_for_cpu` on weights packed by `aten._convert_weight_to_int4pack_for_cpu`.
  The kernel computes w = (q - 8) * scale + zero, so zero = min + 8 * scale.

Every row of the output depends only on that row of the input (no per-batch activation scale, unlike
torch's dynamic quantization); tests/inference/test_formats.py checks it bitwise for M = 1..17.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

QUANTIZED = ("int8", "int4")
INT4_GROUP_SIZE = 32  # the smallest group the kernel takes: the lowest error at a few % more bytes than 64


class _WeightOnlyLinear(torch.nn.Module):
    format = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous())
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Int8Linear(_WeightOnlyLinear):
    """Per-output-channel symmetric int8 weights."""

    format = "int8"

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return aten._weight_int8pack_mm(x, self.qweight, self.scales)


class Int4Linear(_WeightOnlyLinear):
    """Group-wise asymmetric int4 weights (groups along the input dimension)."""

    format = "int4"

    def __init__(self, linear: torch.nn.Linear, group_size: int = INT4_GROUP_SIZE):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        n, k = linear.out_features, linear.in_features
        if k % group_size:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
        self.group_size = group_size
        groups = linear.weight.detach().float().reshape(n, k // group_size, group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = (hi - lo).clamp(min=1e-12) / 15
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.register_buffer("packed", aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [k / group, n, 2]: (scale, zero) per group and output channel, the layout the kernel reads.
        self.register_buffer("scales_and_zeros", torch.stack([scale, lo + 8 * scale], -1)
                             .transpose(0, 1).contiguous().to(torch.bfloat16))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


def quantize_linears(model: torch.nn.Module, format: str, group_size: int = INT4_GROUP_SIZE) -> torch.nn.Module:
    """Replace every nn.Linear of `model` (lm_head included) by its weight-only `format` version, in place.

    A tied lm_head gets its own quantized copy; the float embedding it was tied to stays as it is.
    """
    if format not in QUANTIZED:
        raise ValueError(f"unknown weight-only format {format!r}; expected one of {QUANTIZED}")
    names = [name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    for name in names:  # one layer at a time, so the float weight is freed before the next is quantized
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, Int8Linear(linear) if format == "int8" else Int4Linear(linear, group_size))
        del linear
    if hasattr(model, "config"):
        model.config.tie_word_embeddings = False  # lm_head is no longer the embedding matrix
    return model
