"""`keel lora`: every command, in-process, on a small real model folder and real PEFT adapters."""
from __future__ import annotations

import json

import pytest

from keelctl.main import main
from services.tokenizer.compiler import compiled_path
from shared.modelfile import source as model_source
from testing.lora import make_adapter
from testing.tiny import save_model, tiny_model


@pytest.fixture
def mesh_env(tmp_path, monkeypatch):
    """The inference config pointed at a tiny Llama saved as safetensors, and a private var directory."""
    model_dir = tmp_path / "model"
    save_model(tiny_model(), model_dir)
    shipped_vocab = compiled_path(model_source())  # the tiny model has the shipped model's vocabulary
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("KEEL_MODEL", str(model_dir))
    monkeypatch.setenv("KEEL_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("KEEL_TOKENIZER_VOCAB_FILE", str(shipped_vocab))
    monkeypatch.setenv("KEEL_INFERENCE_ENGINE__FORMAT", "float32")
    monkeypatch.setenv("KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS", "1")
    return tmp_path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["lora", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_register_list_card_drift_and_verify(mesh_env, capsys):
    tiny = tiny_model()
    src = make_adapter(tiny, mesh_env / "french", seed=1)
    code, out, _ = run(capsys, "register", str(src))
    assert code == 0 and "registered french@1" in out and "golden outputs: 6 prompts x 16 tokens" in out
    code, out, _ = run(capsys, "register", str(src), "--id", "french")
    assert code == 0 and "registered french@2" in out
    registry = mesh_env / "var" / "adapters"

    code, out, _ = run(capsys, "card", "french@1")
    assert code == 0 and out.startswith("# Adapter french@1") and "rope_theta" in out
    code, out, _ = run(capsys, "drift", "french@2")
    assert code == 0 and "mean 0.000000" in out and "no significant drift" in out

    code, out, _ = run(capsys, "list", "--offline")
    assert code == 0 and "french@1" in out and "offline" in out and " ? " in out  # no stage has run yet
    code, out, _ = run(capsys, "verify")
    assert code == 0 and "french@1" in out and "accepted" in out and "0 need retraining" in out
    code, out, _ = run(capsys, "list", "--offline", "--json")
    listed = json.loads(out)
    assert [v["fits_running"] for v in listed["versions"]] == [True, True] and listed["replicas"] is None

    save_model(tiny_model(seed=1), mesh_env / "model")  # the base changes under the registry
    code, out, _ = run(capsys, "verify")
    assert code == 1 and "BASE_FINGERPRINT_MISMATCH" in out and "2 need retraining" in out
    request = json.loads((registry / "retrain" / "french@1.json").read_text())
    assert request["reason"] == "BASE_FINGERPRINT_MISMATCH" and request["differing_fields"] == ["weights_sha256"]
    assert request["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "use_rslora": False}
    code, out, _ = run(capsys, "list", "--offline")
    assert "no: weights_sha256" in out
    code, _, err = run(capsys, "drift", "french@1")
    assert code == 1 and "BASE_FINGERPRINT_MISMATCH" in err


def test_refusals_and_unknown_names(mesh_env, capsys):
    tiny = tiny_model()
    inert = make_adapter(tiny, mesh_env / "inert", seed=2, config_overrides={"target_modules": ["c_attn"]})
    code, _, err = run(capsys, "register", str(inert))
    assert code == 1 and "refused: INERT_ADAPTER" in err
    unknown = make_adapter(tiny, mesh_env / "odd", seed=2, config_overrides={"surprise": True})
    code, _, err = run(capsys, "register", str(unknown))
    assert code == 1 and "UNSUPPORTED_ADAPTER_CONFIG" in err and "key=surprise" in err
    code, _, err = run(capsys, "card", "nobody@1")
    assert code == 1 and "ADAPTER_NOT_FOUND" in err
    code, _, err = run(capsys, "register", str(inert), "--id", "../up")
    assert code == 2 and "INVALID_ADAPTER_NAME" in err


@pytest.mark.asyncio
async def test_list_shows_each_replicas_state_through_list_adapters(mesh_env, capsys):
    import asyncio

    import grpc
    from prometheus_client import CollectorRegistry

    from keel.inference.v1 import inference_pb2_grpc
    from services.inference.engine.core import Engine
    from services.inference.lora.registry import LoraConfig, load_registry
    from services.inference.lora.startup import running_base
    from services.inference.model.digest import model_sha256
    from services.inference.model.modelcache import prepared
    from services.inference.servicer import InferenceServicer
    from shared.metrics import metrics_for
    from testing.ports import free_port
    from tests.inference.helpers import tiny_config

    tiny = tiny_model()
    assert main(["lora", "register", str(make_adapter(tiny, mesh_env / "good", seed=1))]) == 0
    assert main(["lora", "register", str(make_adapter(tiny, mesh_env / "wide", seed=2, rank=8)),
                 "--id", "wide"]) == 0
    capsys.readouterr()
    engine = Engine(tiny, tiny_config(format="float32"))
    engine.warmup()
    cfg = LoraConfig(registry_dir=str(mesh_env / "var" / "adapters"), max_rank=4)  # this replica refuses rank 8
    served = prepared()  # the prepared folder of the tiny model (KEEL_MODEL), as `keel lora register` used
    base = running_base(engine.primary_runner, served, model_sha256(served), "float32")
    engine.install_adapters(load_registry(cfg, base))
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(engine, metrics_for("inference", CollectorRegistry())), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        code = await asyncio.to_thread(main, ["lora", "list", "--target", f"127.0.0.1:{port}"])
        out = capsys.readouterr().out
    finally:
        await server.stop(0)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if "@" in line.split()[0]}
    assert "accepted slot 1" in lines["good@1"]
    assert "refused UNSUPPORTED_ADAPTER_CONFIG" in lines["wide@1"]
    assert f"replica 127.0.0.1:{port}: base {base.digest[:16]}" in out
