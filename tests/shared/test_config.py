"""Config loading: schema rules are enforced, nothing is coerced, env overrides are typed."""
from __future__ import annotations

import json

import pytest

from keelctl.layout import load_layout
from services.feedback import config as feedback_config
from services.gateway import config as gateway_config
from services.openai import config as openai_config
from services.tokenizer import config as tokenizer_config
from shared.config import CONFIG_DIR, ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "stage.yaml"
    p.write_text(text)
    return p


def test_shipped_configs_load():
    assert tokenizer_config.load().server.port == load_layout().stages.tokenizer.ports[0]
    assert gateway_config.load().api_keys[0].key_id == "dev"
    assert load_layout().stages.tokenizer.workers >= 1


def test_unknown_key_is_rejected_with_its_name(tmp_path):
    p = write(tmp_path, "server: {port: 1}\nvocab_file: x\nvocab_fiel: y\n")
    with pytest.raises(ConfigError, match="additionalProperties.*vocab_fiel"):
        tokenizer_config.load(p, environ={})


def test_string_for_integer_is_an_error_not_coerced(tmp_path):
    p = write(tmp_path, 'server: {port: "16"}\nvocab_file: x\n')
    with pytest.raises(ConfigError, match=r"field 'server.port' breaks rule 'type'"):
        tokenizer_config.load(p, environ={})


def test_range_rule_names_field(tmp_path):
    p = write(tmp_path, "server: {port: 1}\nvocab_file: x\nmax_input_bytes: 99999999999\n")
    with pytest.raises(ConfigError, match=r"field 'max_input_bytes' breaks rule 'maximum'"):
        tokenizer_config.load(p, environ={})


def test_env_override_is_typed_and_validated(tmp_path):
    p = write(tmp_path, "server: {port: 1}\nvocab_file: x\n")
    cfg = tokenizer_config.load(p, environ={"KEEL_TOKENIZER_SERVER__PORT": "50099"})
    assert cfg.server.port == 50099 and isinstance(cfg.server.port, int)
    with pytest.raises(ConfigError, match="server.port"):
        tokenizer_config.load(p, environ={"KEEL_TOKENIZER_SERVER__PORT": "not-a-port"})


def test_changed_file_is_picked_up_on_next_load(tmp_path):
    p = write(tmp_path, "server: {port: 1}\nvocab_file: x\nmax_length: 100\n")
    assert tokenizer_config.load(p, environ={}).max_length == 100
    p.write_text("server: {port: 1}\nvocab_file: x\nmax_length: 200\n")
    assert tokenizer_config.load(p, environ={}).max_length == 200


def test_gateway_deadline_must_be_multiple_of_100(tmp_path):
    text = (gateway_config.config.CONFIG_DIR / "gateway.yaml").read_text()
    p = write(tmp_path, text.replace("default_deadline_ms: 60000", "default_deadline_ms: 60050"))
    with pytest.raises(ConfigError, match="limits.default_deadline_ms.*multipleOf"):
        gateway_config.load(p, environ={})


def test_dataclass_rule_becomes_config_error_naming_the_block():
    """Values that pass the schema but break a dataclass's own check stop the stage with exit 2 (a
    ConfigError), not a traceback."""
    with pytest.raises(ConfigError, match=r"field 'retry' breaks rule 'RetryConfig'.*cap_s >= base_s"):
        gateway_config.load(environ={"KEEL_GATEWAY_RETRY__BASE_S": "2.0"})


def test_client_facing_error_in_engine_config_becomes_config_error():
    from services.inference import config as inference_config
    env = {"KEEL_INFERENCE_ENGINE__BREAKER__FALLBACK_FORMAT": "int8", "KEEL_INFERENCE_ENGINE__DEVICE": "cuda"}
    with pytest.raises(ConfigError, match=r"field 'engine' breaks rule 'EngineConfig'.*CPU only"):
        inference_config.load(environ=env)


