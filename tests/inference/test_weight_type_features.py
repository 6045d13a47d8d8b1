"""The stage's features on the GGUF weight types people download (testing/quantized.py: the wide tiny
llama quantized by llama.cpp): the quality gate and its results kept per file, `auto` choosing gguf or
saying why not, warm restart, a LoRA adapter unmerged beside the quantized blocks, and a variant and the
breaker's fallback format beside a K-quant base.

One type per block family (REPRESENTATIVE): F16 and BF16 (the float kernel), Q8_0, Q4_0 and Q5_1 (the
32-element blocks), Q4_K_M (Q4_K with Q6_K) and Q6_K (the super-blocks). A type's folder is prepared as
`make model` leaves one (config.json, model.safetensors holding the file's float32 dequantization,
keel-source.json naming the GGUF) without the tokenizer, which nothing here reads. `auto`'s timings are
replaced by fixed ones (`timed`): which format a host runs faster is not a test's business, what auto
does with the times is.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from services.inference import bootstrap
from services.inference.config import InferenceConfig
from services.inference.engine.core import Engine, EngineConfig
from services.inference.formats import quality, selection, startgate
from services.inference.formats.quality import GateResult, GateThresholds
from services.inference.formats.selection import FormatsConfig
from services.inference.formats.startgate import GateJob
from services.inference.model import blocks
from services.inference.model.digest import model_sha256
from services.inference.model.forward import LlamaRunner, Segment
from services.inference.model.loader import load_model
from shared.config import ConfigError
from testing import quantized
from testing.lora import load_slots, make_adapter, peft_logits
from testing.tiny import save_model
from tests.inference.helpers import collect, ids, prompt, request, tiny_config
from tests.inference.test_breaker import FAST_TRIP, trip

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

REPRESENTATIVE = ("F16", "BF16", "Q8_0", "Q4_0", "Q5_1", "Q4_K_M", "Q6_K")
# The gate's own path (5 s a type) on one file per kernel layout (blocks.layout): float rows, the
# 32-element x16 blocks, the K-quant x16k super-blocks mixed with Q6_K.
LAYOUTS = ("BF16", "Q8_0", "Q4_K_M")
K_QUANT = "Q4_K_M"
GATE_PROMPTS = 4  # the first prompts of gate_prompts.json: the gate's path, not its statistics
# The tiny model's random weights (std 0.5) give sharp distributions that gguf's 8-bit activations move
# far more than a trained model's (4 prompts, gguf against float32: mean KL 0.07 Q8_0 to 0.24 Q4_K_M,
# p95 up to 1.26, greedy agreement 0.83-0.92; SmolLM2's per-type figures are docs/BENCHMARKS.md's), so
# the gate here has thresholds this model passes: what is tested is the gate's path, not the quality.
TINY_GATE = GateThresholds(kl_mean_max=0.5, kl_p95_max=2.5, greedy_agreement_min=0.75)
CANDIDATES = FormatsConfig(gate=TINY_GATE, auto_candidates=("float32", "gguf"), gate_prompts=GATE_PROMPTS)
PASSING = GateResult("gguf", kl_mean=0.001, kl_p95=0.004, greedy_agreement=0.99, positions=100, sequences=4)
FAILING = dataclasses.replace(PASSING, kl_mean=1.0)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prepare(gguf: Path, folder: Path) -> Path:
    """`folder` as modelcache.prepared leaves it for `gguf` (its tokenizer left out)."""
    save_model(load_model(gguf, "float32"), folder)
    (folder / "keel-source.json").write_text(json.dumps({"gguf": str(gguf)}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """folders(ftype): the prepared folder of the tiny model in that type, made once per module."""
    made: dict[str, Path] = {}

    def folder(ftype: str) -> Path:
        if ftype not in made:
            made[ftype] = prepare(quantized.tiny(ftype), tmp_path_factory.mktemp(f"tiny-{ftype}"))
        return made[ftype]
    return folder


@pytest.fixture
def timed(monkeypatch):
    """timed(seconds by format): what auto's decode passes take from now on, whatever the host."""
    def set_times(seconds: dict[str, float]) -> None:
        monkeypatch.setattr(selection, "decode_pass_s", lambda model, rows, repeats=3: seconds[model.format])
    return set_times


def wide_config(**overrides) -> EngineConfig:
    """tiny_config within the wide tiny llama's 512 positions."""
    return tiny_config(**{"max_context_tokens": 512, "warmup_prompt_tokens": (16, 64, 256), **overrides})


