"""Weight format gguf: the GGUF's blocks as served weights (blocks.py) on Keel's kernel."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from services.inference.engine.core import Engine
from services.inference.engine.memory import static_bytes
from services.inference.formats import selection
from services.inference.formats.selection import FormatsConfig
from services.inference.model import blocks, ggufindex
from services.inference.model.forward import LlamaRunner
from services.inference.model.loader import check_format, convert_model, load_model
from shared.errors import InvalidInput
from shared.modelfile import source as model_source
from tests.inference.gguf_fixtures import dequantize_rows, unpack_x16, write_tiny_gguf
from tests.inference.helpers import collect, ids, prompt, request, tiny_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = model_source().cache_dir


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    return write_tiny_gguf(tiny, tmp_path_factory.mktemp("tiny-gguf"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir):
    return load_model(tiny_dir, "gguf")


def file_order(module, rows: int) -> torch.Tensor:
    """A block module's first `rows` weight rows as the file stores them (x16 matrices unpacked)."""
    if getattr(module, "x16", False) or getattr(module, "layout", None) == "x16":
        return unpack_x16(module.blocks, torch.arange(rows), module.ggml_type)
    return module.blocks[:rows]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_the_real_blocks_dequantize_to_the_float32_reference_bit_for_bit(fmt):
    """Every linear and the embedding of the shipped GGUF, query/key rows put back in order."""
    model = load_model(MODEL, fmt)
    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as ref:
        checked = 0
        for name, module in model.named_modules():
            fused = name.endswith(("qkv", "gate_up"))
            if isinstance(module, (blocks.BlockLinear, blocks.BlockEmbedding)) and not fused:
                key = "model.embed_tokens.weight" if name == "lm_head" else f"{name}.weight"
                want = ref.get_tensor(key)
                got = dequantize_rows(file_order(module, want.shape[0]), module.ggml_type)
                assert torch.equal(got, want), name
                checked += 1
    assert checked == 30 * 7 + 2


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_the_tiny_gguf_tracks_its_reference_and_is_its_own_format(tiny_dir, fmt):
    reference, model = load_model(tiny_dir, "float32"), load_model(tiny_dir, fmt)
    x = torch.tensor([prompt(1, 20)])
    want, got = reference(x).logits, model(x).logits
    if fmt == blocks.EXACT_FORMAT:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # logits of size ~30: float32 rounding
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:  # 8-bit activations: ~0.5% of each dot product, ~3% of the tiny random model's logits
        assert ((got - want).norm() / want.norm()).item() < 0.06
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
    assert not torch.equal(got, want)  # another summation order than MKL's: close, not the same bits
    assert model.format == fmt
    with pytest.raises(InvalidInput) as err:
        convert_model(model, "float32")
    assert err.value.reason == "UNSUPPORTED_FORMAT"
    with pytest.raises(InvalidInput):
        convert_model(reference, fmt)


def test_blocks_are_counted_once_and_no_dequantized_copy_is_kept(tiny_gguf):
    float_tensors = [t for t in list(tiny_gguf.parameters()) + list(tiny_gguf.buffers()) if t.is_floating_point()]
    assert all(t.dim() == 1 for t in float_tensors)  # the norms only
    layer = tiny_gguf.model.layers[0]
    owned = sum(b.nbytes for b in tiny_gguf.buffers()) + sum(p.nbytes for p in tiny_gguf.parameters())
    assert static_bytes(tiny_gguf) == owned
    assert layer.self_attn.q_proj.blocks.data_ptr() == layer.self_attn.qkv.blocks.data_ptr()  # a view
    assert tiny_gguf.lm_head.blocks is tiny_gguf.model.embed_tokens.blocks  # tied


