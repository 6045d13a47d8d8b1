"""Assembles the inference stage: pick the weight format, load the model, warm the engine up (which
measures the memory model and calibrates batch sizes, or reuses what an identical engine measured;
bootstrap.py), then serve. Ready = the engine's batching loop is running.
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc

from keel.inference.v1 import inference_pb2_grpc
from services.inference import config as inf_config
from services.inference import warmcache
from services.inference.bootstrap import start_engine, trim_heap
from services.inference.engine import grammar
from services.inference.engine.core import ENGINE_VERSION, Engine
from services.inference.engine.grammar import Vocabulary
from services.inference.engine.torchthread import TorchThread
from services.inference.formats import gateprompts, selection
from services.inference.formats.background import BackgroundGate
from services.inference.formats.startgate import GateJob
from services.inference.model import modelcache
from services.inference.model.digest import model_sha256
from services.inference.model.llama import ARCHITECTURES
from services.inference.model.loader import AUTO, check_format
from services.inference.servicer import InferenceServicer
from shared import metrics, modelcard, modelfile
from shared.config import ConfigError, ServerConfig
from shared.errors import InvalidInput
from shared.stages import SERVICE_NAMES

log = logging.getLogger("keel.inference")


class InferenceStage:
    name = "inference"
    service_name = SERVICE_NAMES["inference"]

    def __init__(self, cfg: inf_config.InferenceConfig, model_sha: str, card: modelcard.ModelCard):
        self.cfg = cfg
        self.card = card  # the served model's facts (shared/modelcard.py)
        self.model_sha = model_sha  # sha256 of the weights: keys the gate results and the warm-start record
        self.m = metrics.metrics_for("inference")
        self.engine: Engine | None = None
        self._gauges: asyncio.Task | None = None
        self._gate: BackgroundGate | None = None  # auto's candidates still to gate, once serving
        self._gating: asyncio.Task | None = None
        self.torch = TorchThread()  # every torch call of this process runs here (torchthread.py says why)

    def register(self, server: grpc.aio.Server) -> None:
        # No engine/core yet: the port listens during warm-up so health answers NOT_SERVING, and the
        # interceptor's is_ready gate refuses every call before it reaches the servicer (one place).
        self.servicer = InferenceServicer(None, self.m)
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)

    async def warmup(self) -> None:
        started = await self.torch.run(start_engine, self.cfg, self.model_sha)
        engine = started.engine
        engine.install_vocabulary(await asyncio.to_thread(
            Vocabulary, self.cfg.model_dir / "hf-tokenizer" / "tokenizer.json", self.cfg.engine.eos_token_ids))
        trim_heap()  # the start-up's temporary buffers, the vocabulary's parse included, go back to the OS
        # read on the torch thread (its thread count) before the batching loop takes it over
        served = {*engine.variants.values(), *engine.config.other_formats()}
        facts = await self.torch.run(lambda: {format: warmcache.serving_facts(self.model_sha, format, ENGINE_VERSION)
                                              for format in served})
        self.servicer.facts = {format: {**f, "grammar": grammar.version()} for format, f in facts.items()}
        if started.candidates:
            e = self.cfg.engine
            threads = int(facts[started.record.format]["threads"])  # the candidates are timed as the engine runs
            self._gate = BackgroundGate(GateJob(str(self.cfg.model_dir), self.model_sha,
                                                tuple(started.candidates.values()), self.cfg.formats, e.device,
                                                threads, e.max_batch_size), engine, started.candidates)
        await engine.start(self.torch)
        log.info("engine warm", extra={"memory_model": engine.memory.as_dict(), "format": started.record.format,
                                       "format_reason": started.record.reason, "warm_start": started.warm,
                                       "phases_s": started.phases_s})
        self.m.gauge("keel_inference_weight_format").labels(format=started.record.format).set(1)
        card = self.card
        self.m.gauge("keel_inference_model").labels(model=card.source.model_id, architecture=card.architecture,
                                                    digest=card.source.digest[:16]).set(1)
        self._show_variant(engine)
        for s in engine.adapters.states:
            self.m.gauge("keel_inference_adapter_state").labels(adapter=s.id, version=s.version, state=s.state,
                                                                reason=s.reason).set(1)
        self.engine = self.servicer.engine = engine  # until now the interceptor answered UNAVAILABLE
        self._gauges = asyncio.create_task(self._update_gauges())

    def serving(self) -> None:
        """Once the stage serves: gate auto's ungated candidates in the background (background.py)."""
        if self._gate is not None:
            self._gating = asyncio.create_task(self._gate.run())
            self._gating.add_done_callback(_log_failure)

    async def _update_gauges(self) -> None:
        m = self.m
        queue, batch = m.gauge("keel_inference_queue_depth"), m.gauge("keel_inference_running_batch_size")
        predicted = m.gauge("keel_inference_predicted_memory_bytes")
        budget = m.gauge("keel_inference_memory_budget_bytes")
        observed = m.gauge("keel_inference_observed_peak_memory_bytes")
        level, hit_rate = m.gauge("keel_inference_breaker_level"), m.gauge("keel_inference_prefix_cache_hit_rate")
        faults = m.counter("keel_inference_numerical_faults_total")
        ooms = m.counter("keel_inference_oom_recoveries_total")
        looked_up, hits = (m.counter("keel_inference_prefix_cache_prompt_tokens_total"),
                           m.counter("keel_inference_prefix_cache_hit_tokens_total"))
        seen = {"numerical_faults": 0, "oom_recoveries": 0, "prompt_tokens": 0, "hit_tokens": 0}
        while True:
            s = self.engine.stats()
            queue.set(s.queue_depth)
            batch.set(s.running_batch_size)
            predicted.set(s.memory.predicted_bytes)
            budget.set(s.memory.budget_bytes)
            if s.memory.observed_peak_bytes is not None:  # engine.memory_audit
                observed.set(s.memory.observed_peak_bytes)
            hit_rate.set(s.prefix_cache.hit_rate)
            self._show_variant(self.engine)
            for kind, state in s.breaker.items():
                level.labels(error_type=kind).set(state.level)
            for key, counter, source in (("numerical_faults", faults, s.counters), ("oom_recoveries", ooms, s.counters),
                                         ("prompt_tokens", looked_up, s.prefix_cache),
                                         ("hit_tokens", hits, s.prefix_cache)):
                now = getattr(source, key)
                counter.inc(max(0, now - seen[key]))
                seen[key] = now
            await asyncio.sleep(1.0)

    def _show_variant(self, engine: Engine) -> None:
        """keel_inference_active_variant: 1 for the variant new requests start on, 0 for the others."""
        gauge, active = self.m.gauge("keel_inference_active_variant"), engine.active_variant()
        for name in engine.variants:
            gauge.labels(variant=name).set(1 if name == active else 0)

    def begin_drain(self) -> None:
        self.servicer.end_watches()

    async def close(self) -> None:
        if self._gauges:
            self._gauges.cancel()
        if self._gating:
            self._gating.cancel()
            await asyncio.gather(self._gating, return_exceptions=True)  # its child process is stopped
        if self.engine:
            await self.engine.stop(self.cfg.server.drain_grace_s)
        await asyncio.to_thread(self.torch.close)


