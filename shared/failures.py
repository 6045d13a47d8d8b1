"""The failure kinds the inference stage's circuit breaker counts, one breaker per kind
(services/inference/engine/breaker.py). The engine sees the first three itself; OUTPUT_LIMIT comes
from the gateway (Inference.ReportFailure's `kind`), which sees the validator cut an answer."""
from __future__ import annotations

from enum import StrEnum


class FailureKind(StrEnum):
    NUMERICAL_INSTABILITY = "numerical_instability"
    OOM = "oom"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"


# The kinds a caller may report; the engine counts the others itself.
REPORTABLE = (FailureKind.OUTPUT_LIMIT,)
