"""Warm start of the LoRA checks: the check runs' results, kept under var/warm and reused by the next start.

The start-up checks (registry.py) run the base model's check prompts greedily (for ADAPTER_CHANGES_NOTHING)
and every adapter's check prompts teacher-forced on its golden outputs (GOLDEN_MISMATCH, ADAPTER_DRIFT).
Those runs are the expensive part of a start, and their results depend only on:
  * the engine (its warm-start fingerprint key: weights hash, format, torch/BLAS build, CPU capability,
    threads, engine version and settings, warmcache.py), the runner's invariant batch sizes and the
    base fingerprint fields (tokenizer and template hashes, config values, library versions);
  * the check prompts (its sha256);
  * for an adapter, additionally its four files: adapter_model.safetensors, adapter_config.json,
    keel-adapter.json and golden.safetensors (`files_sha256`).
The first group plus the check prompts keys the record (`lora-<key>.json` beside the engine's records);
the files key each adapter's entry inside it. What is kept is the *measurement*, per check row: the
greedy ids, the per-position KL(registered || now) for adapters, and the sha256 of the row's
float32 log-probabilities; never a verdict. The verdict is derived from it by the same code on a
cached start as on a cold one (registry._judge), with the current `lora.*` settings, so a refusal
stays the same refusal and a changed threshold applies at once.

A cached start verifies before it trusts: it recomputes one check row (the same, randomly drawn row
for every adapter and for the base; all of them in one batched run, rows being batch-invariant) and
requires the recomputed facts (greedy ids, KL values, log-probability digest) to equal the cached
ones bit for bit. A mismatch of the base row drops the whole record; of an adapter row, that
adapter's entry; either is then measured in full and the record rewritten. The record also carries a
sha256 over its body, so accidental corruption of any row is caught when it is read. What this does
not stop: someone able to write var/ forging rows other than the drawn one together with the
checksum (they are caught with probability 1/rows per start). The same person could rewrite the
registry's golden outputs and their hashes, so the cache adds no trust the registry does not already
need. `keel lora verify` never uses the cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file

from services.inference.lora import checkprompts, manifest
from services.inference.lora.checkprompts import CheckRow, Trace
from services.inference.model.loraslots import LoraSlots
from shared.config import var_dir
from shared.jsonfile import write_json

if TYPE_CHECKING:
    from services.inference.lora.registry import Base

log = logging.getLogger(__name__)

RECORD_VERSION = 1
ADAPTER_FILES = (*manifest.PEFT_FILES, manifest.MANIFEST, manifest.GOLDEN)
# The fields of a stored row and the type of each (lists: of their items). base_row(), adapter_row().
BASE_ROW = {"tokens": int, "digest": str}
ADAPTER_ROW = {"greedy": int, "kl": float, "digest": str}


def files_sha256(folder: Path) -> str:
    """One digest over an adapter version's four files (weights, config, record, golden outputs)."""
    return hashlib.sha256("".join(f"{n}:{manifest.file_sha256(folder / n)}\n" for n in ADAPTER_FILES)
                          .encode()).hexdigest()


def _digest(trace: Trace) -> str:
    return hashlib.sha256(trace.logprobs.cpu().contiguous().numpy().tobytes()).hexdigest()


def base_row(trace: Trace) -> dict:
    """What the start-up checks use of a greedy base row, and the digest that pins it."""
    return {"tokens": list(trace.tokens), "digest": _digest(trace)}


def adapter_row(golden: dict, i: int, trace: Trace) -> dict:
    """What the checks use of adapter check row `i` (teacher-forced on its golden outputs)."""
    kl = checkprompts.kl_recorded(golden["ids"][i].long(), golden["logprobs"][i], trace.logprobs.cpu())
    return {"greedy": list(trace.greedy), "kl": kl.tolist(), "digest": _digest(trace)}


def adapter_rows(folder: Path, traces: list[Trace]) -> list[dict]:
    golden = load_file(str(folder / manifest.GOLDEN))
    return [adapter_row(golden, i, t) for i, t in enumerate(traces)]


class StartCache:
    """The record of one (engine, base, check prompts); `outcome` says what this start did with it (logged)."""

    def __init__(self, engine_key: str, base: Base):
        self.key_fields = {"engine": engine_key, "base_fingerprint": base.digest,
                           "check_prompts_sha256": base.check_prompts.sha256, "format": base.runner.format,
                           "invariant_sizes": list(base.runner.invariant_sizes), "record_version": RECORD_VERSION}
        key = hashlib.sha256(json.dumps(self.key_fields, sort_keys=True).encode()).hexdigest()[:32]
        self.path = var_dir() / "warm" / f"lora-{key}.json"
        self.rows = len(base.check_prompts.prompts)
        self.base: list[dict] | None = None
        self.adapters: dict[str, dict] = {}
        self.outcome: dict = {"record": str(self.path), "base": "measured", "adapters": {}}
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            body = data["body"]
            if data["key_fields"] != self.key_fields or data["checksum"] != _checksum(body):
                raise ValueError("key fields or checksum do not match")
            if not _rows_ok(body["base"], self.rows, BASE_ROW) or not isinstance(body["adapters"], dict):
                raise ValueError("base rows do not match the check prompts")
            self.base, self.adapters = body["base"], body["adapters"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unusable LoRA start-up record; measuring again",
                        extra={"record": str(self.path), "error": str(exc)})
            self.outcome["base"] = "record unusable, measured"

    def adapter(self, name: str, files_sha: str) -> list[dict] | None:
        entry = self.adapters.get(name)
        if isinstance(entry, dict) and entry.get("files_sha256") == files_sha and \
                _rows_ok(entry.get("rows"), self.rows, ADAPTER_ROW):
            return entry["rows"]
        return None

    def store(self, base: list[dict], adapters: dict[str, dict]) -> None:
        body = {"base": base, "adapters": adapters}
        try:
            write_json(self.path, {"key_fields": self.key_fields, "checksum": _checksum(body), "body": body})
        except OSError as exc:  # a read-only var/ still starts; the next start measures again
            log.warning("cannot write the LoRA start-up record", extra={"record": str(self.path),
                                                                        "error": str(exc)})


