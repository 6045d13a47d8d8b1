"""Each stage takes what it needs from the served model at start, and refuses a model it cannot run
with a ConfigError (exit 2) naming the field."""
from __future__ import annotations

import pytest

from services.gateway import config as gateway_config
from services.gateway import server as gateway_server
from services.inference import config as inference_config
from services.inference import server as inference_server
from services.tokenizer import config as tokenizer_config
from services.tokenizer import server as tokenizer_server
from shared import modelcard, modelfile
from shared.config import ConfigError
from tests.shared.test_modelfile import write_gguf


@pytest.fixture
def shipped():
    return modelfile.source(modelfile.shipped_gguf(), environ={})


def test_the_gateway_holds_requests_to_the_models_context_or_a_lower_limit(shipped):
    cfg = gateway_config.load()
    assert cfg.limits.max_context_tokens is None
    card = modelcard.read(shipped)
    assert gateway_server.with_model(cfg, card).limits.max_context_tokens == 8192
    lower = gateway_config.load(environ={"KEEL_GATEWAY_LIMITS__MAX_CONTEXT_TOKENS": "1024"})
    assert gateway_server.with_model(lower, card).limits.max_context_tokens == 1024
    higher = gateway_config.load(environ={"KEEL_GATEWAY_LIMITS__MAX_CONTEXT_TOKENS": "9000"})
    with pytest.raises(ConfigError, match="limits.max_context_tokens.*8192"):
        gateway_server.with_model(higher, card)


def test_the_tokenizer_maps_the_models_own_compiled_vocabulary(shipped):
    cfg = tokenizer_server.with_model(tokenizer_config.load(), shipped)
    assert cfg.vocab_file == str(shipped.cache_dir / "vocab.kvoc") and cfg.max_length == 8192
    with pytest.raises(ConfigError, match="max_length"):
        tokenizer_server.with_model(tokenizer_config.load(environ={"KEEL_TOKENIZER_MAX_LENGTH": "10000"}), shipped)


def test_the_inference_stage_takes_the_models_stop_ids_and_refuses_an_architecture_it_lacks(shipped, tmp_path,
                                                                                         monkeypatch):
    cfg = inference_server.with_model(inference_config.load(), modelcard.read(shipped))
    assert cfg.engine.eos_token_ids == (0, 2) and cfg.model_dir == shipped.cache_dir
    monkeypatch.setenv("KEEL_MODELS_DIR", str(tmp_path / "models"))
    falcon = modelfile.source(write_gguf(tmp_path / "f.gguf", arch="falcon"), environ={})
    with pytest.raises(ConfigError, match=r"f.gguf is a falcon model; Keel runs llama"):
        inference_server.with_model(inference_config.load(), modelcard.read(falcon))
    assert not falcon.cache_dir.exists()  # refused before any preparation


def test_keel_up_refuses_a_path_that_is_no_model_before_starting_anything(tmp_path, monkeypatch, capsys):
    from keelctl.main import main

    monkeypatch.setenv("KEEL_MODEL", "")  # cmd_up sets it from --model; monkeypatch restores it
    assert main(["up", "--model", str(tmp_path / "nothing.gguf")]) == 2
    out = capsys.readouterr().out
    assert out.startswith("keel up refused: field 'model.path' breaks rule 'exists'") and "nothing.gguf" in out
