"""Reward functions for the grpo tests (TRL's calling convention), named as module:function or, enabled as a plugin
(``plugins: [grpo, grpo_test_rewards]``), by the names its ``hfsdp_reward_functions`` offers. ``letters`` scores the
random tiny model's completions with numbers that differ within a group, so that the advantages and the loss are
not 0."""

import hfsdp


def letters(completions, **kwargs):
    """The share of the completion's characters that are ASCII letters."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def image_letters(completions, images, **kwargs):
    """``letters`` times 1 plus the mean brightness of the prompt's first image (in [0, 1]; 0 without one): the
    images reach the reward as TRL gives them, a list of PIL images per completion."""
    brightness = [sum(row[0].convert("L").getdata()) / (255 * row[0].width * row[0].height) if row else 0.0
                  for row in images]
    return [value * (1 + light) for value, light in zip(letters(completions), brightness)]


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


_calls = {"hangs_on_rank_1": 0}


def hangs_on_rank_1(completions, **kwargs):
    """``letters``, but its third call on the second rank (the first of the second round: each round calls it for the
    micro-batch and for the determinism check) sleeps for an hour, catching what interrupts it as code that retries
    does."""
    import os
    import time

    _calls["hangs_on_rank_1"] += 1
    if os.environ.get("RANK") == "1" and _calls["hangs_on_rank_1"] == 3:
        while True:
            try:
                time.sleep(3600)
            except Exception:  # noqa: BLE001, S112 (a retry loop that swallows errors)
                continue
    return letters(completions)


def rank_dependent(completions, **kwargs):
    """``letters`` plus a tenth of the rank: the same completion scores differently on each rank."""
    import os

    return [v + 0.1 * int(os.environ.get("RANK", "0")) for v in letters(completions)]


def nan_for_the_last(completions, **kwargs):
    """``letters``, NaN for the last completion (0 / 0, as a reward's arithmetic can give it)."""
    return [*letters(completions)[:-1], float("nan")]


class Notebook:
    """An environment for the random tiny model's rollouts (agents that act, issue 69): its reset appends a line to
    the prompt, its one tool keeps notes, and its reward (a third of the asked name's length, modulo 3) differs
    between rows, not within a group."""

    def reset(self, **row) -> str:
        self.notes: list[str] = []
        self.reward = len(row["answer"]["arguments"]["name"]) % 3 / 3
        return " Answer briefly."

    def note(self, text: str) -> str:
        """Keep a note for later.

        Args:
            text: what to note
        """
        self.notes.append(text)
        return f"{len(self.notes)} notes kept"

    def get_reward(self) -> float:
        return self.reward


@hfsdp.hookimpl
def hfsdp_reward_functions():
    return {"letters": letters}
