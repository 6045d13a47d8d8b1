"""The inference engine: warmup, admission, continuous batching, streaming, breakers, drain.

Usage (the servicer owns the process; this module never imports grpc):

    engine = Engine(load_model("var/model", cfg.format), cfg)
    engine.warmup()                     # blocking: forward passes + memory model
    await engine.start()                # starts the batching thread
    async for item in engine.generate(req):   # TokenEvent ... then Finished
        ...
    await engine.stop(grace_s=10)
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from services.inference.engine.admission import Admission, QueueLimits, Ticket, deadline_refusal
from services.inference.engine.api import Finished, GenerationRequest, TokenEvent, validate
from services.inference.engine.breaker import BreakerBoard, BreakerConfig
from services.inference.engine.cachewatch import CacheWatch
from services.inference.engine.controls import RowControls
from services.inference.engine.executor import BatchExecutor
from services.inference.engine.grammar import GrammarLimits, Grammars, MaskExecutor, Vocabulary
from services.inference.engine.loop import LoopSettings, StepLoop
from services.inference.engine.memory import MemoryModel
from services.inference.engine.oom import OomPolicy
from services.inference.engine.output import OutputProcessor
from services.inference.engine.prefix import PrefixCache
from services.inference.engine.schedule import Scheduler, batch_cap
from services.inference.engine.stats import Counters, EngineState, EngineStats
from services.inference.engine.torchthread import TorchThread
from services.inference.engine.variants import PRIMARY, Switch
from services.inference.engine.warmup import Calibration, build_runners, measure_memory, set_deterministic
from services.inference.lora.registry import AdapterTable
from services.inference.model.forward import LlamaRunner
from services.inference.model.loader import check_format
from shared.controls import Controls
from shared.errors import DeadlineExpired, InvalidInput, NotReady, PreconditionFailed

# Bump when a change to the engine makes calibrations stored by an older version invalid (warmcache.py).
# 2: runners (and their batch-invariant sizes) are keyed by weight format, no longer "primary"/"fallback".
# 3: the KV cache is a block pool; the memory model charges caches in whole blocks.
ENGINE_VERSION = 3
# The reason a request gets from an engine that is not serving (else WARMING_UP).
NOT_SERVING_REASONS = {EngineState.DRAINING: "DRAINING", EngineState.STOPPED: "SHUTTING_DOWN"}

__all__ = ["Engine", "EngineConfig", "BreakerConfig", "GenerationRequest", "TokenEvent", "Finished"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    memory_budget_bytes: int
    max_queued_requests: int = 64
    max_queued_tokens: int = 131072
    queue_timeout_ms: int = 30_000
    max_batch_size: int = 16
    # None: the model's trained context (its config's max_position_embeddings); a value lowers it
    max_context_tokens: int | None = None
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # The ids that end a generation; None: the model config's eos_token_id. The stage passes the
    # model's own set (shared/modelcard.py: end of sequence, of turn, of message).
    eos_token_ids: tuple[int, ...] | None = None
    format: str = "float32"  # the weight format (model/loader.py FORMATS), or "auto" before the stage resolves it
    device: str = "cpu"
    warmup_prompt_tokens: tuple[int, ...] = (16, 64, 256)  # memory-model measurements (prompt lengths)
    warmup_max_tokens: int = 256                            # one measurement with a long reserved completion
    # prefill chunk size; also newcomers' first-chunk tokens per step
    prefill_tokens_per_iteration: int = 2048
    oom_backoff_steps: int = 50               # successful steps before an OOM-halved batch cap doubles
    memory_audit: bool = False                # measure every step's peak against the memory model (slow)
    batch_invariant: bool = True              # pad decode batches to GEMM-invariant sizes (costs at batch 1-3)
    intra_op_threads: int | None = None       # torch.set_num_threads at warmup (process-wide); None: torch's
    prefix_cache_bytes: int = 0               # budget share kept for the prefix cache (0: no prefix cache)
    kv_block_tokens: int = 16                 # positions per KV cache block (kvpool.py)
    # Model variants preloaded at warm-up besides "primary" (this format): name -> weight format (variants.py).
    variants: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        """The rules between fields. Each field's own bounds are config/schemas/inference.schema.json's
        (checked when the stage loads its config), not restated here."""
        check_format(self.format, self.device, allow_auto=True)  # the stage resolves "auto" (formats/selection.py)
        for format in self.other_formats():
            check_format(format, self.device)
        if self.prefix_cache_bytes >= self.memory_budget_bytes:
            raise InvalidInput("EngineConfig.prefix_cache_bytes must be below memory_budget_bytes",
                               reason="INVALID_CONFIG", metadata={"field": "prefix_cache_bytes"})
        if self.prefix_cache_bytes and self.prefill_tokens_per_iteration % self.kv_block_tokens:
            raise InvalidInput("EngineConfig.prefill_tokens_per_iteration must be a multiple of kv_block_tokens "
                               "when the prefix cache is on (a cached prompt block is whole KV blocks)",
                               reason="INVALID_CONFIG", metadata={"field": "prefill_tokens_per_iteration"})

    def other_formats(self) -> tuple[str, ...]:
        """The weight formats the variants and the breaker's fallback run on (the primary's may be among them)."""
        fallback = (self.breaker.fallback_format,) if self.breaker.fallback_format else ()
        return tuple(dict.fromkeys((*self.variants.values(), *fallback)))


def for_model(config: EngineConfig, model: torch.nn.Module) -> EngineConfig:
    """`config` with the model's own context and end-of-generation ids where it leaves them unset;
    INVALID_CONFIG when it asks for more context than the model was trained for."""
    trained = model.config.max_position_embeddings
    if config.max_context_tokens is not None and config.max_context_tokens > trained:
        raise InvalidInput(f"engine.max_context_tokens {config.max_context_tokens} is above the model's trained "
                           f"context ({trained})", reason="INVALID_CONFIG", metadata={"field": "max_context_tokens"})
    eos = config.eos_token_ids
    if eos is None:
        eos = () if model.config.eos_token_id is None else (model.config.eos_token_id,)
    return replace(config, max_context_tokens=config.max_context_tokens or trained, eos_token_ids=tuple(eos))


class Engine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig,
                 clock: Callable[[], float] = time.monotonic,
                 others: Mapping[str, torch.nn.Module] = MappingProxyType({}), locked: Iterable[str] = ()):
        """`others`: models of other formats the variants or the breaker need, already loaded (a quantized
        model cannot be converted to another format, so the caller loads those from the weight files);
        a format missing there is converted from `model` at warm-up. `locked`: variants SetVariant
        refuses until `unlock_variant` (candidates whose quality gate has not passed yet)."""
        if model.format != config.format:
            raise InvalidInput(f"model is {model.format} but config.format is {config.format}",
                               reason="FORMAT_MISMATCH")
        config = for_model(config, model)
        self.model = model
        self.others = others
        self.config = config
        # name -> weight format of every variant this engine serves; fixed for its lifetime
        self.variants: Mapping[str, str] = MappingProxyType({PRIMARY: config.format, **config.variants})
        self._locked = set(locked) & set(config.variants)
        self.board = BreakerBoard(config.breaker, config.max_batch_size, clock)
        self.memory: MemoryModel | None = None
        self.calibration: Calibration | None = None
        self._loop: StepLoop | None = None
        self._runners: dict[str, LlamaRunner] = {}
        self.adapters = AdapterTable()  # LoRA adapters (install_adapters); resolved at submit
        self.vocabulary: Vocabulary | None = None  # token bytes for stop strings, logprobs and grammars
        self._grammars: Grammars | None = None
        self._tickets: dict[str, Ticket] = {}
        self._state = EngineState.CREATED
        # This engine's run: a WatchCache client that sees another knows the replica restarted, cache empty.
        self.instance_id = uuid.uuid4().hex

    def warmup(self, calibration: Calibration | None = None) -> None:
        """Measure the engine on this host (batch-invariant sizes, memory model, tokens/s), kept as
        `self.calibration`; or reuse `calibration`, measured earlier by an identical engine."""
        cfg = self.config
        if cfg.intra_op_threads is not None:
            torch.set_num_threads(cfg.intra_op_threads)
        set_deterministic(cfg.device)
        runners = build_runners(self.model, self.others, cfg.other_formats(), cfg.device, cfg.max_batch_size,
                                cfg.batch_invariant and calibration is None, cfg.kv_block_tokens)
        if calibration is None:
            lengths = tuple(min(p, cfg.max_context_tokens - 1) for p in cfg.warmup_prompt_tokens)
            long_m = min(cfg.warmup_max_tokens, cfg.max_context_tokens - min(lengths))
            memory, tokens_per_s = measure_memory(runners, lengths, max(1, long_m), cfg.device)
            calibration = Calibration(memory, {k: r.invariant_sizes for k, r in runners.items()}, tokens_per_s)
        for name, runner in runners.items():
            runner.invariant_sizes = calibration.invariant_sizes.get(name, ())
        self.calibration = calibration
        self.memory, tokens_per_s = calibration.memory, calibration.tokens_per_s
        if self.memory.max_total_tokens(cfg.memory_budget_bytes - cfg.prefix_cache_bytes) < 2:
            raise InvalidInput(
                f"memory budget {cfg.memory_budget_bytes} B leaves no room beyond the model "
                f"({self.memory.static_bytes} B static)", reason="BUDGET_TOO_SMALL",
                metadata={"static_bytes": self.memory.static_bytes})
        # Every runner's pool gets as many blocks as the budget could lend at once; admission reserves
        # them per request across all pools together, so none of them can run out. The prefix cache's
        # room comes on top: blocks it holds are never counted against a reservation (prefix.py).
        pool_blocks = self.memory.pool_blocks(cfg.memory_budget_bytes - cfg.prefix_cache_bytes)
        for runner in runners.values():
            runner.resize_pool(pool_blocks + cfg.prefix_cache_bytes // runner.block_bytes)
        limits = QueueLimits(cfg.max_queued_requests, cfg.max_queued_tokens, cfg.queue_timeout_ms)
        self._admission = Admission(self.memory, cfg.memory_budget_bytes, limits, pool_blocks, cfg.prefix_cache_bytes)
        self._vocab_size = runners[cfg.format].vocab_size
        self._runners = runners
        executor = BatchExecutor(runners)
        counters = Counters()
        prefix = None
        if cfg.prefix_cache_bytes:  # blocks are prefill chunks: see prefix.py
            prefix = PrefixCache(cfg.prefill_tokens_per_iteration, cfg.prefix_cache_bytes)
        output = OutputProcessor(cfg.eos_token_ids, counters, self.board,
                                 {name: r.format for name, r in runners.items()},
                                 MaskExecutor(torch.get_num_threads()))
        scheduler = Scheduler(self._admission, cfg.prefill_tokens_per_iteration, share_prefixes=prefix is not None)
        self._loop = StepLoop(executor, scheduler, output,
                              self.board, OomPolicy(cfg.max_batch_size, cfg.oom_backoff_steps), counters,
                              self.memory, LoopSettings(cfg.max_batch_size, cfg.memory_audit, cfg.device,
                                                        self.variants, cfg.breaker.fallback_format),
                              tokens_per_s, prefix)
        self._state = EngineState.WARM

    @property
    def primary_runner(self) -> LlamaRunner:
        """The warmed, calibrated runner of the served format (adapters are checked on it before start)."""
        return self._runners[self.config.format]

    def install_adapters(self, table: AdapterTable) -> None:
        """Serve the accepted adapters of `table` from their slots (call after warmup, before start).

        The slots' stacks are resident for the process's life, so they join the memory model's static
        bytes; one chunk of gathered stacks is the LoRA term's largest temporary, added to fixed_bytes."""
        if self._state != EngineState.WARM:
            raise NotReady("adapters are installed between warmup() and start()", reason="WARMING_UP",
                           retry_after_ms=1000)
        for runner in self._runners.values():
            runner.lora = table.slots
        self.adapters = table
        if table.slots is not None:
            m = self.memory
            self.memory = dataclasses.replace(m, static_bytes=m.static_bytes + table.slots.nbytes,
                                              fixed_bytes=m.fixed_bytes + table.slots.transient_bytes)
            self._loop.set_memory(self.memory)

    def install_vocabulary(self, vocab: Vocabulary, limits: GrammarLimits = GrammarLimits()) -> None:
        """Serve stop strings, logprobs' token text and response formats over `vocab` (before start)."""
        if vocab.size > self._vocab_size:
            raise InvalidInput(f"the vocabulary has {vocab.size} tokens, the model {self._vocab_size}",
                               reason="INVALID_CONFIG", metadata={"field": "vocabulary"})
        self.vocabulary = vocab
        self._grammars = Grammars(vocab, limits)

    async def start(self, thread: TorchThread | None = None) -> None:
        """Start the batching loop, on `thread` when the caller keeps all torch work on one."""
        if self._state != EngineState.WARM:
            raise NotReady(f"engine cannot start from state {self._state} (call warmup() first)",
                           reason="WARMING_UP", retry_after_ms=1000)
        self._loop.start(thread)
        self._state = EngineState.SERVING

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent | Finished]:
        self._check_serving()
        validate(req, self._vocab_size, self.config.max_context_tokens)  # once, before a grammar is compiled
        matcher = None
        if req.controls.response_format is not None:  # compiled off the step loop (grammar.py)
            matcher = await self._require_vocabulary().matcher(req.controls.response_format)
        ticket = self._submit(req, matcher)
        done = False
        try:
            while True:
                item = await ticket.events.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, Finished):
                    done = True
                yield item
                if done:
                    return
        finally:
            self._tickets.pop(req.request_id, None)
            if not done:
                self._loop.cancel(ticket)

    async def set_variant(self, name: str, actor: str) -> Switch:
        """Make `name` serve new requests (requests already running keep theirs). Idempotent."""
        if name not in self.variants:
            raise InvalidInput(f"unknown variant {name[:64]!r}; this replica has {', '.join(self.variants)}",
                               reason="UNKNOWN_VARIANT", metadata={"variant": name[:64],
                                                                   "variants": ",".join(self.variants)})
        if name in self._locked:
            raise PreconditionFailed(f"variant {name!r} ({self.variants[name]}) has not passed its quality gate yet",
                                     reason="VARIANT_NOT_GATED", metadata={"variant": name})
        self._check_serving()
        done: Future = Future()
        self._loop.set_variant(name, actor, done)
        return await asyncio.wrap_future(done)

    def unlock_variant(self, name: str) -> None:
        """Let SetVariant select `name` (its format passed the quality gate)."""
        self._locked.discard(name)

    def locked_variants(self) -> frozenset[str]:
        """The variants SetVariant refuses until they are unlocked."""
        return frozenset(self._locked)

    def active_variant(self) -> str:
        return self._loop.stats().active_variant if self._loop is not None else PRIMARY

    def report_failure(self, kind: str, cause: str = "") -> None:
        """Count a failure observed outside the engine (e.g. 'output_limit' from the validator)."""
        self.board.record(kind, cause)

    def watch_cache(self, capacity: int) -> CacheWatch:
        """The prefix cache's changes, for one WatchCache stream (after warmup); its first take is every
        key held."""
        watch = CacheWatch(capacity, asyncio.get_running_loop())
        self._loop.watch_cache(watch)
        return watch

    def stats(self) -> EngineStats:
        """The step loop's latest snapshot, with the engine's state and the breakers as of now."""
        base = self._loop.stats() if self._loop is not None else EngineStats()
        policy = self.board.policy()
        cap = batch_cap(self.config.max_batch_size, policy, base.oom_cap) if self._loop is not None else 0
        return dataclasses.replace(base, state=self._state, breaker=self.board.snapshot(),
                                   breaker_level=policy.level, batch_cap=cap)

    async def stop(self, grace_s: float) -> None:
        """Refuse new work, let in-flight requests finish for up to grace_s, then fail the rest."""
        if self._state != EngineState.SERVING:
            self._state = EngineState.STOPPED
            return
        self._state = EngineState.DRAINING
        end = time.monotonic() + max(0.0, grace_s)
        while self._tickets and time.monotonic() < end:  # requests whose consumer has not seen their end
            await asyncio.sleep(0.02)
        err = NotReady("inference engine shut down before the request finished", reason="SHUTTING_DOWN",
                       retry_after_ms=1000)
        await asyncio.get_running_loop().run_in_executor(None, self._loop.shutdown, err)
        if self._grammars is not None:
            self._grammars.close()
        self._state = EngineState.STOPPED

    def _check_serving(self) -> None:
        if self._state != EngineState.SERVING:
            reason = NOT_SERVING_REASONS.get(self._state, "WARMING_UP")
            raise NotReady(f"inference engine is {self._state}", reason=reason, retry_after_ms=1000)

    def _refuse_if_queue_full(self, ticket: Ticket) -> None:
        """Refuse now a request that could only join a queue already at its limits, rather than after
        the loop's current step (seconds, for a long prefill). Judged on the loop's last published
        state, which is published before and after each step: while requests wait a newcomer cannot
        overtake them, and only the loop's next iteration takes any out (bar the moments of its own
        drain, when the state it publishes next may already have room). A queue that was empty is
        left to the loop, which may admit the request at once."""
        stats = self._loop.stats()
        if stats.queue_depth and (err := self._admission.queue_full(
                stats.queue_depth, stats.queued_tokens, ticket, stats.retry_after_ms)):
            self._loop.refused(err)
            raise err

    def _refuse_if_deadline_unreachable(self, ticket: Ticket) -> None:
        """Refuse now a request that cannot finish within its deadline (admission.deadline_refusal),
        judged on the loop's last published state, rather than after the loop's current step; the
        loop judges it again on its exact state when it takes the request in. One that would have
        to queue (``ahead_tokens``) behind a full queue is left to the loop: QUEUE_FULL comes first."""
        stats = self._loop.stats()
        if stats.ahead_tokens and self._admission.queue_full(stats.queue_depth, stats.queued_tokens, ticket, 0):
            return
        req = ticket.req
        remaining = None if req.deadline is None else req.deadline - time.monotonic()
        if err := deadline_refusal(remaining, req.max_tokens, stats.ahead_tokens,
                                   stats.running_batch_size + stats.pending_prefill, stats.pace):
            log.info("request refused", extra={"reason": err.reason, "request_id": req.request_id,
                                               "detail": err.metadata})
            self._loop.refused(err)
            raise err

    def _require_vocabulary(self) -> Grammars:
        if self._grammars is None:
            raise PreconditionFailed("this engine has no vocabulary for stop strings or response formats",
                                     reason="VOCABULARY_NOT_LOADED")
        return self._grammars

    def _submit(self, req: GenerationRequest, matcher=None) -> Ticket:
        """Admit a request generate() has validated."""
        self._check_serving()  # again: the engine may have begun draining while a grammar compiled
        if req.request_id in self._tickets:
            raise InvalidInput(f"request {req.request_id} is already in flight", reason="DUPLICATE_REQUEST_ID",
                               metadata={"request_id": req.request_id})
        if req.deadline is not None and time.monotonic() >= req.deadline:
            raise DeadlineExpired("deadline already passed", reason="DEADLINE_EXPIRED",
                                  metadata={"request_id": req.request_id})
        policy = self.board.policy()
        if policy.reject:
            raise NotReady("circuit breaker open", reason="CIRCUIT_OPEN", retry_after_ms=policy.retry_after_ms,
                           metadata={"level": policy.level})
        slot, adapter = self.adapters.resolve(req.adapter)  # unknown or refused: an error, never the base
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        self._admission.check_fits_ever(req)  # the memory model is fixed after warmup: safe on any thread
        if req.controls.stop:
            self._require_vocabulary()
        controls = None if req.controls == Controls() else RowControls(
            req.controls, req.prompt_ids, self.vocabulary, matcher,
            end_ids=(() if req.controls.ignore_eos else self.config.eos_token_ids) + tuple(req.stop_token_ids))
        ticket = Ticket(req, seed, self._admission.cost(req), asyncio.get_running_loop(), asyncio.Queue(),
                        slot=slot, adapter=adapter, blocks=self._admission.blocks(req), controls=controls)
        self._refuse_if_queue_full(ticket)
        self._refuse_if_deadline_unreachable(ticket)
        self._loop.submit(ticket)
        self._tickets[req.request_id] = ticket
        return ticket