def _rows_ok(rows, count: int, shape: dict[str, type]) -> bool:
    """`count` rows, each a dict of exactly `shape`'s fields and types (a record is data from disk)."""
    def ok(value, kind) -> bool:
        if kind is str:
            return isinstance(value, str)
        return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    return isinstance(rows, list) and len(rows) == count and all(
        isinstance(r, dict) and r.keys() == shape.keys() and all(ok(r[k], t) for k, t in shape.items()) for r in rows)


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_facts(base: Base, candidates: list, cache: StartCache | None) -> tuple[list[dict], list[list[dict]]]:
    """The base's greedy rows and each candidate's teacher-forced rows (candidates: (folder, manifest,
    weights) in slot order), from the cache where it is verified, measured otherwise."""
    runner, prompts, steps = base.runner, base.check_prompts.prompts, base.check_prompts.continuation_tokens
    slots = LoraSlots([w for _, _, w in candidates], runner.model, runner.device)
    shas = [files_sha256(folder) if cache else "" for folder, _, _ in candidates]
    base_rows = cache.base if cache else None
    rows: list[list[dict] | None] = [cache.adapter(m.name, sha) if base_rows is not None else None
                                     for (_, m, _), sha in zip(candidates, shas)]
    if base_rows is not None:
        base_rows, rows = _verify(base, candidates, slots, base_rows, rows, cache.outcome)
    if base_rows is None:
        runner.lora = None
        base_rows = [base_row(t) for t in checkprompts.run(runner, [CheckRow(p, 0) for p in prompts], steps)]
    todo = [k for k, r in enumerate(rows) if r is None]
    if todo:  # one run for every adapter to measure (rows are batch-invariant: batching changes no bits)
        runner.lora = slots
        forced = [CheckRow(p, k + 1, g) for k in todo for p, g in zip(prompts, candidates[k][1].golden_ids)]
        traces = checkprompts.run(runner, forced, steps)
        for j, k in enumerate(todo):
            rows[k] = adapter_rows(candidates[k][0], traces[j * len(prompts):(j + 1) * len(prompts)])
    if cache:
        for _, m, _ in candidates:
            cache.outcome["adapters"].setdefault(m.name, "measured")
        if cache.outcome["base"] != "reused" or todo or set(cache.adapters) != {m.name for _, m, _ in candidates}:
            cache.store(base_rows, {m.name: {"files_sha256": sha, "rows": r}
                                    for (_, m, _), sha, r in zip(candidates, shas, rows)})
    return base_rows, rows


def _verify(base: Base, candidates: list, slots: LoraSlots, base_rows: list[dict],
            rows: list[list[dict] | None], outcome: dict) -> tuple[list[dict] | None, list[list[dict] | None]]:
    """Recompute one randomly drawn check row of the base and of every cached adapter, in one run, and
    keep only the cached entries whose row comes out bit for bit the same."""
    runner, prompts = base.runner, base.check_prompts.prompts
    i = secrets.randbelow(len(prompts))
    cached = [k for k, r in enumerate(rows) if r is not None]
    runner.lora = slots
    check = [CheckRow(prompts[i], 0)] + [CheckRow(prompts[i], k + 1, candidates[k][1].golden_ids[i]) for k in cached]
    traces = checkprompts.run(runner, check, base.check_prompts.continuation_tokens)
    if base_row(traces[0]) != base_rows[i]:
        log.warning("the LoRA start-up record failed its verification (base check row); measuring again",
                    extra={"row": i})
        outcome["base"] = "verification failed, measured"
        return None, [None] * len(rows)
    outcome["base"] = "reused"
    out = list(rows)
    for k, trace in zip(cached, traces[1:]):
        folder, m, _ = candidates[k]
        if adapter_row(load_file(str(folder / manifest.GOLDEN)), i, trace) == rows[k][i]:
            outcome["adapters"][m.name] = "reused"
        else:
            log.warning("the LoRA start-up record failed its verification; measuring the adapter again",
                        extra={"adapter": m.name, "row": i})
            outcome["adapters"][m.name] = "verification failed, measured"
            out[k] = None
    outcome["verified_row"] = i
    return base_rows, out
