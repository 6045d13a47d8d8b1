"""The supervisor's restart backoff: a crash loop slows down, a one-off death is back at once."""
from __future__ import annotations

from keelctl.layout import RestartPolicy
from keelctl.supervisor import next_backoff

POLICY = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=5.0, stable_after_s=30.0)


def test_a_first_death_waits_the_initial_backoff():
    assert next_backoff(POLICY, 0.0, lived_s=0.5) == 0.2


def test_a_crash_loop_doubles_up_to_the_cap():
    waits, b = [], 0.0
    for _ in range(8):
        b = next_backoff(POLICY, b, lived_s=1.0)
        waits.append(b)
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_a_death_after_a_stable_run_starts_over():
    assert next_backoff(POLICY, 5.0, lived_s=30.0) == 0.2
    assert next_backoff(POLICY, 5.0, lived_s=29.9) == 5.0
