"""Ragged-batch forward pass over a Hugging Face Llama model, with one KV cache per request.

Why not `model(...)` with a padded cache: each row here keeps its own cache tensor sized for its whole
request (so memory is reserved once, at admission) and attention runs per row on exactly the shapes it
would have alone. Only the row-wise dense layers (projections, MLP, norms, lm_head) run batched, and
their batch dimension is padded to a size that the BLAS kernels treat identically (see
`calibrate_invariant_sizes`), so a row's logits are bitwise the same alone or inside any batch.
Each segment may name a LoRA adapter slot: every projection then goes through `LoraStep.linear`
(lora/slots.py), which adds the adapter's unmerged term to that segment's tokens only, computed per
token so the guarantee above holds for rows with different adapters, or none, in one step.

Shapes: P prompt tokens, B rows, H query heads, KV key/value heads, G = H // KV, D head_dim, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.inference.llama import rotate_half
from services.inference.lora.slots import NO_LORA, LoraSlots
from services.inference.model import model_dtype


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


@dataclass
class Segment:
    """One row's share of a forward step: its cache, the tokens to append and its adapter slot (0 = base)."""

    cache: RowCache
    tokens: list[int]
    slot: int = 0


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
        # int8 models keep float embeddings; the residual stream dtype follows them.
        self.dtype = model.model.embed_tokens.weight.dtype
        self.dtype_name = model_dtype(model)
        self.invariant_sizes: tuple[int, ...] = ()
        self.lora: LoraSlots | None = None  # the preloaded adapters (lora/slots.py), set at warm-up

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

    def prefill(self, token_ids: list[int], cache: RowCache) -> torch.Tensor:
        """One row's whole prompt from position 0; float32 logits of its last token [V]."""
        return self.forward([Segment(cache, token_ids)])[0]

    def decode(self, token_ids: list[int], caches: list[RowCache]) -> torch.Tensor:
        """One token per row at position cache.length; float32 logits [B, V]."""
        return self.forward([Segment(c, [t]) for t, c in zip(token_ids, caches)])

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """One step over a ragged batch: every segment appends its tokens to its row's cache.

        A segment is a prompt chunk (prefill, from the row's cache length on) or one token (decode).
        Their tokens are stacked into one [N, hidden] matrix for the dense layers; attention runs per
        row. Returns float32 logits of each segment's last token [R, V]. Cache lengths advance only after the whole step
        succeeded, so a step that fails midway (out of memory) can be retried as is.
        """
        core = self.model.model
        lens = [len(s.tokens) for s in segments]
        starts = [s.cache.length for s in segments]
        offsets = [sum(lens[:r]) for r in range(len(segments))]
        n_tok = sum(lens)
        padded = self.padded_size(n_tok)
        ids = torch.tensor([t for s in segments for t in s.tokens] + [0] * (padded - n_tok),
                           dtype=torch.long, device=self.device)
        x = core.embed_tokens(ids)  # [N', hidden]; rows >= N are padding and never read back
        pos = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lens)]).to(self.device)
        cos, sin = core.rotary_emb(x[None, :n_tok], pos[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D]
        lora = NO_LORA
        if self.lora is not None and any(s.slot for s in segments):
            lora = self.lora.step([s.slot for s, n in zip(segments, lens) for _ in range(n)], padded, self.device)
        attn_out = torch.zeros(padded, self.heads * self.head_dim, dtype=x.dtype, device=self.device)
        for i, layer in enumerate(core.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(lora.linear(i, "q_proj", attn.q_proj, h)[:n_tok].view(n_tok, self.heads, self.head_dim),
                      cos, sin)
            k = _rope(lora.linear(i, "k_proj", attn.k_proj, h)[:n_tok].view(n_tok, self.kv_heads, self.head_dim),
                      cos, sin)
            v = lora.linear(i, "v_proj", attn.v_proj, h)[:n_tok].view(n_tok, self.kv_heads, self.head_dim)
            for seg, o, n, st in zip(segments, offsets, lens, starts):
                keys, values = seg.cache.keys[i], seg.cache.values[i]  # [KV, capacity, D]
                keys[:, st:st + n] = k[o:o + n].transpose(0, 1)
                values[:, st:st + n] = v[o:o + n].transpose(0, 1)
                if n == 1:
                    # The G query heads that share a KV head attend together: q [1, KV, G, D].
                    out = F.scaled_dot_product_attention(
                        q[o].view(1, self.kv_heads, self.groups, self.head_dim),
                        keys[None, :, :st + 1], values[None, :, :st + 1], scale=self.scale)
                    attn_out[o] = out.reshape(-1)
                else:
                    # A prompt chunk at positions st..st+n-1 attends causally to everything cached so far.
                    mask = None if st == 0 else _prefix_causal_mask(st, n, self.device)
                    out = F.scaled_dot_product_attention(
                        q[o:o + n].transpose(0, 1)[None], keys[None, :, :st + n], values[None, :, :st + n],
                        attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)  # [1, H, n, D]
                    attn_out[o:o + n] = out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)
            x = x + lora.linear(i, "o_proj", attn.o_proj, attn_out)
            h, mlp = layer.post_attention_layernorm(x), layer.mlp  # llama.MLP.forward, with the LoRA term
            up = F.silu(lora.linear(i, "gate_proj", mlp.gate_proj, h)) * lora.linear(i, "up_proj", mlp.up_proj, h)
            x = x + lora.linear(i, "down_proj", mlp.down_proj, up)
        for seg, n in zip(segments, lens):
            seg.cache.length += n
        rows = len(segments)
        last = torch.tensor([o + n - 1 for o, n in zip(offsets, lens)], device=self.device)
        h_last = torch.zeros(self.padded_size(rows), x.shape[1], dtype=x.dtype, device=self.device)
        h_last[:rows] = x[last]
        return self.model.lm_head(core.norm(h_last)).float()[:rows]

    @torch.inference_mode()
    def calibrate_invariant_sizes(self, max_batch: int, seed: int = 0) -> tuple[int, ...]:
        """Find batch sizes whose dense-layer results are bitwise independent of the batch.

        CPU GEMM kernels pick different micro-kernels for small or ragged M, which changes the float
        summation order of a row. A size qualifies when every row of a random batch of that size equals
        the same row computed inside a large reference batch, at a shuffled position. Sizes up to
        max(max_batch, 16) are listed (lm_head included, it only sees one row per segment); larger token
        counts are only sampled, and one failing sample disables invariance altogether.
        Sets the sizes used by forward() and returns them (empty: no invariance). int8 is never
        invariant: its activation scale is computed per batch.
        """
        self.invariant_sizes = ()
        if self.dtype_name == "int8":
            return ()
        small = max(max_batch, 16)
        large = (small + 1, 64, 257, 1024)
        gen = torch.Generator().manual_seed(seed)
        layer = self.model.model.layers[0]
        refs = {}  # layer -> (inputs, outputs) of its reference batch

        def invariant(lin: torch.nn.Module, m: int, ref_rows: int) -> bool:
            if lin not in refs:
                xs = torch.randn(ref_rows, _in_features(lin), generator=gen).to(device=self.device, dtype=self.dtype)
                refs[lin] = (xs, lin(xs))
            xs, full = refs[lin]
            perm = torch.randperm(ref_rows, generator=gen)[:m].to(self.device)
            return torch.equal(lin(xs[perm]), full[perm])

        dense = [layer.self_attn.q_proj, layer.mlp.down_proj]
        sizes = [m for m in range(1, small + 1)
                 if all(invariant(lin, m, 1100) for lin in dense) and invariant(self.model.lm_head, m, small)]
        if small in sizes and all(invariant(lin, m, 1100) for lin in dense for m in large):
            self.invariant_sizes = tuple(sizes)
        return self.invariant_sizes


def _prefix_causal_mask(start: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, start + n] bool: query i (at position start + i) sees keys 0..start + i."""
    return torch.arange(start + n, device=device)[None, :] <= torch.arange(start, start + n, device=device)[:, None]


def _in_features(lin: torch.nn.Module) -> int:
    if hasattr(lin, "in_features"):
        return lin.in_features
    return lin.weight().shape[1]  # dynamic-quantized Linear exposes weight() as a method
