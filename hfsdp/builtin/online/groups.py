"""The group plan of the online objectives, a pure function of the seed and the round: which prompts each round takes
(:class:`GroupPlan`: ``per_device_batch_size / num_generations`` prompts per micro-batch, each round trained
``num_iterations`` optimizer steps), which of them each rank samples (:func:`round_share`: the prompts of its own
micro-batches, a prompt's whole group on one rank; :func:`eval_share`: every ``world``-th eval prompt), and the seed
of each completion's generator (:func:`sample_seed`: by objective, seed, round, prompt position and generation index,
never by rank or batch composition), so that 1 process and N ranks sample the same completions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hfsdp.data.batches import BatchPlan

# The round number in the eval's sampling seeds (training rounds count from 0).
EVAL_ROUND = -1


class GroupPlan(BatchPlan):
    """The plan of prompts: ``per_device_batch`` prompts per micro-batch, each plan step (a generation round)
    trained ``iterations`` optimizer steps."""

    def __init__(self, *args, iterations: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.iterations = iterations

    def rows(self, step: int, micro_step: int, rank: int) -> list[int]:
        return super().rows(step // self.iterations, micro_step, rank)

    def steps_for_epochs(self, epochs: float) -> int:
        return super().steps_for_epochs(epochs) * self.iterations

    def epoch_of(self, step: int) -> float:
        return super().epoch_of(step // self.iterations)

    def source_counts(self, steps: int) -> list[int]:
        return super().source_counts(-(-steps // self.iterations))


def sample_seed(tag: str, seed: int, round_: int, prompt: int, generation: int, turn: int = 0) -> int:
    """The seed of one completion's sampling generator (``tag``: the objective's plugin name) for its turn ``turn``
    (a multi-turn rollout samples again after its tool calls: a generator of its own each turn)."""
    key = f"{tag}:{seed}:{round_}:{prompt}:{generation}" + (f":{turn}" if turn else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Seeds:
    """The seeds of a rank's completions in a round (or the eval, round :data:`EVAL_ROUND`): completion ``i`` is
    generation ``i % group`` of the prompt at place ``positions[i // group]``; ``seeds(i, turn)`` is
    :func:`sample_seed`'s."""

    tag: str
    seed: int
    round_: int
    positions: list[int]
    group: int

    def __call__(self, i: int, turn: int = 0) -> int:
        return sample_seed(self.tag, self.seed, self.round_, self.positions[i // self.group], i % self.group, turn)

    def first_turn(self) -> list[int]:
        """Every completion's seed of its first turn, in order."""
        return [self(i) for i in range(len(self.positions) * self.group)]


@dataclass(frozen=True)
class RoundShare:
    """A round's global batch and this rank's share of it: the ``rows`` of each global micro-batch (``k = m * world +
    r`` for micro-step ``m`` on rank ``r``), the micro-batches this rank samples (``mine``: its own), its prompts'
    places in the round (``positions``) and the seeds of their completions (``seeds``: a group per prompt, in
    order)."""

    rows: list[list[int]]
    mine: list[int]
    positions: list[int]
    seeds: Seeds

    @property
    def per_micro_batch(self) -> int:
        """The prompts of a micro-batch."""
        return len(self.rows[0])


def round_share(plan: BatchPlan, step: int, round_: int, rank: int, group: int, tag: str, seed: int) -> RoundShare:
    """Round ``round_`` (trained from optimizer step ``step``) as rank ``rank`` samples it, ``group`` completions per
    prompt, seeded by :func:`sample_seed` with ``tag`` and ``seed``."""
    slots = [(m, r) for m in range(plan.accumulation) for r in range(plan.world_size)]
    rows = [plan.rows(step, m, r) for m, r in slots]
    mine = [k for k, (_, r) in enumerate(slots) if r == rank]
    positions = [k * len(rows[0]) + q for k in mine for q in range(len(rows[0]))]
    return RoundShare(rows, mine, positions, Seeds(tag, seed, round_, positions, group))


def eval_share(prompts: int, world: int, rank: int, group: int, tag: str, seed: int) -> tuple[list[int], Seeds]:
    """The eval prompts rank ``rank`` samples (every ``world``-th of ``prompts``) and the seeds of their ``group``
    completions each (round :data:`EVAL_ROUND`: the same at every eval)."""
    mine = list(range(rank, prompts, world))
    return mine, Seeds(tag, seed, EVAL_ROUND, mine, group)
