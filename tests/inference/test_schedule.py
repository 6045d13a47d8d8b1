"""The scheduler's plans: pure bookkeeping over queued, pending and running requests (no model)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from services.inference.engine.admission import Admission, QueueLimits, Ticket
from services.inference.engine.breaker import Policy
from services.inference.engine.memory import MemoryModel
from services.inference.engine.schedule import Row, Scheduler, batch_cap
from services.inference.engine.stats import Pace
from tests.inference.helpers import prompt, request

POLICY = Policy(level=0, temperature_cap=None, logit_clamp=None, max_batch_size=None, use_fallback=False,
                reject=False, retry_after_ms=0)


def scheduler(prefill_tokens: int = 100, budget: int = 10**9) -> Scheduler:
    memory = MemoryModel(static_bytes=0, fixed_bytes=0, activation_bytes_per_token=0, decode_bytes_per_token=1,
                         kv_bytes_per_token=1)
    return Scheduler(Admission(memory, budget, QueueLimits(64, 10**6, 30_000), budget), prefill_tokens)


def ticket(rid: str, prompt_len: int, max_tokens: int = 10) -> Ticket:
    req = request(rid, prompt(0, prompt_len), max_tokens=max_tokens)
    return Ticket(req, 0, prompt_len + max_tokens, loop=None, events=None)  # never delivered to here


def test_newcomers_prefill_in_fifo_order_within_the_token_budget_and_the_first_always_goes():
    s = scheduler(prefill_tokens=100)
    big, a, b, c = ticket("big", 150), ticket("a", 40), ticket("b", 40), ticket("c", 40)
    for t in (big, a, b, c):
        s.submit(t, cap=16, retry_after_ms=50, pace=Pace(), now=0.0)
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["big"]  # over budget, but first
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["a", "b"]
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["c"]


def test_requests_beyond_the_cap_or_the_budget_wait_in_the_queue():
    s = scheduler(budget=100)
    first, second, third = ticket("1", 30, 20), ticket("2", 30, 20), ticket("3", 10, 5)
    for t in (first, second, third):
        s.submit(t, cap=16, retry_after_ms=50, pace=Pace(), now=0.0)
    assert len(s.admission.queue) == 1  # 50 + 50 bytes fill the budget; strict FIFO keeps "3" behind
    s.cancel(first)
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["2", "3"]


def test_a_plan_splits_running_rows_by_runner_into_batches_within_the_cap():
    s = scheduler()
    rows = [Row(ticket(f"r{i}", 6), "primary" if i % 3 else "fallback", SimpleNamespace(length=0), 0.0, 0,
                chunk_tokens=4) for i in range(9)]
    rows[4].prefilled = rows[4].cache.length = 6  # prompt done, decoding from its last sampled token
    rows[4].last_token = 77
    rows[4].cache.length = 7
    plan = s.schedule(POLICY, 4)
    batches = plan.batches(rows)
    assert [(b.runner, len(b.rows)) for b in batches] == [("fallback", 3), ("primary", 4), ("primary", 2)]
    assert sorted(r.ticket.req.request_id for b in batches for r in b.rows) == sorted(f"r{i}" for i in range(9))
    # the plan says what each row runs: a prompt chunk from position 0, or one token after the cache
    work = {w.row.ticket.req.request_id: w for b in batches for w in b.work}
    assert (work["r0"].start, work["r0"].tokens, work["r0"].prefill) == (0, tuple(prompt(0, 6)[:4]), True)
    assert (work["r4"].start, work["r4"].tokens, work["r4"].prefill) == (7, (77,), False)


def test_batch_cap_is_the_lowest_of_config_breaker_and_oom():
    assert batch_cap(16, POLICY, 16) == 16
    assert batch_cap(16, POLICY, 4) == 4
    degraded = Policy(2, None, None, 2, False, False, 0)
    assert batch_cap(16, degraded, 8) == 2


def shared_ticket(rid: str, ids: list[int], slot: int = 0) -> Ticket:
    return Ticket(request(rid, ids, max_tokens=4), 0, len(ids) + 4, loop=None, events=None, slot=slot)


def test_a_newcomer_waits_for_the_prompt_blocks_a_running_row_computes_then_goes():
    s = scheduler(prefill_tokens=8)
    s.share_prefixes = True
    same = prompt(3, 20)  # two whole blocks of 8 can be found cached, the last 4 tokens are computed
    leader, follower = shared_ticket("leader", same), shared_ticket("follower", same)
    other = shared_ticket("other", prompt(9, 20))
    for t in (leader, follower, other):
        s.submit(t, cap=16, retry_after_ms=50, pace=Pace(), now=0.0)
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["leader"]  # the budget: one chunk
    row = Row(leader, "primary", SimpleNamespace(length=0), 0.0, 0, chunk_tokens=8)
    s.add(row)
    row.prefilled = 8
    assert s.schedule(POLICY, 16).admitted == ()  # held, and FIFO holds "other" behind it
    row.prefilled = 16
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["follower"]
    assert [t.req.request_id for t in s.schedule(POLICY, 16).admitted] == ["other"]


def test_no_hold_without_a_shared_block_a_prefix_cache_or_for_a_scoring_request():
    s = scheduler(prefill_tokens=8)
    row = Row(shared_ticket("leader", prompt(3, 20)), "primary", SimpleNamespace(length=0), 0.0, 0, chunk_tokens=8)
    s.add(row)
    s.submit(shared_ticket("same", prompt(3, 20)), cap=16, retry_after_ms=50, pace=Pace(), now=0.0)
    assert len(s.schedule(POLICY, 16).admitted) == 1  # no prefix cache: nothing to wait for
    s.share_prefixes = True
    for t in (shared_ticket("short", prompt(3, 8)), shared_ticket("adapter", prompt(3, 20), slot=1)):
        s.submit(t, cap=16, retry_after_ms=50, pace=Pace(), now=0.0)
        assert len(s.schedule(POLICY, 16).admitted) == 1  # < one whole block before its last token; another slot
    scoring = shared_ticket("scores", prompt(3, 20))
    scoring.req = replace(scoring.req, controls=replace(scoring.req.controls, prompt_logprobs=0))
    s.submit(scoring, cap=16, retry_after_ms=50, pace=Pace(), now=0.0)
    assert len(s.schedule(POLICY, 16).admitted) == 1
