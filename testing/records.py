"""Replay records as the feedback stage receives them (services/feedback/servicer.record_from_proto)."""
from __future__ import annotations

from services.feedback.records import ReplayRecord


def record(trace_id: str, *, created_ms: int = 1_700_000_000_000, prompt=(1, 2, 3), output=(7, 8, 9),
           content: str = "What is the capital of France?", seed: int = 42) -> ReplayRecord:
    return ReplayRecord.from_body({"trace_id": trace_id, "created_ms": created_ms, "prompt_ids": list(prompt),
            "messages": [{"role": "user", "content": content}],
            "sampling": {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": seed},
            "domain": "", "source": "", "output_ids": list(output), "finish_reason": "stop",
            "engine": {"format": "float32"}, "input_fingerprint": "f" * 64,
            "validation": {"passed": True, "verdicts": [], "probes": {"entropy_mean": 0.5}, "low_confidence": False}})
