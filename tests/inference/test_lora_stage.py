"""The stage's start-up (bootstrap.start_engine) checks the registry and preloads adapters, cold and warm."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from services.inference import bootstrap
from services.inference.config import InferenceConfig
from services.inference.lora.registration import register
from services.inference.lora.registry import LoraConfig
from services.inference.lora.startup import running_base
from services.inference.model.digest import model_sha256
from services.inference.model.forward import LlamaRunner
from services.inference.model.loader import load_model
from testing.lora import make_adapter
from testing.tiny import save_model
from tests.inference.helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture
def setup(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path / "var"))
    model_dir = tmp_path / "model"
    save_model(tiny, model_dir)
    cfg = InferenceConfig(model_path=str(model_dir), engine=tiny_config(format="float32"), lora=LoraConfig())
    sha = model_sha256(model_dir)
    runner = LlamaRunner(load_model(model_dir, "float32"))
    runner.calibrate_invariant_sizes(cfg.engine.max_batch_size)
    base = running_base(runner, model_dir, sha, "float32")
    register(make_adapter(tiny, tmp_path / "a", seed=1), "support", "1", base, cfg.lora)
    register(make_adapter(tiny, tmp_path / "b", seed=2), "legal", "1", running_base(runner, model_dir, sha, "bfloat16"),
             cfg.lora)
    return cfg, sha


def test_cold_and_warm_starts_preload_accepted_adapters_and_list_refused_ones(setup, caplog):
    cfg, sha = setup
    caplog.set_level(logging.INFO, logger="services.inference.lora.startup")
    for warm in (False, True):
        caplog.clear()
        started = bootstrap.start_engine(cfg, sha)
        (checked,) = [r for r in caplog.records if r.getMessage() == "adapters checked"]
        # the LoRA check runs are reused from var/warm on the warm start, measured on the cold one
        outcome = "reused" if warm else "measured"
        assert (checked.start_cache["base"], checked.start_cache["adapters"]) == (
            outcome, {"legal@1": outcome, "support@1": outcome})
        assert started.warm is warm and "adapters" in started.phases_s
        states = {s.name: s for s in started.engine.adapters.states}
        # legal@1's golden outputs were recorded as bfloat16: the weights are the same, so the
        # float32 stage checks it by the drift gate and serves it
        assert [(states[n].state, states[n].slot) for n in ("legal@1", "support@1")] == [("accepted", 1),
                                                                                      ("accepted", 2)]
        assert started.engine.primary_runner.lora is started.engine.adapters.slots
    caplog.clear()
    bootstrap.start_engine(replace(cfg, warm_restart=False), sha)  # no warm restart: nothing reused either
    (checked,) = [r for r in caplog.records if r.getMessage() == "adapters checked"]
    assert checked.start_cache == "off"


def test_without_a_tokenizer_file_an_empty_registry_starts_and_a_full_one_does_not(setup, tmp_path, monkeypatch):
    from services.inference.lora.startup import check_adapters
    from services.tokenizer.fileformat import CompiledFileError
    cfg, sha = setup
    monkeypatch.setenv("KEEL_TOKENIZER_VOCAB_FILE", str(tmp_path / "missing.kvoc"))
    runner = LlamaRunner(load_model(cfg.model_dir, "float32"))
    empty = LoraConfig(registry_dir=str(tmp_path / "empty"))
    assert check_adapters(empty, runner, cfg.model_dir, sha, "float32").states == ()
    with pytest.raises(CompiledFileError):
        check_adapters(cfg.lora, runner, cfg.model_dir, sha, "float32")
