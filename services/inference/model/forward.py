"""Ragged-batch forward pass over a Hugging Face Llama model, its KV cache in a block pool (kvpool.py).

Why not `model(...)` with a padded cache: each row keeps a block table sized for its whole request
(so its blocks are reserved once, at admission). The row-wise dense layers (projections, MLP, norms,
lm_head) run batched, their batch dimension padded to a size that the BLAS kernels treat identically
(see `calibrate_invariant_sizes`); lm_head sees each segment's last row, and a scored prompt chunk's
rows in groups of those sizes (scoring.py). Decode attention runs for all one-token rows at once over their
gathered blocks, padded to the longest row's number of blocks and masked (`_decode_attention`); every
reduction in it runs along one row's own keys, in an order that depends neither on the batch nor on
the padded capacity. So a row's logits are bitwise the same alone or inside any batch.
The block formats (`gguf`, `gguf_f32`) run the rotary embedding with the cache write, and decode
attention, as one call each of Keel's layer ops (kernels/layer_ops.cpp: the same guarantee, each row
along its own positions in a fixed order, no padding read); the other formats run the aten ops here.
In a step without LoRA terms a block format's layer is two calls (kernels/layer.cpp: norm, QKV,
rotary and decode attention; then o_proj, norm, MLP and both residual adds), the same ops in the
same order as the op-by-op path that a step with adapters takes, so the bits are those of that path.
The architectures' extras (llama.py) run on the op-by-op path: qwen2's q/k/v biases are the projections'
own, qwen3's per-head q/k norms follow the projections, and mistral's sliding window masks the positions
more than `sliding_window` behind each query (prompt chunks and decode rows alike, aten attention: the
block formats' layer ops do not take a window, so a windowed model runs the aten ops for rotary and
attention on any format). A block format's layer with q/k norms takes the op-by-op path (`LayerArgs.of`
is None; biases and q/k/v of different block types are the composed call's); every such op is per row,
so the guarantee above holds for them too.
Each segment may name a LoRA adapter slot: every projection then goes through `LoraStep.linear`
(model/loraslots.py), which adds the adapter's unmerged term to that segment's tokens only, computed per
token so the guarantee above holds for rows with different adapters, or none, in one step.

Shapes: P prompt tokens, B rows, H query heads, KV key/value heads, G = H // KV, D head_dim, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.inference.model.blocks import FORMATS as BLOCK_FORMATS
from services.inference.model.blocks import LayerArgs
from services.inference.model.kvpool import PAD_BLOCK, KvPool, RowCache
from services.inference.model.llama import rotate_half, window_mask
from services.inference.model.loader import residual_dtype
from services.inference.model.loraslots import NO_LORA, LoraSlots
from services.inference.model.scoring import PromptScores, score_rows


@dataclass(frozen=True)
class DecodeView:
    """The decode rows of a step: their block tables padded with the padding block to the longest
    one's blocks [B, W], their lengths once this step's token is in [B], and for the aten path the
    mask [1, B, 1, W * block_tokens] of the positions past each length (True = not attended)."""

    table: torch.Tensor
    lengths: torch.Tensor
    masked: torch.Tensor | None


@dataclass(frozen=True)
class Projections:
    """Projections of one input, as the step calls them: one call of `fused` (the rows of every
    projection stacked, block formats) split by columns into `sizes`, or one call per module."""

    names: tuple[str, ...]
    modules: tuple[torch.nn.Module, ...]
    fused: torch.nn.Module | None
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, parent: torch.nn.Module, names: tuple[str, ...], fused: str) -> Projections:
        modules = tuple(getattr(parent, n) for n in names)
        return cls(names, modules, getattr(parent, fused, None), tuple(m.out_features for m in modules))

    def __call__(self, i: int, h: torch.Tensor, lora) -> list[torch.Tensor]:
        """Each projection of h [N, E] with its LoRA terms (layer i)."""
        if self.fused is None:
            return [lora.linear(i, n, m, h) for n, m in zip(self.names, self.modules)]
        return [lora.add(i, n, y, h) for n, y in zip(self.names, self.fused(h).split(self.sizes, dim=-1))]


@dataclass(frozen=True)
class Layer:
    """A decoder layer's modules, looked up once: an nn.Module attribute lookup costs as much as a
    small op, and a step made hundreds of them."""

    input_norm: torch.nn.Module
    qkv: Projections
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: Projections
    down_proj: torch.nn.Module
    blocks: LayerArgs | None  # a block format's layer: its two composed calls (kernels/layer.cpp)
    q_norm: torch.nn.Module | None  # qwen3: RMSNorm over each head's query, then key, before the rotation
    k_norm: torch.nn.Module | None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm, Projections.of(attn, ("q_proj", "k_proj", "v_proj"), "qkv"), attn.o_proj,
                   layer.post_attention_layernorm, Projections.of(mlp, ("gate_proj", "up_proj"), "gate_up"),
                   mlp.down_proj, LayerArgs.of(layer), getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))


@dataclass
class Segment:
    """One row's share of a forward step: its cache, the tokens to append and its adapter slot (0 = base).

    `targets`: to score a prompt chunk (scoring.py), the prompt token after each of its tokens, one
    fewer when the chunk ends the prompt; None: not scored."""

    cache: RowCache
    tokens: list[int]
    slot: int = 0
    targets: list[int] | None = None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] at positions with cos/sin [..., 1, D] (the same formula as transformers)."""
    return x * cos + rotate_half(x) * sin