# -- the gate and auto --------------------------------------------------------------------------------

@pytest.mark.parametrize("ftype", LAYOUTS)
def test_the_gate_runs_on_each_kernel_layout_stores_its_result_for_the_file_and_auto_then_picks_gguf(
        ftype, folders, var_dir, timed):
    folder = folders(ftype)
    sha = model_sha256(folder)
    assert startgate.pending(CANDIDATES, sha, "cpu", folder) == ("gguf",)
    timed({"float32": 1.0, "gguf": 0.5})
    verdict = startgate.run(GateJob(str(folder), sha, ("gguf",), CANDIDATES, "cpu", 1, 4), lambda done, total: None)
    stored = quality.load(selection.gate_path(sha), sha)
    assert list(stored) == ["gguf"] and stored["gguf"].sequences == GATE_PROMPTS
    assert stored["gguf"].passes(CANDIDATES.gate), stored["gguf"]
    assert verdict.choice == "gguf", verdict.reason
    assert "gguf: decode pass" in verdict.reason and "float32: decode pass" in verdict.reason
    assert startgate.pending(CANDIDATES, sha, "cpu", folder) == ()  # a later start gates nothing


def test_a_gate_result_belongs_to_the_file_it_was_run_on(folders, var_dir):
    one, other = folders(K_QUANT), folders("Q6_K")
    sha, other_sha = model_sha256(one), model_sha256(other)
    assert sha != other_sha
    quality.store(selection.gate_path(sha), sha, [PASSING], "test")
    assert selection.check_explicit("gguf", sha, CANDIDATES).format == "gguf"
    with pytest.raises(ConfigError, match="gguf has no gate result for this model"):
        selection.check_explicit("gguf", other_sha, CANDIDATES)
    assert startgate.pending(CANDIDATES, other_sha, "cpu", other) == ("gguf",)


@pytest.mark.parametrize("stored,times,why", [
    (PASSING, {"float32": 0.5, "gguf": 1.0}, "gguf: decode pass 1000.0 ms at batch 1"),
    (FAILING, {"float32": 1.0, "gguf": 0.5}, "gguf: gguf fails the quality gate: mean KL 1.0000 > 0.5"),
])
def test_auto_on_a_k_quant_says_why_it_keeps_float32(folders, var_dir, timed, stored, times, why):
    folder = folders(K_QUANT)
    sha = model_sha256(folder)
    quality.store(selection.gate_path(sha), sha, [stored], "test")
    timed(times)
    choice, model = selection.choose_auto(load_model(folder, "float32"), sha, CANDIDATES, 4, "cpu", folder)
    assert (choice.format, model.format) == ("float32", "float32")
    assert why in choice.reason, choice.reason


def test_auto_picks_gguf_on_a_gguf_file_served_as_it_is(var_dir, timed):
    """load_model, model_sha256 and the gate command take a GGUF file itself; auto's check of what the
    file holds must too, or gguf is never a candidate there."""
    path = quantized.tiny("Q6_K")
    sha = model_sha256(path)
    quality.store(selection.gate_path(sha), sha, [PASSING], "test")
    timed({"float32": 1.0, "gguf": 0.5})
    choice, model = selection.choose_auto(load_model(path, "float32"), sha, CANDIDATES, 4, "cpu", path)
    assert (choice.format, model.format) == ("gguf", "gguf"), choice.reason


# -- warm restart -------------------------------------------------------------------------------------

def _start(folder: Path) -> bootstrap.Started:
    cfg = InferenceConfig(model_path=str(folder), engine=wide_config(format="gguf"),
                          formats=FormatsConfig(gate_at_start=False))
    return bootstrap.start_engine(cfg, model_sha256(folder))


def test_a_warm_restart_on_a_quantized_file_reuses_its_record_until_the_file_differs(var_dir, tmp_path,
                                                                                    monkeypatch):
    gguf, folder = tmp_path / "model.gguf", tmp_path / "model"
    shutil.copyfile(quantized.tiny(K_QUANT), gguf)
    prepare(gguf, folder)
    sha = model_sha256(folder)
    quality.store(selection.gate_path(sha), sha, [PASSING], "test")
    cold = _start(folder)
    assert not cold.warm and cold.record.format == "gguf"
    warm = _start(folder)
    assert warm.warm and warm.record == cold.record and "warmup_measured" not in warm.phases_s

    # Another file at the same path under the folder prepared from the first: the probe tells them apart.
    shutil.copyfile(quantized.tiny("Q6_K"), gguf)
    stale = _start(folder)
    assert not stale.warm and stale.record.probe_digest != cold.record.probe_digest
    assert _start(folder).warm  # the record was rewritten for the file now there

    # The folder prepared again from the new file (what a start does when the file's digest changed):
    # another model, whose gate result and record are its own.
    shutil.rmtree(folder)
    prepare(gguf, folder)
    assert model_sha256(folder) != sha
    with pytest.raises(ConfigError, match="no gate result"):
        _start(folder)


