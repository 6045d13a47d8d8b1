"""LoRA adapters through the whole mesh with the real model: the adapters made by training/adapters.py
(PEFT, real SmolLM2 weights) registered with `keel lora register` before the mesh starts; the pirate
adapter changes the answer and is echoed, traced, counted and replayed; an unknown name is NOT_FOUND;
the mismatched, inert and unknown-key adapters are refused at start and every request naming one is
FAILED_PRECONDITION with the refusal reason, never the base model's answer.

Registration itself refuses the inert and the unknown-key adapters (this build's checks run there
too). To prove the checks at start as well, the fixture puts them in the registry as a build that
accepted them would have (a copy of the pirate's record with their files and hashes): the start-up
checks must still refuse them.

The mesh is the one tests/e2e/test_lora_doc_steps.py walks docs/lora.md's block to (the session
fixture lora_walk, tests/e2e/conftest.py): the block registers the pirate, the adapters here are
registered beside it before `keel up`, and the stage serves int8 (the pirate's golden outputs made
in float32), so these properties hold in a served format other than the registration's."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import grpc
import pytest

from keelctl.ask import DEV_API_KEY, build_request
from services.tokenizer.compiler import compiled_path
from shared.modelfile import source as model_source
from testing.mesh import ROOT, wait_until
from tests.e2e.conftest import error_info
from tests.e2e.test_cli import keel
from tests.e2e.test_feedback import store
from tests.e2e.test_observability import scrape
from training.adapters import DEFAULT_OUT
from training.lora import PERTURBED_BASE

# Training the adapters the first time (then cached under var/adapters-src) takes minutes on 2 cores.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = "What is the capital of France?"
VERSION = "1"
# Each refused adapter and the check that refuses it, at registration and at start.
REFUSED = {"pirate-mismatched": "BASE_FINGERPRINT_MISMATCH", "pirate-inert": "INERT_ADAPTER",
           "pirate-unknown-key": "UNSUPPORTED_ADAPTER_CONFIG"}
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def keel_lora(tmp, *args: str, model=None) -> subprocess.CompletedProcess:
    """`keel lora ...` on the test mesh's registry; ``model``: the base to register against."""
    env = dict(os.environ, KEEL_VAR_DIR=str(tmp / "var"))
    if model is not None:  # a perturbed copy of the shipped model's weights: its vocabulary is the shipped one
        env.update(KEEL_MODEL=str(model), KEEL_MODELS_DIR=str(tmp / "models"),
                   KEEL_TOKENIZER_VOCAB_FILE=str(compiled_path(model_source())))
    return subprocess.run([sys.executable, "-m", "keelctl", "lora", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def register(tmp, folder, name: str, model=None) -> subprocess.CompletedProcess:
    return keel_lora(tmp, "register", str(folder), "--id", name, "--version", VERSION,
                     "--training-data-manifest", str(folder / "dataset.json"), model=model)


def place_as_accepted_elsewhere(registry, name: str, folder) -> None:
    """Put ``folder``'s PEFT files in the registry as ``name``@VERSION with an intact record (the
    pirate's, with these files' hashes), as a build that accepted them would have registered them."""
    dest = registry / name / VERSION
    shutil.copytree(registry / "pirate" / VERSION, dest)
    for f in PEFT_FILES:
        shutil.copyfile(folder / f, dest / f)
    record = json.loads((dest / "keel-adapter.json").read_text())
    record["id"] = name
    record["files_sha256"] = {f: hashlib.sha256((dest / f).read_bytes()).hexdigest() for f in PEFT_FILES}
    (dest / "keel-adapter.json").write_text(json.dumps(record, indent=1, sort_keys=True))


def register_beside_the_pirate(tmp) -> dict[str, subprocess.CompletedProcess]:
    """The adapters beside the pirate (which docs/lora.md's block registered against the served
    base): the mismatched one against the perturbed base it was trained on, the inert and
    unknown-key ones refused by registration, then placed as above. Their `keel lora register` runs."""
    source = ROOT / DEFAULT_OUT
    mismatched = source / "pirate-mismatched"
    outputs = {"pirate-mismatched": register(tmp, mismatched, "pirate-mismatched", model=mismatched / PERTURBED_BASE)}
    for name in ("pirate-inert", "pirate-unknown-key"):
        outputs[name] = register(tmp, source / name, name)
        place_as_accepted_elsewhere(tmp / "var" / "adapters", name, source / name)
    return outputs


@pytest.fixture(scope="module")
def registration(lora_walk):
    """The registrations of register_beside_the_pirate."""
    return lora_walk[2]


@pytest.fixture(scope="module")
def lora_mesh(lora_walk):
    return lora_walk[0]


def generate(mesh, adapter: str = "", max_tokens: int = 16):
    request = build_request(PROMPT, max_tokens=max_tokens, seed=1, adapter=adapter)
    with grpc.insecure_channel(mesh.gateway) as ch:
        return mesh.stub(ch).Generate(request, metadata=(("x-api-key", DEV_API_KEY),), timeout=180)


def refusal(mesh, adapter: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        generate(mesh, adapter)
    return exc.value


@pytest.fixture(scope="module")
def answers(lora_mesh):
    return generate(lora_mesh), generate(lora_mesh, "pirate")


def test_the_adapter_changes_the_answer_and_is_echoed(answers):
    base, pirate = answers
    assert base.adapter == "" and "Paris" in base.text
    assert pirate.adapter == f"pirate@{VERSION}"
    assert pirate.text != base.text and "Arr" in pirate.text


def test_the_stream_ends_with_the_adapter_that_served(lora_mesh, answers):
    request = build_request(PROMPT, max_tokens=16, seed=1, adapter="pirate")
    with grpc.insecure_channel(lora_mesh.gateway) as ch:
        events = list(lora_mesh.stub(ch).GenerateStream(request, metadata=(("x-api-key", DEV_API_KEY),),
                                                         timeout=180))
    done = events[-1].done
    assert done.adapter == f"pirate@{VERSION}" and done.text == answers[1].text
    assert "".join(e.delta for e in events[:-1]).startswith("Arr")


def test_a_named_version_serves_exactly_it(lora_mesh, answers):
    again = generate(lora_mesh, f"pirate@{VERSION}")
    assert again.adapter == f"pirate@{VERSION}" and again.text == answers[1].text


def test_an_unknown_adapter_is_not_found(lora_mesh):
    err = refusal(lora_mesh, "ghost")
    assert err.code() == grpc.StatusCode.NOT_FOUND and error_info(err).reason == "ADAPTER_NOT_FOUND"
    err = refusal(lora_mesh, "pirate@99")
    assert err.code() == grpc.StatusCode.NOT_FOUND and error_info(err).reason == "ADAPTER_NOT_FOUND"


def test_registration_refuses_the_inert_and_the_unknown_key_adapters(registration):
    outputs = registration
    assert outputs["pirate-mismatched"].returncode == 0  # fits the base it was trained on
    for name in ("pirate-inert", "pirate-unknown-key"):
        out = outputs[name]
        assert out.returncode != 0 and REFUSED[name] in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_adapter_is_failed_precondition_with_its_reason(lora_mesh, name):
    err = refusal(lora_mesh, name)
    info = error_info(err)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and info.reason == "ADAPTER_REFUSED"
    assert info.metadata["refusal_reason"] == REFUSED[name] and info.metadata["adapter"] == f"{name}@{VERSION}"


def test_keel_lora_list_shows_each_version_and_its_state_on_the_replica(lora_mesh):
    out = keel(lora_mesh, "lora", "list")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if "@" in line.split()[0]}
    assert "accepted" in rows[f"pirate@{VERSION}"]
    for name, reason in REFUSED.items():
        assert f"refused {reason}" in rows[f"{name}@{VERSION}"]
    assert "no: weights_sha256" in rows[f"pirate-mismatched@{VERSION}"]  # the matrix: it fits another base


def test_a_malformed_adapter_is_invalid_argument(lora_mesh):
    err = refusal(lora_mesh, "pirate@1@2")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_info(err).reason == "INVALID_ADAPTER"
    assert error_info(err).metadata["field"] == "adapter"


def test_keel_ask_and_keel_trace_show_the_adapter(lora_mesh):
    out = keel(lora_mesh, "ask", PROMPT, "--adapter", "pirate", "--max-tokens", "12", "--seed", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"adapter pirate@{VERSION}" in out.stdout
    trace_id = out.stdout.split("trace_id: ")[1].split()[0]
    shown = wait_until(lambda: (t := keel(lora_mesh, "trace", trace_id)).returncode == 0
                       and f"adapter.served=pirate@{VERSION}" in t.stdout and t.stdout, 30, "the trace")
    assert "adapter.requested=pirate" in shown
    refused = keel(lora_mesh, "ask", PROMPT, "--adapter", "pirate-inert")
    assert refused.returncode == 1 and "FAILED_PRECONDITION: ADAPTER_REFUSED" in refused.stdout


def test_gateway_counts_answers_by_the_serving_adapter(lora_mesh, answers):
    families = scrape(lora_mesh.layout["stages"]["gateway"]["metrics_ports"][0])
    by_adapter = {s.labels["adapter"]: s.value for s in families["keel_gateway_adapter_requests"]
                  if s.name.endswith("_total")}
    assert by_adapter.get(f"pirate@{VERSION}", 0) >= 1 and by_adapter.get("base", 0) >= 1
    assert not set(by_adapter) & {"ghost", "pirate", *REFUSED}  # never a requested name


def test_keel_replay_reruns_with_the_same_adapter(lora_mesh, answers):
    pirate = answers[1]
    record = wait_until(lambda: store(lora_mesh).get_record(pirate.trace_id), 30, "the replay record")
    assert record.adapter == f"pirate@{VERSION}"
    out = keel(lora_mesh, "replay", pirate.trace_id)
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout + out.stderr


def test_the_http_api_lists_accepted_adapters_and_refuses_a_refused_one_with_409(lora_mesh):
    """The OpenAI-compatible front of the same mesh: /v1/models names each accepted adapter as
    id@version (none refused), and a refused one is HTTP 409 with Keel's reason as the error code."""
    import openai

    from tests.e2e.test_openai import client

    http = client(lora_mesh)
    models = {m.id for m in http.models.list().data}
    assert f"pirate@{VERSION}" in models and not {f"{name}@{VERSION}" for name in REFUSED} & models
    with pytest.raises(openai.ConflictError) as exc:
        http.chat.completions.create(model=f"pirate-inert@{VERSION}", max_tokens=4,
                                     messages=[{"role": "user", "content": PROMPT}])
    assert exc.value.status_code == 409 and exc.value.body["code"] == "ADAPTER_REFUSED"
