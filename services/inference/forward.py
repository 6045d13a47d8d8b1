"""Ragged-batch forward pass over a Hugging Face Llama model, with one KV cache per request.

Why not `model(...)` with a padded cache: each row here keeps its own cache tensor sized for its whole
request (so memory is reserved once, at admission) and attention runs per row on exactly the shapes it
would have alone. Only the row-wise dense layers (projections, MLP, norms, lm_head) run batched, and
their batch dimension is padded to a size that the BLAS kernels treat identically (see
`calibrate_invariant_sizes`), so a row's logits are bitwise the same alone or inside any batch.

Shapes: P prompt tokens, B rows, H query heads, KV key/value heads, G = H // KV, D head_dim, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from .model import model_dtype


@dataclass
class RowCache:
    """Keys and values of one request: [layers, KV, capacity, D] each; positions < length are valid."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] at positions with cos/sin [..., 1, D] (the same formula as transformers)."""
    return x * cos + rotate_half(x) * sin


class LlamaRunner:
    """Runs prefill (one row) and decode (many rows, one token each) steps over per-row caches."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu"):
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        self.n_layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.heads // self.kv_heads
        self.vocab_size = cfg.vocab_size
        self.scale = self.head_dim ** -0.5
        # int8-dynamic models keep float embeddings; the residual stream dtype follows them.
        self.dtype = model.model.embed_tokens.weight.dtype
        self.dtype_name = model_dtype(model)
        self.invariant_sizes: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def new_cache(self, capacity: int) -> RowCache:
        shape = (self.n_layers, self.kv_heads, capacity, self.head_dim)
        return RowCache(torch.empty(shape, dtype=self.dtype, device=self.device),
                        torch.empty(shape, dtype=self.dtype, device=self.device))

    def padded_size(self, rows: int) -> int:
        """Smallest calibrated batch size >= rows (rows itself when none was calibrated or fits)."""
        return next((s for s in self.invariant_sizes if s >= rows), rows)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], cache: RowCache, poison: bool = False) -> torch.Tensor:
        """Run the whole prompt of one row from position 0; returns float32 logits of the last token [V]."""
        core = self.model.model
        n = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        x = core.embed_tokens(ids)  # [P, hidden]
        if poison:
            x = x.clone().fill_(float("nan"))
        pos = torch.arange(n, device=self.device)
        cos, sin = core.rotary_emb(x[None], pos[None])  # [1, P, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [P, 1, D]
        for i, layer in enumerate(core.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(attn.q_proj(h).view(n, self.heads, self.head_dim), cos, sin)
            k = _rope(attn.k_proj(h).view(n, self.kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(h).view(n, self.kv_heads, self.head_dim)
            cache.keys[i, :, :n] = k.transpose(0, 1)
            cache.values[i, :, :n] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], cache.keys[i, None, :, :n], cache.values[i, None, :, :n],
                is_causal=True, scale=self.scale, enable_gqa=True)  # [1, H, P, D]
            x = x + attn.o_proj(out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.length = n
        return self.model.lm_head(core.norm(x[-1:])).float()[0]

    @torch.inference_mode()
    def decode(self, token_ids: list[int], caches: list[RowCache], poison: frozenset[int] = frozenset()
               ) -> torch.Tensor:
        """One token per row at position cache.length; returns float32 logits [B, V].

        Cache lengths are advanced only after the whole step succeeded, so a step that fails midway
        (out of memory) can be retried: the half-written slot is simply overwritten.
        """
        core = self.model.model
        b = len(token_ids)
        padded = self.padded_size(b)
        ids = torch.tensor(token_ids + [0] * (padded - b), dtype=torch.long, device=self.device)
        x = core.embed_tokens(ids)  # [B', hidden]; rows >= B are padding and never read back
        if poison:
            x = x.clone()
            x[sorted(poison)] = float("nan")
        pos = torch.tensor([c.length for c in caches], device=self.device)
        cos, sin = core.rotary_emb(x[None, :b], pos[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [B, 1, D]
        attn_out = torch.zeros(padded, self.heads * self.head_dim, dtype=x.dtype, device=self.device)
        for i, layer in enumerate(core.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(attn.q_proj(h)[:b].view(b, self.heads, self.head_dim), cos, sin)
            k = _rope(attn.k_proj(h)[:b].view(b, self.kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(h)[:b].view(b, self.kv_heads, self.head_dim)
            for r, cache in enumerate(caches):
                n = cache.length
                cache.keys[i, :, n] = k[r]
                cache.values[i, :, n] = v[r]
                # The G query heads that share a KV head attend together: q [1, KV, G, D].
                out = F.scaled_dot_product_attention(
                    q[r].view(1, self.kv_heads, self.groups, self.head_dim),
                    cache.keys[i, None, :, :n + 1], cache.values[i, None, :, :n + 1], scale=self.scale)
                attn_out[r] = out.reshape(-1)
            x = x + attn.o_proj(attn_out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for cache in caches:
            cache.length += 1
        return self.model.lm_head(core.norm(x)).float()[:b]

    @torch.inference_mode()
    def calibrate_invariant_sizes(self, max_batch: int, seed: int = 0) -> tuple[int, ...]:
        """Find batch sizes whose dense-layer results are bitwise independent of the batch.

        CPU GEMM kernels pick different micro-kernels for small or ragged M, which changes the float
        summation order of a row. A size qualifies when every row of a random batch of that size equals
        the same row computed inside a reference batch of max(max_batch, 16) rows, at a shuffled position.
        Sets the sizes used by decode() and returns them (empty: no invariant size). int8-dynamic is
        never invariant: its activation scale is computed per batch, so a random probe could only
        match by chance.
        """
        if self.dtype_name == "int8-dynamic":
            self.invariant_sizes = ()
            return ()
        ref_rows = max(max_batch, 16)
        gen = torch.Generator().manual_seed(seed)
        layer = self.model.model.layers[0]
        probes = [layer.self_attn.q_proj, layer.mlp.down_proj, self.model.lm_head]
        sizes = []
        for m in range(1, ref_rows + 1):
            ok = True
            for lin in probes:
                dim = _in_features(lin)
                xs = torch.randn(ref_rows, dim, generator=gen).to(device=self.device, dtype=self.dtype)
                full = lin(xs)
                perm = torch.randperm(ref_rows, generator=gen)[:m].to(self.device)
                ok = ok and torch.equal(lin(xs[perm]), full[perm])
            if ok:
                sizes.append(m)
        self.invariant_sizes = tuple(sizes) if ref_rows in sizes else ()
        return self.invariant_sizes


def _in_features(lin: torch.nn.Module) -> int:
    if hasattr(lin, "in_features"):
        return lin.in_features
    return lin.weight().shape[1]  # dynamic-quantized Linear exposes weight() as a method