# -- LoRA beside the quantized blocks ------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """An adapter of every projection, made on the float model (the shapes are every type's)."""
    base = load_model(quantized.tiny("F32"), "float32")
    return make_adapter(base, tmp_path_factory.mktemp("adapter"), seed=3, rank=4, targets=ALL)


def _last_logits(runner: LlamaRunner, ids: list[int], slot: int, beside: list[int] | None = None) -> torch.Tensor:
    """The last position's logits of `ids` in `slot`, alone or beside a base row `beside`."""
    segments = [Segment(runner.new_cache(32), ids, slot)]
    if beside is not None:
        segments.append(Segment(runner.new_cache(32), beside, 0))
    with torch.inference_mode():
        return runner.forward(segments)[0]


@pytest.mark.parametrize("ftype", REPRESENTATIVE)
def test_an_adapter_beside_the_quantized_blocks_adds_pefts_unmerged_term(ftype, adapter):
    path = quantized.tiny(ftype)
    reference = load_model(path, "float32")
    ids = prompt(3, 10)
    want = peft_logits(reference, adapter, ids)[-1]
    with torch.inference_mode():
        want_base = reference(torch.tensor([ids])).logits[0, -1]
    for fmt in blocks.FORMATS:
        model = load_model(path, fmt)
        runner = LlamaRunner(model, block_tokens=16, pool_tokens=512)
        runner.lora = load_slots(model, [adapter])
        got, base = _last_logits(runner, ids, 1), _last_logits(runner, ids, 0)
        assert torch.equal(got, _last_logits(runner, ids, 1, beside=prompt(4, 7)))  # batch-invariant
        change, want_change = got - base, want - want_base
        assert want_change.norm() > 0.1 * want_base.norm()  # the adapter matters: the test can tell
        error = ((change - want_change).norm() / want_change.norm()).item()
        # gguf's 8-bit activations move the hidden states the term is computed on (measured: 0.03 on
        # Q8_0, 0.064 on Q4_K_M); gguf_f32 computes PEFT's term to float rounding (1e-5)
        assert error < (1e-4 if fmt == blocks.EXACT_FORMAT else 0.15), f"{fmt}: {error}"


# -- a variant and the breaker's fallback format beside a K-quant base -----------------------------------

async def _tokens(engine: Engine, rid: str) -> tuple[list[int], str, str]:
    events, fin = await collect(engine, request(rid, prompt(5), max_tokens=8))
    return ids(events), fin.variant, fin.format


@pytest.mark.asyncio
@pytest.mark.parametrize("primary,variant,fallback", [("gguf", "gguf_f32", "float32"),
                                                      ("float32", "gguf", "gguf_f32")])
async def test_a_variant_and_the_breaker_fallback_serve_beside_a_k_quant_base(folders, primary, variant, fallback):
    folder = folders(K_QUANT)
    e = wide_config(format=primary, variants={"v": variant},
                    breaker=dataclasses.replace(FAST_TRIP, fallback_format=fallback))
    cfg = InferenceConfig(model_path=str(folder), engine=e)
    engines = [Engine(load_model(folder, primary), e, others=bootstrap._other_models(cfg, e, primary))]
    engines += [Engine(load_model(folder, f), wide_config(format=f)) for f in (primary, variant, fallback)]
    for engine in engines:
        engine.warmup()
        await engine.start()
    try:
        served, *alone = engines
        want = {f: (await _tokens(a, f))[0] for f, a in zip((primary, variant, fallback), alone)}
        assert await _tokens(served, "p") == (want[primary], "primary", primary)
        await served.set_variant("v", "test")
        assert await _tokens(served, "v") == (want[variant], "v", variant)
        trip(served, 2)
        assert await _tokens(served, "f") == (want[fallback], "v", fallback)
    finally:
        for engine in engines:
            await engine.stop(grace_s=0)
