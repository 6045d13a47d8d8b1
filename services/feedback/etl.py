"""`keel etl run --since 24h --out DIR`: severe factual errors -> a reproducible JSONL chat dataset.

1. Select feedback (config ``etl.severities`` x ``etl.error_types``, default severe fact_error)
   created within ``--since``, joined to its replay record for the exact prompt and answer;
   records whose prompt was not stored are skipped (counted in the manifest).
2. Deduplicate on the input fingerprint (sha256 of the prompt's token ids): the feedback items on
   one input become one example; their expected keywords are merged.
3. Split by a hash of that fingerprint: an example lands in ``val`` when
   ``int(sha256(fingerprint)[:8], 16) % 100 < etl.val_percent``, so it never changes split as the
   data grows. Within a split, examples are sorted by fingerprint, then shuffled with
   ``numpy.random.Generator(PCG64(seed))``.
4. Write ``train.jsonl``, ``val.jsonl``, ``splits.npz`` (the indices into the fingerprint-sorted
   example list, N, the seed, the numpy version and the sha256 of the ordered ids: the saved
   indices, not the generator's stream, make the split reproducible on any numpy build) and
   ``manifest.json`` (the dataset version is the sha256 of the three data files).
Nothing written depends on the wall clock: the same data gives byte-identical files.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

import numpy as np

from services.feedback import config as fb_config
from services.feedback.store import Store, now_ms, open_store
from shared.durations import parse_duration
from shared.progress import Progress

FORMAT = "keel-feedback-sft/1"
_FIXED_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # zip entries carry a date: fixed, so the file is reproducible


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def select(store: Store, since_ms: int, cfg: fb_config.EtlConfig,
           progress=None) -> tuple[list[dict], dict[str, int]]:
    """Examples, one per input fingerprint, sorted by it; and the counts of what was left out.
    `progress`, when given, is called with 1 per feedback row read."""
    by_input: dict[str, dict] = {}
    skipped = {"prompt_not_stored": 0, "duplicate_input": 0}
    for fb, rec in store.feedback_with_records(since_ms, cfg.severities, cfg.error_types):
        if progress is not None:
            progress(1)
        if not rec.prompt_stored:
            skipped["prompt_not_stored"] += 1
            continue
        key = rec.prompt_sha256
        ex = by_input.get(key)
        if ex is None:
            body = rec.to_body()  # the example carries the record's own JSON form of these fields
            by_input[key] = {"id": key, "messages": body["messages"], "rejected_output_ids": body["output_ids"],
                             "expected_keywords": list(fb["expected_keywords"]),
                             "source_trace_id": rec.trace_id, "source_feedback_ids": [fb["feedback_id"]],
                             "error_type": fb["error_type"], "severity": fb["severity"],
                             "sampling": body["sampling"], "engine": body["engine"]}
            continue
        skipped["duplicate_input"] += 1
        ex["source_feedback_ids"].append(fb["feedback_id"])
        ex["expected_keywords"] += [k for k in fb["expected_keywords"] if k not in ex["expected_keywords"]]
    return [by_input[k] for k in sorted(by_input)], skipped


def in_val(fingerprint: str, val_percent: int) -> bool:
    return int(hashlib.sha256(fingerprint.encode()).hexdigest()[:8], 16) % 100 < val_percent


def split(examples: list[dict], cfg: fb_config.EtlConfig) -> dict[str, np.ndarray]:
    """Indices into ``examples`` per split, each shuffled by one PCG64 generator (train first)."""
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    out = {}
    for name, want_val in (("train", False), ("val", True)):
        idx = np.array([i for i, ex in enumerate(examples) if in_val(ex["id"], cfg.val_percent) == want_val],
                       dtype=np.int64)
        out[name] = idx[rng.permutation(len(idx))]
    return out


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            with zf.open(zipfile.ZipInfo(f"{name}.npy", date_time=_FIXED_ZIP_TIME), "w") as f:
                np.lib.format.write_array(f, np.asarray(arrays[name]), allow_pickle=False)
    return buf.getvalue()


def write(out: Path, examples: list[dict], skipped: dict[str, int], cfg: fb_config.EtlConfig) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    splits = split(examples, cfg)
    files: dict[str, bytes] = {}
    for name, idx in splits.items():
        files[f"{name}.jsonl"] = "".join(_dumps(examples[i]) + "\n" for i in idx).encode("utf-8")
    ordered_ids = "\n".join(examples[i]["id"] for name in ("train", "val") for i in splits[name])
    files["splits.npz"] = _npz_bytes({
        "train": splits["train"], "val": splits["val"], "N": np.int64(len(examples)), "seed": np.uint64(cfg.seed),
        "numpy_version": np.str_(np.__version__),
        "ids_sha256": np.str_(hashlib.sha256(ordered_ids.encode()).hexdigest())})
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())}
    manifest = {"format": FORMAT, "dataset_version": hashlib.sha256(_dumps(digests).encode()).hexdigest(),
                "files": digests,
                "counts": {"examples": len(examples), "train": len(splits["train"]), "val": len(splits["val"]),
                           **{f"skipped_{k}": v for k, v in skipped.items()}},
                "selection": {"severities": list(cfg.severities), "error_types": list(cfg.error_types)},
                "split": {"key": "sha256 of prompt token ids", "val_percent": cfg.val_percent, "seed": cfg.seed,
                          "numpy_version": np.__version__}}
    files["manifest.json"] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    for name, data in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out / name)
    return manifest


def run(store: Store, out: Path, since_ms: int, cfg: fb_config.EtlConfig, progress=None) -> dict:
    examples, skipped = select(store, since_ms, cfg, progress)
    return write(out, examples, skipped, cfg)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="keel etl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--since", default="24h")
    r.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cfg = fb_config.load()
    store = open_store(cfg.database_url, connect_timeout_s=cfg.database.connect_timeout_s)
    try:
        since_ms = now_ms() - int(parse_duration(args.since) * 1000)
    except ValueError as exc:
        p.error(str(exc))
    with Progress("etl: feedback rows read", unit="row") as bar:
        manifest = run(store, args.out, since_ms, cfg.etl, bar.update)
    print(f"dataset {manifest['dataset_version']}: {manifest['counts']} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
