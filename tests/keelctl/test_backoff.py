"""The supervisor's restart rule: a child killed while serving is back at once; a child that dies
before it ever served (a start-up failure) slows down; so does one that keeps dying after serving."""
from __future__ import annotations

from keelctl.layout import RestartPolicy
from keelctl.supervisor import next_backoff

POLICY = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=5.0, stable_after_s=30.0, burst=3)


def start_failures(n: int) -> list[float]:
    waits, b = [], 0.0
    for _ in range(n):
        b = next_backoff(POLICY, b, lived_s=1.0, served=False, served_deaths=0)
        waits.append(b)
    return waits


def test_a_first_death_waits_the_initial_backoff():
    assert next_backoff(POLICY, 0.0, lived_s=0.5, served=False, served_deaths=0) == 0.2


def test_a_start_up_crash_loop_doubles_up_to_the_cap():
    assert start_failures(8) == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_a_death_after_a_stable_run_starts_over():
    assert next_backoff(POLICY, 5.0, lived_s=30.0, served=False, served_deaths=0) == 0.2
    assert next_backoff(POLICY, 5.0, lived_s=29.9, served=False, served_deaths=0) == 5.0


def test_a_child_killed_while_serving_is_restarted_at_the_initial_backoff_even_after_a_crash_loop():
    # killed 2 s after it started, its previous wait at the cap: back to the initial wait
    assert next_backoff(POLICY, 5.0, lived_s=2.0, served=True, served_deaths=0) == 0.2
    assert next_backoff(POLICY, 0.2, lived_s=2.0, served=True, served_deaths=2) == 0.2


def test_deaths_after_serving_past_the_burst_double_like_a_crash_loop():
    waits, b = [], 0.0
    for recent in range(8):
        b = next_backoff(POLICY, b, lived_s=1.0, served=True, served_deaths=recent)
        waits.append(b)
    assert waits == [0.2, 0.2, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]


def test_a_burst_of_zero_treats_every_death_as_a_crash_loop():
    strict = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=5.0, stable_after_s=30.0, burst=0)
    assert next_backoff(strict, 0.2, lived_s=1.0, served=True, served_deaths=0) == 0.4
