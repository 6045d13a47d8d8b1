"""Round robin with per-endpoint health, re-admission probes and the no-healthy-upstream error."""
from __future__ import annotations

import pytest

from services.gateway.balancer import RoundRobinBalancer
from shared.errors import DeadlineExpired, InvalidInput, NotReady, Overloaded

EPS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def balancer(clock, endpoints=EPS, readmit=5.0):
    return RoundRobinBalancer("tokenizer", endpoints, readmit_after_s=readmit, clock=clock)


def test_round_robin_cycles_in_order(clock):
    b = balancer(clock)
    assert [b.pick() for _ in range(7)] == EPS * 2 + EPS[:1]


def test_down_endpoint_is_skipped_and_comes_back_on_mark_up(clock):
    b = balancer(clock)
    assert b.mark_down(EPS[1])
    assert [b.pick() for _ in range(4)] == [EPS[0], EPS[2], EPS[0], EPS[2]]
    assert b.healthy() == (EPS[0], EPS[2])
    assert b.mark_up(EPS[1])
    assert {b.pick() for _ in range(3)} == set(EPS)


def test_no_healthy_upstream_is_a_clear_not_ready_with_a_hint(clock):
    b = balancer(clock, readmit=5.0)
    b.mark_down(EPS[0])
    clock.advance(2.0)
    b.mark_down(EPS[1])
    b.mark_down(EPS[2])
    with pytest.raises(NotReady) as info:
        b.pick()
    err = info.value
    assert err.reason == "NO_HEALTHY_UPSTREAM" and err.code == "UNAVAILABLE"
    assert err.metadata == {"upstream": "tokenizer"}
    assert err.retry_after_ms == 3000  # the first endpoint is re-admitted 5 s after it went down


def test_down_endpoint_is_readmitted_for_one_probe(clock):
    b = balancer(clock, endpoints=EPS[:2], readmit=5.0)
    b.mark_down(EPS[0])
    clock.advance(5.0)
    assert b.pick() == EPS[0]  # the probe
    # Until the probe's outcome is known, the others take the traffic.
    assert [b.pick() for _ in range(3)] == [EPS[1]] * 3
    b.observe_success(EPS[0])
    assert b.healthy() == tuple(EPS[:2])
    assert {b.pick() for _ in range(2)} == set(EPS[:2])


def test_failed_probe_goes_back_down(clock):
    b = balancer(clock, endpoints=EPS[:2], readmit=5.0)
    b.mark_down(EPS[0])
    clock.advance(5.0)
    assert b.pick() == EPS[0]
    assert b.observe_error(EPS[0], NotReady("connection refused"))
    clock.advance(4.9)
    assert b.healthy() == (EPS[1],)


@pytest.mark.parametrize("err,marks", [
    (NotReady("connection refused"), True),
    (NotReady("draining", reason="DRAINING"), True),
    (NotReady("none", reason="NO_HEALTHY_UPSTREAM"), False),
    (Overloaded("full", retry_after_ms=10), False),
    (DeadlineExpired("slow"), False),
    (InvalidInput("bad"), False),
])
def test_only_unavailable_from_the_endpoint_marks_it_down(clock, err, marks):
    b = balancer(clock)
    assert b.observe_error(EPS[0], err) is marks
    assert (EPS[0] in b.healthy()) is not marks


def test_unknown_endpoints_are_ignored(clock):
    b = balancer(clock)
    assert not b.mark_down("10.9.9.9:1") and not b.mark_up("10.9.9.9:1")
    assert b.healthy() == tuple(EPS)


def test_duplicate_endpoints_count_once(clock):
    b = balancer(clock, endpoints=[EPS[1], EPS[2], EPS[2]])
    assert b.endpoints == (EPS[1], EPS[2])


def test_an_empty_endpoint_is_rejected(clock):
    with pytest.raises(ValueError):
        balancer(clock, endpoints=[EPS[1], ""])


def test_endpoints_replaced_keep_their_state_and_none_is_not_ready(clock):
    b = balancer(clock, endpoints=[])
    with pytest.raises(NotReady) as none:
        b.pick()
    assert none.value.reason == "NO_HEALTHY_UPSTREAM" and none.value.retry_after_ms is None
    b.set_endpoints([EPS[0], EPS[1]])
    b.mark_down(EPS[0])
    b.set_endpoints([EPS[0], EPS[2]])                   # a pod went, another came
    assert b.endpoints == (EPS[0], EPS[2]) and b.healthy() == (EPS[2],)


def test_nonpositive_readmit_is_rejected(clock):
    with pytest.raises(ValueError):
        balancer(clock, readmit=0)
