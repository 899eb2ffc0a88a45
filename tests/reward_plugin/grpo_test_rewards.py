"""Reward functions for the grpo tests (TRL's calling convention), named as module:function or, enabled as a plugin
(``plugins: [grpo, grpo_test_rewards]``), by the names its ``hfsdp_reward_functions`` offers. ``letters`` scores the
random tiny model's completions with numbers that differ within a group, so that the advantages and the loss are
not 0."""

import hfsdp


def letters(completions, **kwargs):
    """The share of the completion's characters that are ASCII letters."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def letters_where_signal(completions, signal, **kwargs):
    """``letters`` for the rows whose ``signal`` column is true, 0.5 for every completion of the others (a group
    without signal: its advantages are 0)."""
    return [value if has else 0.5 for value, has in zip(letters(completions), signal)]


def characters(completions, **kwargs):
    """The completion's length in characters over 100 (a second objective beside ``letters``)."""
    return [len(c[-1]["content"] if isinstance(c, list) else c) / 100 for c in completions]


def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def fails_on_rank_1(completions, **kwargs):
    """Raises on the second rank only: the first must stop too, not wait for it."""
    import os

    if os.environ.get("RANK") == "1":
        raise ValueError("a reward server is down")
    return [0.5] * len(completions)


@hfsdp.hookimpl
def hfsdp_reward_functions():
    return {"letters": letters}
