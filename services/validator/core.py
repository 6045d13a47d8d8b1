"""The validator stage's core, wired: input check -> quarantine, output pipeline -> review.

What the gRPC servicer calls (it stays a thin translation layer, no policy of its own):

    core = ValidatorCore.build(contracts_dir, pipeline_cfg, quarantine_cfg)
    core.start()                                   # spill replay thread; core.close() at exit
    flags, qid = core.validate_input(payload_json, source=..., domain=..., trace_id=...)
    result = core.validate_output(text, domain=..., token_entropies=[...], prompt=..., ...)

``validate_input`` quarantines every rejected or flagged input before answering, and raises
:class:`InvalidInput` for a rejection (``metadata`` carries ``rule`` and ``quarantine_id``).
Both calls are synchronous; they block at most one Redis socket timeout (then spill).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from services.validator.contracts import InputChecker, InputVerdict
from services.validator.flood import FloodGate
from services.validator.output_pipeline import OutputPipeline, OutputResult, PipelineConfig
from services.validator.plugins import OutputContext
from services.validator.quarantine import Quarantine, QuarantineConfig
from services.validator.records import QuarantineRecord
from shared.errors import InvalidInput


class ValidatorCore:
    def __init__(self, checker: InputChecker, pipeline: OutputPipeline, quarantine: Quarantine,
                 gate: FloodGate):
        self.checker = checker
        self.pipeline = pipeline
        self.quarantine = quarantine
        self.gate = gate

    @classmethod
    def build(cls, contracts_dir: Path, pipeline_cfg: PipelineConfig,
              quarantine_cfg: QuarantineConfig, cpu_budget_s: float | None = None,
              on_drop: Callable[[str], None] = lambda why: None) -> ValidatorCore:
        """Compile contracts and import plugins once; low-confidence and blocked outputs go to
        the quarantine's review stream. ``cpu_budget_s`` bounds one input check; ``on_drop(why)``
        counts each input record the flood gate does not store."""
        quarantine = Quarantine(quarantine_cfg)
        q = quarantine_cfg
        gate = FloodGate(dedup_window_s=q.dedup_window_s, max_per_source=q.max_per_source,
                         source_window_s=q.source_window_s, max_tracked=q.max_tracked, on_drop=on_drop)
        return cls(InputChecker.from_config(contracts_dir, pipeline_cfg.domains, cpu_budget_s),
                   OutputPipeline.from_config(pipeline_cfg, review=quarantine.put), quarantine, gate)

    def start(self) -> None:
        self.quarantine.start()

    def close(self) -> None:
        self.quarantine.close()

    def validate_input(self, payload_json: str, *, source: str, domain: str,
                       trace_id: str) -> tuple[list[str], str]:
        """(flags, quarantine record_id or "") for an accepted input; InvalidInput otherwise."""
        payload, verdict = self.checker.check_json(payload_json, source=source, domain=domain)
        record_id, dropped = "", ""
        if verdict.needs_quarantine:
            record_id, dropped = self._quarantine_input(payload, verdict, trace_id, source)
        if not verdict.accepted:
            error = verdict.error()
            error.metadata["quarantine_id"] = record_id
            if dropped:
                error.metadata["quarantine_dropped"] = dropped
            raise error
        return list(verdict.flags), record_id

    def _quarantine_input(self, payload, verdict: InputVerdict, trace_id: str, source: str
                          ) -> tuple[str, str]:
        """(record_id, "") when stored; (earlier record_id, "duplicate") or ("", "source_cap")
        when the flood gate dropped it."""
        record = QuarantineRecord.for_input(payload, verdict, trace_id=trace_id, source=source,
                                            max_payload_bytes=self.quarantine.cfg.max_payload_bytes)
        drop = self.gate.admit(record)
        if drop is not None:
            return drop.earlier_id, drop.why
        return self.quarantine.put(record), ""

    def quarantine_rejected(self, payload_json: str, *, source: str, domain: str, trace_id: str,
                            reason: str, message: str) -> None:
        """Record an input another stage (the gateway's limits) already rejected, then re-raise
        that rejection: every rejected input ends up in the quarantine, whoever rejected it."""
        try:
            payload = json.loads(payload_json)
        except ValueError:
            payload = {"$raw": payload_json}
        verdict = InputVerdict(accepted=False, rule="gateway_limits", reason=reason, message=message, domain=domain)
        record_id, dropped = self._quarantine_input(payload, verdict, trace_id, source)
        meta = {"rule": "gateway_limits", "quarantine_id": record_id}
        if dropped:
            meta["quarantine_dropped"] = dropped
        raise InvalidInput(message, reason=reason, metadata=meta)

    def validate_output(self, text: str, *, domain: str, token_entropies: Sequence[float],
                        prompt: str = "", trace_id: str = "", source: str = "", json_schema: str = "",
                        continuation: bool = False) -> OutputResult:
        return self.pipeline.run(text, OutputContext(domain=domain, trace_id=trace_id,
                                                     token_entropies=token_entropies, prompt=prompt, source=source,
                                                     json_schema=json_schema, continuation=continuation))