def with_model(cfg: inf_config.InferenceConfig, card: modelcard.ModelCard) -> inf_config.InferenceConfig:
    """`cfg` serving the model of `card`: its prepared folder (made now on a model's first start) and its
    own end-of-generation ids; ConfigError (exit 2) for a model Keel does not run, before any work."""
    source = card.source
    if card.architecture not in ARCHITECTURES:
        raise ConfigError(f"field 'model.path' breaks rule 'architecture': {source.path.name} is a "
                          f"{card.architecture or 'unnamed'} model; Keel runs {', '.join(ARCHITECTURES)}")
    model_dir = cfg.model_dir if cfg.model_path else _prepared(source)
    log.info("model", extra={"model": card.as_dict(), "prepared": str(model_dir)})
    return replace(cfg, model_path=str(model_dir), engine=replace(cfg.engine, eos_token_ids=card.stop_token_ids))


def _prepared(source: modelfile.ModelSource) -> Path:
    """The model's prepared folder, prepared by a child process when missing (`python -m
    services.inference.model.modelcache`). Preparing a GGUF dequantizes it with torch and converts its
    tokenizer with transformers; done in this process, it ran torch's parallel work on the main thread
    before the torch thread's, and every decode step of the stage's life then ran at about half speed
    (docs/BENCHMARKS.md, a first start on a file), and transformers stayed resident."""
    if not modelcache.is_prepared(source):
        done = subprocess.run([sys.executable, "-m", modelcache.__name__, "--model", str(source.path)],
                              stdout=subprocess.DEVNULL, check=False)  # its errors go to this stage's stderr
        if done.returncode != 0 or not modelcache.is_prepared(source):
            raise ConfigError(f"field 'model.path' breaks rule 'prepared': preparing {source.path} failed "
                              f"(exit {done.returncode}; its error is logged above)")
    return source.cache_dir


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background quality gate failed; serving on", exc_info=task.exception())


def build() -> tuple[InferenceStage, ServerConfig]:
    card = modelcard.read(modelfile.source())
    cfg = with_model(inf_config.load(), card)
    model_sha = model_sha256(cfg.model_dir)
    if cfg.engine.format != AUTO:  # a format refused by its quality gate stops the stage here (exit 2)
        selection.check_explicit(cfg.engine.format, model_sha, cfg.formats)
    elif cfg.formats.gate_at_start:  # so does a corrupted prompt set the gate at start would read
        gateprompts.load(cfg.formats.gate_prompts)
    named = {"engine.format": cfg.engine.format, "engine.breaker.fallback_format": cfg.engine.breaker.fallback_format,
             **{f"engine.variants.{n}": f for n, f in cfg.engine.variants.items()}}
    for field, format in list(named.items())[1:]:  # so does a variant's, or the breaker's fallback
        if format:
            selection.check_explicit(format, model_sha, cfg.formats, field=field)
    for field, format in named.items():  # a format that cannot load this model (a GGUF's block types)
        if format and format != AUTO:
            try:
                check_format(format, cfg.engine.device, model_dir=cfg.model_dir)
            except InvalidInput as exc:
                raise ConfigError(f"field '{field}' breaks rule 'model': {exc}") from exc
    return InferenceStage(cfg, model_sha, card), cfg.server