def test_stage_exits_2_with_its_json_log_line_on_a_dataclass_rule():
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, KEEL_GATEWAY_RETRY__BASE_S="2.0")
    proc = subprocess.run([sys.executable, "-m", "services.gateway"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    line = json.loads([x for x in proc.stderr.splitlines() if x.startswith("{")][-1])
    assert line["msg"] == "invalid configuration; not starting" and "retry" in line["error"]


def _layout(tmp_path, stages: dict) -> dict[str, str]:
    """An environment whose mesh layout (KEEL_KEEL_CONFIG) has these stages."""
    path = tmp_path / "keel.json"
    path.write_text(json.dumps({"stages": stages}))  # JSON is YAML
    return {"KEEL_KEEL_CONFIG": str(path)}


def test_ports_and_upstreams_a_file_leaves_out_come_from_the_mesh_layout(tmp_path):
    env = _layout(tmp_path, {"tokenizer": {"ports": [51002, 51012], "metrics_ports": [9202, 9212]},
                             "inference": {"ports": [51003]}, "validator": {"ports": [51004]},
                             "feedback": {"ports": [51005]}, "gateway": {"ports": [51001]},
                             "openai": {"ports": [8180]}})
    tok = tokenizer_config.load(write(tmp_path, "vocab_file: x\n"), environ=env)
    assert (tok.server.port, tok.server.metrics_port) == (51002, 9202)  # a stage run alone: the first replica's
    gw = gateway_config.load(environ=env)
    assert gw.server.port == 51001 and gw.server.metrics_port == 0  # the layout gives it no metrics port
    assert gw.upstreams.tokenizer == ("127.0.0.1:51002", "127.0.0.1:51012")
    assert (gw.upstreams.inference, gw.upstreams.feedback) == (("127.0.0.1:51003",), ("127.0.0.1:51005",))
    assert feedback_config.load(environ=env).rotation.inference == ("127.0.0.1:51003",)
    assert feedback_config.load(environ=env).rotation.webhook_port == 0  # no webhook_ports: no webhook
    assert openai_config.load(environ=env).gateway == ("127.0.0.1:51001",)


def test_the_feedback_stages_webhook_port_comes_from_the_mesh_layout(tmp_path):
    env = _layout(tmp_path, {s: {"ports": [51000 + i]} for i, s in enumerate(("tokenizer", "inference", "validator",
                                                                              "gateway"))}
                  | {"feedback": {"ports": [51005], "webhook_ports": [29107]}})
    assert feedback_config.load(environ=env).rotation.webhook_port == 29107
    assert feedback_config.load(environ=dict(env, KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT="0")).rotation.webhook_port == 0


def test_the_file_and_then_the_environment_win_over_the_layout(tmp_path):
    env = _layout(tmp_path, {"tokenizer": {"ports": [51002], "metrics_ports": [9202]}, "inference": {"ports": [51003]},
                             "validator": {"ports": [51004]}})
    tok = tokenizer_config.load(write(tmp_path, "server: {port: 1}\nvocab_file: x\n"), environ=env)
    assert (tok.server.port, tok.server.metrics_port) == (1, 9202)
    gw_file = tmp_path / "gateway.yaml"
    shipped = (CONFIG_DIR / "gateway.yaml").read_text()
    gw_file.write_text(shipped.replace("upstreams:\n", "upstreams:\n  inference: [inference:50053]\n  feedback: "
                                                       "[]\n", 1))
    gw = gateway_config.load(gw_file, environ={**env, "KEEL_GATEWAY_SERVER__PORT": "50999"})
    assert gw.upstreams.inference == ("inference:50053",) and gw.upstreams.feedback == ()
    assert gw.server.port == 50999


def test_without_a_layout_file_a_stage_must_name_its_port(tmp_path):
    env = {"KEEL_KEEL_CONFIG": str(tmp_path / "absent.yaml")}
    with pytest.raises(ConfigError, match="'server' is a required property"):
        tokenizer_config.load(write(tmp_path, "vocab_file: x\n"), environ=env)
    tok = tokenizer_config.load(write(tmp_path, "server: {port: 1}\nvocab_file: x\n"), environ=env)
    assert (tok.server.port, tok.server.metrics_port) == (1, 0)
    env["KEEL_GATEWAY_SERVER__PORT"] = "50999"
    with pytest.raises(ConfigError, match="field 'upstreams' breaks rule 'required'"):
        gateway_config.load(environ=env)
