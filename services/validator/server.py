"""Assembles the validator stage: contracts, plugins and the Redis quarantine, then serves.

Ready = every contract compiled, every plugin imported, the quarantine's spill file open and its
replay thread running (Redis itself may be down: records spill and are replayed later).
"""
from __future__ import annotations

import asyncio
import logging
import math

import grpc

from keel.validator.v1 import validator_pb2_grpc
from services.validator import config as val_config
from services.validator.core import ValidatorCore
from services.validator.flood import DUPLICATE, SOURCE_CAP
from services.validator.output_pipeline import OutputResult, PipelineConfig
from services.validator.servicer import ValidatorServicer
from shared import metrics
from shared.config import ServerConfig
from shared.stages import SERVICE_NAMES

log = logging.getLogger("keel.validator")
CREDENTIALS_RETRY_S = 2.0


class ValidatorMetrics:
    """Turns each validated output into the validator's Prometheus series."""

    def __init__(self, window_s: float):
        m = metrics.metrics_for("validator")
        self.verdicts = m.counter("keel_validator_verdicts_total")
        self.outputs = m.counter("keel_validator_outputs_total")
        self.empty = m.counter("keel_validator_empty_outputs_total")
        self.length = m.histogram("keel_validator_output_length_tokens")
        self.low = m.counter("keel_validator_low_confidence_total")
        self.quarantine_size = m.gauge("keel_validator_quarantine_size")
        self.backlog = m.gauge("keel_validator_spill_backlog")
        self.dropped = m.counter("keel_validator_quarantine_dropped_total")
        for why in (DUPLICATE, SOURCE_CAP):   # export from 0 so increase() sees the first drop
            self.dropped.labels(why=why)
        self.redis_used = m.gauge("keel_validator_redis_memory_used_bytes")
        self.redis_max = m.gauge("keel_validator_redis_maxmemory_bytes")
        self.empty_rate = metrics.SlidingWindowGauge(m.gauge("keel_validator_empty_response_rate"), window_s)
        self.entropy = metrics.SlidingWindowGauge(m.gauge("keel_validator_output_entropy_mean"), window_s)

    def __call__(self, r: OutputResult, tokens: int) -> None:
        self.outputs.inc()
        is_empty = not r.text.strip()
        self.empty.inc(is_empty)
        self.empty_rate.observe(float(is_empty))
        entropy = float(r.probes.get("entropy_mean", math.nan))
        if tokens and math.isfinite(entropy):
            self.entropy.observe(entropy)
        self.length.observe(tokens)
        self.low.inc(r.low_confidence)
        for v in r.verdicts:
            self.verdicts.labels(plugin=v.plugin, outcome="block" if v.blocking else "annotate").inc()


class ValidatorStage:
    name = "validator"
    service_name = SERVICE_NAMES["validator"]

    def __init__(self, cfg: val_config.ValidatorConfig):
        self.cfg = cfg
        self.metrics = ValidatorMetrics(cfg.metrics_window_s)
        self.core: ValidatorCore | None = None
        self._gauges: asyncio.Task | None = None

    def register(self, server: grpc.aio.Server) -> None:
        # No engine/core yet: the port listens during warm-up so health answers NOT_SERVING, and the
        # interceptor's is_ready gate refuses every call before it reaches the servicer (one place).
        self.servicer = ValidatorServicer(None, self.metrics)
        validator_pb2_grpc.add_ValidatorServicer_to_server(self.servicer, server)

    async def warmup(self) -> None:
        cfg = self.cfg
        pipeline_cfg = await asyncio.to_thread(PipelineConfig.load, cfg.path(cfg.pipeline_file))
        core = await asyncio.to_thread(ValidatorCore.build, cfg.path(cfg.contracts_dir), pipeline_cfg,
                                      cfg.quarantine, cfg.input_cpu_budget_ms / 1000,
                                      lambda why: self.metrics.dropped.labels(why=why).inc())
        await self._until_redis_accepts(core)
        await asyncio.to_thread(core.start)
        self.core = self.servicer.core = core  # until now the interceptor answered UNAVAILABLE
        self._gauges = asyncio.create_task(self._update_gauges())

    async def _until_redis_accepts(self, core: ValidatorCore) -> None:
        """Stay NOT_SERVING while Redis refuses the quarantine's credentials. A wrong or missing
        password is a deployment error, not an outage: serving would send every quarantined
        record to the spill file for good. Checked again every CREDENTIALS_RETRY_S (a Secret
        fixed later is picked up); logged once per distinct refusal, without the password."""
        logged = None
        while (refusal := await asyncio.to_thread(core.quarantine.refused_credentials)) is not None:
            if refusal != logged:
                log.error("Redis refused the quarantine's credentials; not serving until it accepts them",
                          extra={"redis_error": refusal, "config": "quarantine.redis_url "
                                 "(KEEL_VALIDATOR_QUARANTINE__REDIS_URL): redis://:PASSWORD@host:port/db"})
                logged = refusal
            await asyncio.sleep(CREDENTIALS_RETRY_S)

    async def _update_gauges(self) -> None:
        while True:
            self.metrics.backlog.set(self.core.quarantine.backlog())
            size = await asyncio.to_thread(self.core.quarantine.size)
            if size is not None:
                self.metrics.quarantine_size.set(size)
            memory = await asyncio.to_thread(self.core.quarantine.memory)
            if memory is not None:
                self.metrics.redis_used.set(memory[0])
                self.metrics.redis_max.set(memory[1])
            await asyncio.sleep(5)

    async def close(self) -> None:
        if self._gauges:
            self._gauges.cancel()
        if self.core:
            await asyncio.to_thread(self.core.close)


def build() -> tuple[ValidatorStage, ServerConfig]:
    cfg = val_config.load()
    return ValidatorStage(cfg), cfg.server