class LlamaRunner:
    """Runs prefill (one row) and decode (many rows, one token each) steps over block-table caches.

    `block_tokens` positions per KV block; the pool starts with room for `pool_tokens` positions and is
    resized to the memory budget's share by the engine (`resize_pool`)."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu", block_tokens: int = 16,
                 pool_tokens: int = 16384):
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
        self.window: int | None = getattr(cfg, "sliding_window", None)  # positions a query attends to (mistral)
        # int8 and gguf models keep a float32 residual stream (embeddings, norms, attention).
        self.dtype = residual_dtype(model)
        self.format: str = model.format  # the weight format it serves, as the model was loaded (loader.py)
        # kernels/layer_ops.cpp serve rotary and attention; they take no sliding window
        self.layer_ops = self.format in BLOCK_FORMATS and self.window is None
        self.invariant_sizes: tuple[int, ...] = ()
        self.lora: LoraSlots | None = None  # the preloaded adapters (model/loraslots.py), set at warm-up
        self.layers = [Layer.of(layer) for layer in model.model.layers]
        self.block_tokens = block_tokens
        self.pool = self._new_pool(-(-pool_tokens // block_tokens))

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    def new_cache(self, capacity: int) -> RowCache:
        """A cache with room for `capacity` positions, its blocks taken from the pool."""
        return self.pool.allocate(capacity)

    def resize_pool(self, blocks: int) -> None:
        """A new pool of `blocks` blocks; only while no cache holds blocks of the current one."""
        if self.pool.free_blocks != self.pool.blocks:
            raise RuntimeError("the KV pool is resized while caches hold blocks")
        self.pool = None  # the old pool's memory goes before the new one is allocated
        self.pool = self._new_pool(blocks)

    def _new_pool(self, blocks: int) -> KvPool:
        return KvPool(self.n_layers, self.kv_heads, self.head_dim, self.block_tokens, blocks, self.dtype,
                      self.device)

    def padded_size(self, rows: int) -> int:
        """Smallest calibrated batch size >= rows (rows itself when none was calibrated or fits)."""
        return next((s for s in self.invariant_sizes if s >= rows), rows)

    def prefill(self, token_ids: list[int], cache: RowCache) -> torch.Tensor:
        """One row's whole prompt from position 0; float32 logits of its last token [V]."""
        return self.forward([Segment(cache, token_ids)])[0]

    def decode(self, token_ids: list[int], caches: list[RowCache]) -> torch.Tensor:
        """One token per row at position cache.length; float32 logits [B, V]."""
        return self.forward([Segment(c, [t]) for t, c in zip(token_ids, caches)])

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """One step over a ragged batch (`_step`): float32 logits of each segment's last token [R, V]."""
        return self._step(segments, 0)[0]

    def forward_scoring(self, segments: list[Segment], top: int) -> tuple[torch.Tensor, list[PromptScores | None]]:
        """`forward`, and each segment with targets scored with its `top` most likely tokens (scoring.py)."""
        return self._step(segments, top)

    @torch.inference_mode()
    def _step(self, segments: list[Segment], top: int) -> tuple[torch.Tensor, list[PromptScores | None] | None]:
        """One step over a ragged batch: every segment appends its tokens to its row's cache.

        A segment is a prompt chunk (prefill, from the row's cache length on) or one token (decode).
        Their tokens are stacked into one [N, hidden] matrix for the dense layers; their keys and values
        go to their blocks in one index_copy per layer; attention runs for all decode rows at once and
        per row for prompt chunks. Returns float32 logits of each segment's last token [R, V], and with
        `top` > 0 the scores of the segments with targets (None for the others; the whole list is None
        without `top`). Cache lengths advance only after the whole step succeeded, so a step that fails
        midway (out of memory) can be retried as is.
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
        cos, sin = cos[0], sin[0]  # [N, D]
        lora = NO_LORA
        if self.lora is not None and any(s.slot for s in segments):
            lora = self.lora.step([s.slot for s, n in zip(segments, lens) for _ in range(n)], padded, self.device)
        attn_out = torch.zeros(padded, self.heads * self.head_dim, dtype=x.dtype, device=self.device)
        pool = self.pool
        slots = torch.tensor([p for s, st, n in zip(segments, starts, lens) for p in pool.slots(s.cache, st, n)],
                             dtype=torch.long, device=self.device)
        decoding = [r for r, n in enumerate(lens) if n == 1]
        if decoding:
            dec_tokens = torch.tensor([offsets[r] for r in decoding], device=self.device)
            view = self._decode_view([segments[r].cache for r in decoding])
        chunks = [(offsets[r], n, starts[r], self._blocks(segments[r].cache, starts[r] + n))
                  for r, n in enumerate(lens) if n > 1]
        # Without LoRA terms a block format's layer is two composed calls (the same ops, the same bits).
        composed = self.layer_ops and lora is NO_LORA
        if composed:
            decode_rows = (dec_tokens, view.table, view.lengths) if decoding else _NO_DECODE_ROWS
            step = (n_tok, cos, sin, slots)
        for i, layer in enumerate(self.layers):
            blocks = layer.blocks if composed else None
            if blocks is not None:
                q = torch.ops.keel.layer_attention(x, *blocks.attention, *step, *pool.layer(i), attn_out,
                                                   *decode_rows, self.block_tokens, self.scale)
            else:
                q, k, v = layer.qkv(i, layer.input_norm(x), lora)
                if layer.q_norm is not None:
                    q = layer.q_norm(q.view(padded, self.heads, self.head_dim)).view(padded, -1)
                    k = layer.k_norm(k.view(padded, self.kv_heads, self.head_dim)).view(padded, -1)
                q = self._rope_store(i, q[:n_tok], k[:n_tok], v[:n_tok], cos, sin, slots)
                if decoding:
                    self._decode_attention(i, q, dec_tokens, view, attn_out)
            for o, n, st, chunk_blocks in chunks:
                # A prompt chunk (one row) at positions st..st+n-1 attends causally to everything cached so far.
                keys = pool.keys[i].index_select(1, chunk_blocks).flatten(1, 2)[None, :, :st + n]  # [1, KV, st+n, D]
                values = pool.values[i].index_select(1, chunk_blocks).flatten(1, 2)[None, :, :st + n]
                mask = None if st == 0 and (self.window is None or n <= self.window) else \
                    window_mask(torch.arange(st, st + n, device=self.device), torch.arange(st + n, device=self.device),
                                self.window)
                out = F.scaled_dot_product_attention(
                    q[o:o + n].view(n, self.heads, self.head_dim).transpose(0, 1)[None], keys, values,
                    attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)  # [1, H, n, D]
                attn_out[o:o + n] = out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)
            if blocks is not None:
                x = torch.ops.keel.layer_mlp(x, attn_out, *blocks.mlp)
                continue
            x = x + lora.linear(i, "o_proj", layer.o_proj, attn_out)
            gate, up = layer.gate_up(i, layer.post_norm(x), lora)  # llama.MLP.forward, with the LoRA term
            x = x + lora.linear(i, "down_proj", layer.down_proj, F.silu(gate) * up)
        scores = None
        if top:
            scores = [None if s.targets is None else score_rows(self, x[o:o + len(s.targets)], s.targets, top)
                      for s, o in zip(segments, offsets)]
        for seg, n in zip(segments, lens):
            seg.cache.length += n
        rows = len(segments)
        last = torch.tensor([o + n - 1 for o, n in zip(offsets, lens)], device=self.device)
        h_last = torch.zeros(self.padded_size(rows), x.shape[1], dtype=x.dtype, device=self.device)
        h_last[:rows] = x[last]
        return self.model.lm_head(core.norm(h_last)).float()[:rows], scores

    def _blocks(self, cache: RowCache, positions: int) -> torch.Tensor:
        """Ids of the blocks holding the cache's first `positions` positions."""
        return torch.tensor(cache.blocks[:self.pool.blocks_for(positions)], dtype=torch.long, device=self.device)

    def _decode_view(self, caches: list[RowCache]) -> DecodeView:
        """The decode rows' block tables, lengths and (aten path) mask.

        The capacity follows the batch's longest row block by block: rounding it further (to a power of
        two) changes no bits but copies more (measured: bench/bench_kvpool.py, docs/BENCHMARKS.md)."""
        used = [self.pool.blocks_for(c.length + 1) for c in caches]
        width = max(used)
        table = torch.tensor([c.blocks[:u] + [PAD_BLOCK] * (width - u) for c, u in zip(caches, used)],
                             dtype=torch.long, device=self.device)
        lengths = torch.tensor([c.length + 1 for c in caches], device=self.device)
        if self.layer_ops:
            return DecodeView(table, lengths, None)
        at = torch.arange(width * self.block_tokens, device=self.device)[None, :]
        masked = at >= lengths[:, None]
        if self.window is not None:  # the query at length - 1 sees keys > length - 1 - window
            masked |= at < lengths[:, None] - self.window
        return DecodeView(table, lengths, masked[None, :, None, :])

    def _rope_store(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Layer i: the rotary embedding on q [N, H * D] and k [N, KV * D] at the tokens' positions
        (cos, sin [N, D]); the keys and values v to their cache slots [N]. Returns the rotated q [N, H * D]."""
        flat_k, flat_v = self.pool.layer(i)  # [KV, blocks * block_tokens, D]
        if self.layer_ops:
            return torch.ops.keel.rope_store(q, k, v, cos, sin, slots, flat_k, flat_v)
        n, cos, sin = q.shape[0], cos[:, None, :], sin[:, None, :]
        k = _rope(k.view(n, self.kv_heads, self.head_dim), cos, sin)
        flat_k.index_copy_(1, slots, k.transpose(0, 1))
        flat_v.index_copy_(1, slots, v.view(n, self.kv_heads, self.head_dim).transpose(0, 1))
        return _rope(q.view(n, self.heads, self.head_dim), cos, sin).view(n, -1)

    def _decode_attention(self, i: int, q: torch.Tensor, rows: torch.Tensor, view: DecodeView,
                          out: torch.Tensor) -> None:
        """Layer i's attention for the B one-token rows at once: out[rows] <- attention of q[rows]
        (q [N, H * D], rows [B], out [N', H * D]) over each row's cached positions.

        Aten path: the G query heads sharing a KV head attend together: q is viewed [KV, B, G, D]
        against keys and values gathered [KV, B, capacity, D]. Scores are one matmul (each element a
        dot product over D), masked to -inf past a row's length, softmaxed in float32 along the row's
        own positions, then multiplied with the values (a sum along those positions, in position
        order; the padded ones add exact zeros: weight 0 times a finite value). Nothing mixes rows,
        and the padding only appends zero terms at the end of each sum, so a row gets the same bits
        in any batch and any capacity (tested; bench/bench_kvpool.py shows it on the host at hand).
        """
        if self.layer_ops:
            flat_k, flat_v = self.pool.layer(i)
            torch.ops.keel.decode_attention_(out, rows, q, flat_k, flat_v, view.table, view.lengths,
                                             self.block_tokens, self.scale, -1)  # -1: the best path
            return
        b, table = rows.shape[0], view.table.view(-1)
        keys = self.pool.keys[i].index_select(1, table).view(self.kv_heads, b, -1, self.head_dim)
        values = self.pool.values[i].index_select(1, table).view(self.kv_heads, b, -1, self.head_dim)
        qg = q[rows].view(b, self.kv_heads, self.groups, self.head_dim).transpose(0, 1)  # [KV, B, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale   # [KV, B, G, capacity]
        probs = torch.softmax(scores.masked_fill(view.masked, float("-inf")), dim=-1).to(values.dtype)
        out[rows] = torch.matmul(probs, values).transpose(0, 1).reshape(b, self.heads * self.head_dim)

    @torch.inference_mode()
    def calibrate_invariant_sizes(self, max_batch: int, seed: int = 0) -> tuple[int, ...]:
        """Find batch sizes whose dense-layer results are bitwise independent of the batch.

        CPU GEMM kernels pick different micro-kernels for small or ragged M, which changes the float
        summation order of a row. A size qualifies when every row of a random batch of that size equals
        the same row computed inside a large reference batch, at a shuffled position. Sizes up to
        max(max_batch, 16) are listed (lm_head included: it sees one row per segment, or a scored prompt
        chunk's rows in groups of at most the largest listed size); larger token
        counts are only sampled, and one failing sample disables invariance altogether.
        Sets the sizes used by forward() and returns them (empty: no invariance). int8 is never
        invariant: its activation scale is computed per batch.
        """
        self.invariant_sizes = ()
        if self.format == "int8":
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


# keel::layer_attention's decode rows, table and lengths for a step without decode rows.
_NO_DECODE_ROWS = (torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                   torch.zeros(0, dtype=torch.long))


def _in_features(lin: torch.nn.Module) -> int:
    if hasattr(lin, "in_features"):
        return lin.in_features
    return lin.weight().shape[1]  # dynamic-quantized Linear exposes weight() as a method
