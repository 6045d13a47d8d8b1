"""lm-evaluation-harness against Keel, as a team would run it: its `local-completions` model over
/v1/completions (token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`) on a small multiple-choice
task shipped here (tests/e2e/lmeval/), against the same harness with its own `hf` model on the same
weights. A server that ignored echo would score chance; one whose scores were off would disagree
with transformers' loglikelihoods.

The mesh (the session's, tests/e2e/conftest.py) serves the float32 format, the prepared folder's
weights, which transformers loads too: it is what `engine.format: auto` serves without stored gate
results (testing/mesh.py), and the test checks the format the stage reports. The quantized formats
differ from transformers by design (docs/inference-formats.md)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from keelctl.ask import DEV_API_KEY
from services.inference.model.modelcache import prepared
from shared.modelfile import model_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = "keel_tiny_mc"
HERE = Path(__file__).parent / "lmeval"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The task's YAML with its data file's absolute path."""
    out = tmp_path_factory.mktemp("lmeval-tasks")
    yaml = (HERE / f"{TASK}.yaml").read_text()
    (out / f"{TASK}.yaml").write_text(yaml + f"dataset_kwargs:\n  data_files:\n    train: {HERE / 'tiny_mc.jsonl'}\n")
    return out


def evaluate(model: str, model_args: dict, tasks: Path, batch_size: int = 1) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size,
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def loglikelihoods(result: dict) -> dict[tuple[int, int], float]:
    return {(s["doc_id"], i): float(r[0]) for s in result["samples"][TASK] for i, r in enumerate(s["filtered_resps"])}


def test_local_completions_scores_as_transformers_does_on_the_same_weights(mesh, tasks, monkeypatch):
    served = [r["format"] for r in mesh.log("inference-0.0") if r.get("msg") == "engine warm"]
    assert served[-1:] == ["float32"], served  # the running stage serves the weights transformers loads
    monkeypatch.setenv("OPENAI_API_KEY", DEV_API_KEY)  # local-completions sends it as the Bearer key
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    weights = prepared()
    tokenizer = str(weights / "hf-tokenizer")
    keel = evaluate("local-completions", {
        "base_url": f"http://{mesh.http}/v1/completions", "model": model_id(), "tokenizer_backend": "huggingface",
        "tokenizer": tokenizer, "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}, tasks)
    hf = evaluate("hf", {"pretrained": str(weights), "tokenizer": tokenizer, "dtype": "float32", "device": "cpu"},
                  tasks, batch_size=8)
    ours, theirs = loglikelihoods(keel), loglikelihoods(hf)
    assert ours.keys() == theirs.keys() and len(ours) == 48
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst < 1e-3, json.dumps({str(k): (ours[k], theirs[k]) for k in ours})
    acc = keel["results"][TASK]["acc,none"]
    assert acc == hf["results"][TASK]["acc,none"] and acc > 0.5  # chance is 0.25
