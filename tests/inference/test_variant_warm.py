"""Variants at start-up (bootstrap.py): in the warm-start fingerprint and record, and built from the
weight files when the served format is quantized. On the tiny model saved to a folder."""
from __future__ import annotations

import pytest

from services.inference import bootstrap
from services.inference.config import InferenceConfig
from services.inference.formats.selection import FormatsConfig
from services.inference.model.digest import model_sha256
from tests.inference.helpers import collect, ids, prompt, request, tiny_config


def _cfg(model_dir, **engine) -> InferenceConfig:
    # no gate results in the scratch var/: force lets int8 serve (the gate refusal is tested elsewhere)
    return InferenceConfig(model_path=str(model_dir), engine=tiny_config(**{"format": "float32", **engine}),
                           formats=FormatsConfig(force=True))


def _start(cfg: InferenceConfig) -> bootstrap.Started:
    return bootstrap.start_engine(cfg, model_sha256(cfg.model_dir))


@pytest.mark.slow
def test_the_record_covers_every_variant_and_a_changed_variant_list_measures_again(var_dir, model_dir):
    cfg = _cfg(model_dir, variants={"fallback": "int8"})
    cold = _start(cfg)
    assert set(cold.record.calibration.invariant_sizes) == {"float32", "int8"}
    warm = _start(cfg)
    assert warm.warm and warm.engine.calibration == cold.engine.calibration
    assert dict(warm.engine.variants) == {"primary": "float32", "fallback": "int8"}
    assert not _start(_cfg(model_dir, variants={"fallback": "bfloat16"})).warm
    assert not _start(_cfg(model_dir)).warm


@pytest.mark.asyncio
async def test_a_quantized_primary_serves_a_float_variant_loaded_from_the_weight_files(var_dir, model_dir):
    started = _start(_cfg(model_dir, format="int8", variants={"full": "float32"}))
    reference = _start(_cfg(model_dir))
    engine = started.engine
    await engine.start()
    await reference.engine.start()
    try:
        await engine.set_variant("full", "test")
        got, fin = await collect(engine, request("a", prompt(8), max_tokens=8))
        want, _ = await collect(reference.engine, request("b", prompt(8), max_tokens=8))
        assert (fin.variant, fin.format) == ("full", "float32") and ids(got) == ids(want)
    finally:
        await engine.stop(grace_s=0)
        await reference.engine.stop(grace_s=0)


def test_the_config_file_takes_variants_and_refuses_a_bad_one_naming_the_field():
    from services.inference import config as inference_config
    from shared.config import ConfigError
    cfg = inference_config.load(environ={"KEEL_INFERENCE_ENGINE__VARIANTS__FALLBACK": "int8"})
    assert dict(cfg.engine.variants) == {"fallback": "int8"}
    assert dict(inference_config.load(environ={}).engine.variants) == {}
    for key, value in (("PRIMARY", "int8"), ("FALLBACK", "int3")):
        with pytest.raises(ConfigError, match="engine.variants"):
            inference_config.load(environ={f"KEEL_INFERENCE_ENGINE__VARIANTS__{key}": value})
