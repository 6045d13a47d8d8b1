"""The ETL: selection, lineage, dedup on the input, stable splits, byte-identical reruns."""
from __future__ import annotations

import json

import numpy as np
import pytest

from services.feedback.config import EtlConfig
from services.feedback.etl import in_val, run
from services.feedback.records import Feedback, stored_body
from services.feedback.store import open_store
from testing.records import record
from tests.feedback.records import upsert


def fill(store, n: int, start: int = 0, *, store_prompts: bool = True) -> None:
    store.put_records([stored_body(record(f"{i:032x}", prompt=(i, i + 1), content=f"q{i}"), store_prompts)
                       for i in range(start, start + n)])
    for i in range(start, start + n):
        upsert(store, [Feedback(f"{i:032x}", f"fb-{i}", "fact_error", "severe", (f"k{i}",), "wrong")])


def files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_two_runs_on_the_same_data_write_byte_identical_files(db_url, tmp_path):
    store = open_store(db_url)
    fill(store, 60)
    cfg = EtlConfig(val_percent=20, seed=7)
    first = run(store, tmp_path / "a", 0, cfg)
    second = run(store, tmp_path / "b", 0, cfg)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert first["dataset_version"] == second["dataset_version"]
    assert set(files(tmp_path / "a")) == {"train.jsonl", "val.jsonl", "splits.npz", "manifest.json"}


def test_examples_carry_lineage_and_only_the_selected_feedback(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'f.db'}")
    fill(store, 3)
    store.put_records([stored_body(record("e" * 32, prompt=(99,)), True)])
    upsert(store, [Feedback("e" * 32, "minor-one", "fact_error", "minor")])
    upsert(store, [Feedback("e" * 32, "logic-one", "logic_error", "severe")])
    manifest = run(store, tmp_path / "out", 0, EtlConfig(val_percent=0))
    lines = [json.loads(x) for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert manifest["counts"]["examples"] == 3 and len(lines) == 3
    ex = next(x for x in lines if x["source_trace_id"] == f"{1:032x}")
    assert ex["messages"] == [{"role": "user", "content": "q1"}] and ex["expected_keywords"] == ["k1"]
    assert ex["rejected_output_ids"] == [7, 8, 9] and ex["source_feedback_ids"] == ["fb-1"]


def test_duplicate_inputs_become_one_example_with_merged_keywords(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'f.db'}")
    store.put_records([stored_body(record("a" * 32, prompt=(5, 6)), True),
                       stored_body(record("b" * 32, prompt=(5, 6)), True)])
    upsert(store, [Feedback("a" * 32, "x", "fact_error", "severe", ("Paris",))])
    upsert(store, [Feedback("b" * 32, "y", "fact_error", "severe", ("France", "Paris"))])
    manifest = run(store, tmp_path / "out", 0, EtlConfig(val_percent=0))
    (ex,) = [json.loads(x) for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert ex["expected_keywords"] == ["Paris", "France"] and ex["source_feedback_ids"] == ["x", "y"]
    assert manifest["counts"]["skipped_duplicate_input"] == 1


def test_an_example_never_changes_split_as_the_data_grows(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'f.db'}")
    fill(store, 40)
    cfg = EtlConfig(val_percent=30)
    run(store, tmp_path / "small", 0, cfg)
    fill(store, 40, start=40)
    run(store, tmp_path / "big", 0, cfg)

    def ids(out, name):
        return {json.loads(x)["id"] for x in (tmp_path / out / f"{name}.jsonl").read_text().splitlines()}
    assert ids("small", "val") <= ids("big", "val") and ids("small", "train") <= ids("big", "train")
    assert ids("big", "val") and ids("big", "train")
    assert all(in_val(i, 30) for i in ids("big", "val"))


def test_the_saved_indices_reproduce_the_split_order(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'f.db'}")
    fill(store, 30)
    run(store, tmp_path / "out", 0, EtlConfig(val_percent=25, seed=11))
    saved = np.load(tmp_path / "out" / "splits.npz")
    assert int(saved["N"]) == 30 and int(saved["seed"]) == 11 and str(saved["numpy_version"]) == np.__version__
    fingerprints = sorted(json.loads(x)["id"] for name in ("train", "val")
                          for x in (tmp_path / "out" / f"{name}.jsonl").read_text().splitlines())
    train = [json.loads(x)["id"] for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [fingerprints[i] for i in saved["train"]] == train
    assert sorted(saved["train"].tolist() + saved["val"].tolist()) == list(range(30))


def test_records_without_stored_prompts_are_skipped_and_counted(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'f.db'}")
    fill(store, 2, store_prompts=False)
    manifest = run(store, tmp_path / "out", 0, EtlConfig())
    assert manifest["counts"]["examples"] == 0 and manifest["counts"]["skipped_prompt_not_stored"] == 2


@pytest.mark.parametrize("percent", [0, 100])
def test_val_percent_bounds(percent):
    assert all(in_val(f"{i:064x}", percent) is (percent == 100) for i in range(50))
