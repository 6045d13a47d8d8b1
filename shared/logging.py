"""JSON logs for every Keel process: one line per record with service, trace_id and rpc.

The interceptor sets ``trace_id`` and ``rpc`` in context variables for the duration of a call, so
any ``logging`` call made while serving it (core code included) carries them without passing them
around. Structured fields go in ``extra={...}`` and land as top-level JSON keys.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

trace_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="")
rpc_var: contextvars.ContextVar[str] = contextvars.ContextVar("rpc", default="")

# Attributes every LogRecord has; anything else was passed through ``extra`` and is emitted.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "service": self.service,
            "trace_id": getattr(record, "trace_id", None) or trace_id_var.get(),
            "rpc": getattr(record, "rpc", None) or rpc_var.get(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class ReadableFormatter(logging.Formatter):
    """One line for a person at a terminal: "WARNING supervisor: stage exited; restarting (stage=...)"
    (the structured fields as key=value, in the order given)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD and v is not None)
        text = f"{record.levelname} {record.name.removeprefix('keel.')}: {record.getMessage()}"
        return text + (f" ({fields})" if fields else "")


def setup_logging(service: str, level: str = "INFO") -> None:
    """Route every logger of this process to stderr as JSON. Call once at process start."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("grpc", "urllib3", "transformers", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