def test_fused_projections_give_the_bits_of_separate_ones(tiny_gguf):
    attn, mlp = tiny_gguf.model.layers[1].self_attn, tiny_gguf.model.layers[1].mlp
    h = torch.randn(7, tiny_gguf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    q, k, v = attn.qkv(h).split([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features], -1)
    assert torch.equal(q, attn.q_proj(h)) and torch.equal(k, attn.k_proj(h)) and torch.equal(v, attn.v_proj(h))
    g, u = mlp.gate_up(h).split([mlp.gate_proj.out_features, mlp.up_proj.out_features], -1)
    assert torch.equal(g, mlp.gate_proj(h)) and torch.equal(u, mlp.up_proj(h))


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_rows_are_bitwise_batch_invariant_at_any_thread_count(tiny_gguf, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = LlamaRunner(tiny_gguf)
        assert runner.calibrate_invariant_sizes(16) == tuple(range(1, 17))  # invariant by construction
        prompts = [prompt(s, 3 + 5 * s) for s in range(16)]

        def run(batch):
            caches = [runner.new_cache(len(p) + 5) for p in batch]
            cur = [int(runner.prefill(p, c).argmax()) for p, c in zip(batch, caches)]
            steps = []
            for _ in range(4):
                steps.append(runner.decode(cur, caches))
                cur = steps[-1].argmax(-1).tolist()
            return steps

        together = run(prompts)
        for i, p in enumerate(prompts):
            assert all(torch.equal(a[0], t[i]) for a, t in zip(run([p]), together)), f"row {i} differs"
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("threads", [1, 2])
async def test_200_prompts_give_the_same_tokens_alone_and_in_batches(tiny_gguf, threads):
    """Sampled and greedy requests through the engine: alone, then 200 at once (batches up to 16)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = Engine(tiny_gguf, tiny_config(format="gguf", max_batch_size=16, max_queued_requests=256))
    engine.warmup()
    await engine.start()
    try:
        reqs = [request(f"r{i}", prompt(i, 2 + i % 23), max_tokens=4, temperature=0.8 * (i % 2), seed=i)
                for i in range(200)]
        alone = [ids((await collect(engine, r))[0]) for r in reqs]
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))
        same = sum(a == ids(t) for a, (t, _) in zip(alone, together))
        assert same == 200
    finally:
        await engine.stop(grace_s=0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_a_float16_matrix_in_a_quantized_file_serves_on_the_float_kernel(tiny, tmp_path, fmt):
    """Mixed files load as one model: F16 has no integer kernel, so it runs on keel::gguf_mm in both."""
    folder = write_tiny_gguf(tiny, tmp_path, types={"blk.1.ffn_down.weight": Q.F16})
    model = load_model(folder, fmt)
    down = model.model.layers[1].mlp.down_proj
    assert down.ggml_type == int(Q.F16) and down.layout == "rows"
    assert model.model.layers[0].mlp.down_proj.layout == ("x16" if fmt == blocks.FORMAT else "rows")
    x = torch.tensor([prompt(2, 20)])
    want, got = load_model(folder, "float32")(x).logits, model(x).logits
    assert ((got - want).norm() / want.norm()).item() < (1e-5 if fmt == blocks.EXACT_FORMAT else 0.06)


@pytest.mark.parametrize("linear_type", [Q.Q4_0, Q.Q5_0, Q.Q5_1])
@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_the_legacy_block_types_serve_on_both_formats(tiny, tmp_path, linear_type, fmt):
    """Linear layers in the types llama.cpp's quantizer falls back to where a K-quant does not fit."""
    folder = write_tiny_gguf(tiny, tmp_path, linear_type=linear_type)
    reference, model = load_model(folder, "float32"), load_model(folder, fmt)
    assert model.model.layers[0].mlp.down_proj.ggml_type == int(linear_type)
    x = torch.tensor([prompt(2, 20)])
    want, got = reference(x).logits, model(x).logits
    tolerance = 1e-5 if fmt == blocks.EXACT_FORMAT else 0.06  # float32 order / 8-bit activations
    assert ((got - want).norm() / want.norm()).item() < tolerance


def test_the_tensor_table_is_rebuilt_for_another_file(tiny, tiny_dir, tmp_path):
    table = json.loads((tiny_dir / ggufindex.INDEX_NAME).read_text())
    other = write_tiny_gguf(tiny, tmp_path, linear_type=Q.Q8_0)
    (other / ggufindex.INDEX_NAME).write_text(json.dumps(table))  # a stale table: other sizes and mtime
    model = load_model(other, "gguf")
    assert model.model.layers[0].mlp.down_proj.ggml_type == int(Q.Q8_0)


def test_without_a_compiler_gguf_is_refused_and_auto_serves_another_format(tiny_dir, tmp_path):
    """A fresh build folder and no compiler: the format says why, and auto picks among the others."""
    script = f"""
import json, sys, torch
from pathlib import Path
from services.inference.model import kernels
from services.inference.formats import selection
from services.inference.formats.selection import FormatsConfig
from services.inference.model.loader import check_format, load_model
from shared.errors import InvalidInput
kernels.CACHE_DIR = Path({str(tmp_path / 'kernels')!r})
try:
    check_format("gguf")
    print(json.dumps({{"refused": False}}))
except InvalidInput as exc:
    ref = load_model(Path({str(tiny_dir)!r}), "float32")
    choice, _ = selection.choose_auto(ref, "sha", FormatsConfig(auto_candidates=("float32", "gguf")), 4, "cpu",
                                    Path({str(tiny_dir)!r}))
    print(json.dumps({{"refused": True, "reason": exc.reason, "message": str(exc), "format": choice.format,
                      "why": choice.reason}}))
"""
    env = {"PATH": "/usr/bin:/bin", "CXX": str(tmp_path / "no-such-compiler"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["refused"] and result["reason"] == "KERNEL_UNAVAILABLE"
    assert "no C++ compiler" in result["message"]
    assert result["format"] == "float32" and "gguf" in result["why"] and "kernel" in result["why"]


def test_gguf_runs_on_cpu_only():
    with pytest.raises(InvalidInput) as err:
        check_format("gguf", "cuda")
    assert err.value.reason == "UNSUPPORTED_FORMAT"


def test_auto_can_choose_gguf_once_it_passed_the_gate(tiny, tiny_dir, tiny_gguf, monkeypatch, tmp_path):
    from services.inference.formats import quality
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path))
    reference = load_model(tiny_dir, "float32")
    [result] = quality.evaluate(reference, {"gguf": tiny_gguf}, _sequences())
    assert result.passes(FormatsConfig().gate), result
    quality.store(selection.gate_path("sha"), "sha", [result], "test")
    choice, model = selection.choose_auto(reference, "sha", FormatsConfig(auto_candidates=("float32", "gguf")),
                                        4, "cpu", tiny_dir)
    assert "gguf: decode pass" in choice.reason  # eligible, timed against float32
    assert model.format == choice.format


def _sequences():
    from services.inference.formats.quality import Sequence
    return [Sequence(tuple(prompt(s, 24)), 8) for s in range(6)]
