"""What is checked of each call of an online objective's reward function (``RewardCaller``), in the test process: a
time limit a retrying function cannot swallow, values that are not finite numbers named with the row, and the memory
a function keeps across calls named in a warning. The same checks on 2 ranks through the CLI (a hang on one rank stops
both, a reward that depends on the rank is found): tests/test_grpo.py."""

from __future__ import annotations

import math
import re
import time

import pytest

from hfsdp.builtin.online.rewards import KEPT_MEMORY_WARNING, RewardCaller, reward_timeout_s
from hfsdp.builtin.grpo.schema import GrpoSection


def caller(fn, timeout_s: float = 30.0) -> RewardCaller:
    return RewardCaller("grpo", [("mine", "my_rewards", fn, 1.0)], timeout_s, rank=0)


def inputs(count: int = 4) -> dict[str, list]:
    return {"prompts": ["p"] * count, "completions": ["ab", "a1", "", "xyz"][:count], "completion_ids": [[1]] * count}


def test_a_reward_that_hangs_is_stopped_after_the_timeout_even_if_it_catches_what_stops_it():
    def retries(completions, **kwargs):
        while True:
            try:
                time.sleep(60)
            except Exception:  # noqa: BLE001, S112 (the retry loop under test)
                continue

    started = time.monotonic()
    message = caller(retries, timeout_s=0.5).score(inputs(), rows=[7, 9], group=2)
    assert time.monotonic() - started < 5
    assert message == ("grpo reward 'mine' (from my_rewards: test_a_reward_that_hangs_is_stopped_after_the_timeout_"
                       "even_if_it_catches_what_stops_it.<locals>.retries) did not return within 0.5 s "
                       "(grpo.reward_timeout_s), scoring the completions of training rows 7, 9 (counting from 0) on "
                       "rank 0: it was stopped there; make it return in time (a timeout on what it waits for), or "
                       "raise grpo.reward_timeout_s")


def test_the_time_limit_is_gone_after_the_call():
    import signal

    assert caller(lambda completions, **kw: [1.0] * len(completions), timeout_s=0.2).score(
        inputs(), rows=[0, 1], group=2) == [[1.0]] * 4
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    time.sleep(0.4)  # an alarm left armed would raise here


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_reward_that_is_not_finite_is_named_with_its_row(bad):
    message = caller(lambda completions, **kw: [0.5, 0.25, bad, 1.0]).score(inputs(), rows=[3, 8], group=2)
    assert message == (f"grpo reward 'mine' (from my_rewards: test_a_reward_that_is_not_finite_is_named_with_its_row."
                       f"<locals>.<lambda>) returned {bad!r} for completion 0 of training row 8: a reward is a finite "
                       "number; return None where a function gives no reward")


def test_none_is_no_reward_and_numbers_pass():
    got = caller(lambda completions, **kw: [None, 1, 0.5, True and 2.0]).score(inputs(), rows=[0, 1], group=2)
    assert math.isnan(got[0][0]) and [r[0] for r in got[1:]] == [1.0, 0.5, 2.0]


def test_a_reward_that_keeps_memory_across_calls_is_named_once(capsys):
    kept = []

    def leaks(completions, **kwargs):
        # pages written: resident; 2 counted calls keep 0.8 of the limit, 3 keep 1.2 (a margin of 51 MiB either way
        # for what else the process frees or maps meanwhile)
        kept.append(bytearray(b"\1") * (KEPT_MEMORY_WARNING * 2 // 5))
        return [0.0] * len(completions)

    calls = caller(leaks)
    for _ in range(3):  # the first call's memory is not counted (a model a reward loads once)
        calls.score(inputs(), rows=[0, 1], group=2)
    assert capsys.readouterr().err == ""
    for _ in range(3):
        calls.score(inputs(), rows=[0, 1], group=2)
    err = capsys.readouterr().err
    assert err.count("hfsdp: warning: rank 0: grpo reward 'mine'") == 1, err
    # crossed at the 4th call (1.2 of the limit), said once; the 5th where the process's other pages shrank by over
    # the margin meanwhile (CI, 2026-12-06: "over its 4 calls")
    assert re.search(r"more resident memory over its [34] calls after the first", err), err


def test_a_reward_that_frees_what_it_allocates_is_not_named(capsys):
    def allocates(completions, **kwargs):
        scratch = bytearray(b"\1") * (KEPT_MEMORY_WARNING // 2)
        return [float(len(scratch) > 0)] * len(completions)

    calls = caller(allocates)
    for _ in range(6):
        calls.score(inputs(), rows=[0, 1], group=2)
    assert capsys.readouterr().err == ""


def test_the_timeout_defaults_to_half_the_collective_timeout():
    # (one at or above the collective timeout is refused: tests/test_bad_inputs.py)
    assert reward_timeout_s(GrpoSection(rewards=[{"name": "json_fields"}]), 600) == 300
    assert reward_timeout_s(GrpoSection(rewards=[{"name": "json_fields"}], reward_timeout_s=20), 600) == 20
