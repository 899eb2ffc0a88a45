"""The base class every online objective subclasses (:class:`OnlineObjective`: GRPO's
:class:`hfsdp.builtin.grpo.loss.GRPO`, RLOO's :class:`hfsdp.builtin.rloo.loss.RLOO`, on-policy distillation's
:class:`hfsdp.builtin.distill_online.loss.DistillOnline`), a round of completions at a time: the group plan says which
prompts a round takes and which of them each rank samples, with which seeds (:mod:`~hfsdp.builtin.online.groups`);
each rank samples its share (:mod:`~hfsdp.builtin.online.sampling`) and scores it with the reward functions
(:mod:`~hfsdp.builtin.online.scoring`), and keeps its per-token log-probs when sampled and of the reference where the
objective needs them (and, from an engine beside the trainer, the sampler's: :mod:`~hfsdp.builtin.online.correction`),
all gathered onto every rank; the round is trained on for ``num_iterations`` optimizer steps
from a checkpointed buffer (:mod:`~hfsdp.builtin.online.rounds`). So 1 process and N ranks sample, score and train on
the same completions, N ranks each a 1/N share. Besides: the reward eval, the completions log and the per-token
metrics.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.agent.checks import row_problems
from hfsdp.builtin.agent.rollouts import tool_stats
from hfsdp.builtin.online.correction import mismatch_stats, round_logps
from hfsdp.builtin.online.groups import GroupPlan, Seeds, eval_share, round_share
from hfsdp.builtin.online.rewards import RewardCaller, reward_timeout_s
from hfsdp.builtin.online.rounds import (GroupBatch, RoundBuffer, labelled_of, log_completions, per_row, prompt_completion_batch,
                                         spread, targets_of, token_logps)
from hfsdp.builtin.online.sampling import eos_ids, sample
from hfsdp.builtin.online.scoring import Scorer, reward_stats
from hfsdp.data.batches import MicroBatch, reshard
from hfsdp.model.vision import uses_mrope
from hfsdp.objective import Objective, Sampling, adapters_disabled, means_of, means_over_ranks

if TYPE_CHECKING:
    from hfsdp.builtin.online.schema import OnlineSection


class OnlineObjective(Objective):
    """An objective that trains on completions it samples, scores and keeps for ``num_iterations`` steps (see the
    module docstring); ``name`` is its plugin's, whose section is an :class:`OnlineSection`.

    A subclass implements ``loss`` (its per-token values through :func:`~hfsdp.builtin.online.rounds.token_logps`,
    its metric sums through :meth:`_add`) and says what it needs through these override points, defined in this
    order below and no others:

    - :meth:`advantages` (required): each completion's advantage from the round's rewards;
    - :meth:`units`: what a micro-batch's loss sums over (completions, or tokens);
    - :meth:`keeps_old_logps`, :meth:`keeps_ref_logps`: which per-token log-probs the round keeps (when sampled; of
      the reference);
    - :meth:`without_signal`: which micro-steps every rank skips;
    - :meth:`samples_round`, :meth:`given_completions`: rounds trained on the rows' own completions instead;
    - :meth:`round_stats`: the round's statistics in the metrics.

    As any :class:`~hfsdp.objective.Objective` it may extend ``prepare``, ``batch_plan``, ``start_step``,
    ``evaluate`` (with :meth:`_eval_samples` and :meth:`_eval_rewards`) and the metrics (``take_metrics``,
    ``metrics_of``)."""

    progress_metrics = ("reward", "tools/answered_from_result")  # the second: rollouts that act
    name = "online"
    packs_micro_batches = True  # the per-token values through token_logps, one completion per row

    def __init__(self, section: OnlineSection, rewards: list, config, tokenizer):
        self.section, self.rewards, self.config, self.tokenizer = section, rewards, config, tokenizer
        self.buffer = RoundBuffer()
        self.unwrapped = None
        self.agent = None  # the tools and environments of rollouts that act (prepare)
        self.engine = None  # the generation processes of generation.engine workers (prepare)
        self._rounds = 0  # the run's rounds (batch_plan)
        self._sums: dict[str, torch.Tensor] = {}
        self._generation_s = 0.0  # this step's seconds of sampling, scoring and kept log-probs (0: a reused round)
        self._skipped = 0  # this step's micro-steps without signal, skipped (:meth:`without_signal`)

    # ---- the override points

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int,
                   entries: list[dict[str, Any]]) -> torch.Tensor:
        """Each completion's advantage from the round's rewards ``[completions, functions]`` (NaN: no reward), the
        functions' ``weights`` and the ``group`` of completions per prompt (consecutive); ``entries``: the round's
        micro-batches in order, with the kept per-token log-probs (``old_logps``, ``ref_logps``, ``sampler_logps``)
        where kept."""
        raise NotImplementedError

    def units(self, batch: MicroBatch, completions: int) -> int:
        """What the loss of a micro-batch of ``completions`` sums over (hfsdp divides by the global batch's):
        completions; a loss summed over tokens returns ``batch.num_targets``."""
        return completions

    def keeps_old_logps(self) -> bool:
        """Whether the round keeps each completion's per-token log-probs when sampled (``old_logps``): for the
        ratio of a round's later steps (``num_iterations`` > 1) and, with an engine beside the trainer, for the
        train-inference mismatch (:meth:`round_stats`) and GRPO's correction of it (one forward without gradient a
        round, as TRL's with vLLM)."""
        return self.section.num_iterations > 1 or self.section.generation.beside

    def keeps_ref_logps(self) -> bool:
        """Whether the round keeps the reference's per-token log-probs (``ref_logps``: the base, LoRA's adapters
        disabled): for the KL to it (``beta`` > 0)."""
        return bool(self.section.beta)

    def without_signal(self, slots: list[dict[str, Any]]) -> bool:
        """Whether a micro-step (``slots``: its entry on each rank) has a zero gradient, so that every rank skips
        its forward and backward: every completion's advantage is 0 and there is no KL term in the loss (``beta``
        0), the loss then being 0 whatever the log-probs."""
        return not self.section.beta and all(a == 0 for slot in slots for a in slot["advantages"])

    def samples_round(self, round_: int) -> bool:
        """Whether round ``round_``'s completions are sampled (else :meth:`given_completions`); the same on every
        rank, a function of the seed and the round."""
        return True

    def given_completions(self, dataset, row: int, group: int) -> list[list[int]]:
        """The ``group`` completions of dataset row ``row`` in a round that does not sample."""
        raise NotImplementedError

    def round_stats(self, rewards: torch.Tensor, entries: list[dict[str, Any]]) -> dict[str, float]:
        """The round's statistics, in every step's metrics until the next round (the same on every rank): the
        rewards' (:func:`~hfsdp.builtin.online.scoring.reward_stats`), the completions' mean length (of the
        tokens the model sampled, as TRL counts it: not the tool results) and, for a round an engine beside the
        trainer sampled, the train-inference mismatch
        (:func:`~hfsdp.builtin.online.correction.mismatch_stats`)."""
        lengths = torch.tensor([sum(m) for e in entries for m in e["tool_masks"]] if "tool_masks" in entries[0] else
                               [len(c) for e in entries for c in e["completion_ids"]], dtype=torch.float32)
        stats = {**reward_stats(rewards, self.rewards), "completion_length": float(lengths.mean())}
        if "sampler_logps" in entries[0]:
            stats.update(mismatch_stats(*round_logps(entries)))
        return stats

    # ---- the plan and the rounds

    def sampling(self) -> Sampling:
        return Sampling(self.section.max_new_tokens, whole_global_batch=False)  # each rank its own micro-batches

    def check_rows(self, splits) -> None:
        for split, dataset in splits.items():
            row_problems(dataset, self.section, self.name, {"train": "training"}.get(split, split))

    def batch_plan(self, dataset, train_config, world_size, mixture) -> GroupPlan:
        plan = GroupPlan(len(dataset), train_config.per_device_batch_size // self.section.num_generations,
                         world_size, train_config.gradient_accumulation_steps, train_config.seed, mixture=mixture,
                         iterations=self.section.num_iterations)
        steps = train_config.max_steps or plan.steps_for_epochs(train_config.epochs)
        self._rounds = -(-steps // self.section.num_iterations)
        return plan

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        self.unwrapped, self.accelerator = accelerator.unwrap_model(model), accelerator
        self._mrope = uses_mrope(self.unwrapped.config)
        if self.section.acts:
            from hfsdp.builtin.agent.rollouts import Agent

            self.agent = Agent(self.section, self.name, self.tokenizer, self.config.data, accelerator.process_index)
            self.rewards = [*self.rewards, *self.agent.reward_functions()]
        caller = RewardCaller(self.name, self.rewards,
                              reward_timeout_s(self.section, self.config.train.collective_timeout_s),
                              accelerator.process_index)
        self.scorer = Scorer(self.name, self.rewards, self.tokenizer, caller, accelerator)
        if self.section.generation.engine == "workers":
            from hfsdp.builtin.online.engine import GenerationWorkers

            self.engine = GenerationWorkers(self.section, accelerator.process_index,
                                            self.config.train.collective_timeout_s / 2, self.name)
            self.buffer.engine = self.engine
        accelerator.register_for_checkpointing(self.buffer)
        return splits

    def step_batches(self, model, dataset, plan, step, rank, pad_id, device, select_logits) -> list[GroupBatch]:
        round_ = step // self.section.num_iterations
        if self.buffer.round != round_:
            started = time.perf_counter()
            self._generate(model, dataset, plan, step, round_, pad_id, device, select_logits, rank)
            self._generation_s = time.perf_counter() - started
        world, entries = plan.world_size, self.buffer.entries
        micro = []
        for m in range(plan.accumulation):
            batch = self._batch(entries[m * world + rank], pad_id, device, select_logits, dataset)
            batch.skip = self.without_signal([entries[m * world + r] for r in range(world)])
            micro.append(batch)
        self._skipped = sum(batch.skip for batch in micro)
        return micro

    def _batch(self, entry: dict[str, Any], pad_id: int, device, select_logits: bool, dataset=None) -> GroupBatch:
        """The entry's micro-batch; the tool results in a completion that acts are unlabelled (TRL's ``tool_mask``);
        with ``mask_truncated_completions``, a completion that ends in neither EOS nor the pad token (TRL's test: cut
        at ``max_new_tokens``) is unlabelled, so neither its loss nor its units count. A vision-language model's
        rows carry their prompts' per-token inputs and pixel inputs (from the ``dataset`` rows of the entry)."""
        labelled = None
        if self.section.mask_truncated_completions:
            labelled = labelled_of(entry["completion_ids"], {*eos_ids(self.unwrapped, self.tokenizer), pad_id})
        prompts, completions, masks = entry["prompt_ids"], entry["completion_ids"], entry.get("tool_masks")
        if self.layout.images is not None:  # (never packed: hfsdp.rules.vision)
            group = len(completions) // len(entry["rows"])
            visual = [dataset[i] for i in entry["rows"] for _ in range(group)]
            batch = prompt_completion_batch(prompts, completions, pad_id, device, select_logits, labelled, masks,
                                            visual, self._mrope)
            from accelerate.utils import send_to_device

            batch.inputs.update(send_to_device(self.layout.images(visual), device))
        elif self.layout.pack_len is None:
            batch = prompt_completion_batch(prompts, completions, pad_id, device, select_logits, labelled, masks)
        else:  # each prompt + completion whole, laid end to end
            sequences = [{"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + targets_of(c, masks and masks[i],
                                                                                            labelled and labelled[i])}
                         for i, (p, c) in enumerate(zip(prompts, completions))]
            batch = self.collate(sequences, [[i] for i in range(len(sequences))], pad_id, device, select_logits)
        mask = batch.sequence_targets != IGNORE_INDEX
        units = self.units(batch, len(entry["completion_ids"]))
        return GroupBatch(**vars(batch) | {"num_targets": units},
                          advantages=(torch.tensor(entry["advantages"], dtype=torch.float32, device=device)
                                      if "advantages" in entry else None),
                          old_logps=spread(entry["old_logps"], mask) if entry.get("old_logps") else None,
                          ref_logps=spread(entry["ref_logps"], mask) if entry.get("ref_logps") else None,
                          sampler_logps=spread(entry["sampler_logps"], mask) if entry.get("sampler_logps") else None)

    def _generate(self, model, dataset, plan, step, round_, pad_id, device, select_logits, rank) -> None:
        """Sample this rank's share of the round (the prompts of its own micro-batches), gather every rank's
        completions, score and prepare the round's global batch (collective)."""
        from hfsdp.parallel.world import gather_objects

        s, group = self.section, self.section.num_generations
        share = round_share(plan, step, round_, rank, group, self.name, self.config.train.seed)
        per_slot = share.per_micro_batch
        prompts = [list(dataset[i]["input_ids"]) for part in share.rows for i in part]  # the round's, in slot order
        per_micro = per_slot * group
        # the workers engine: this round's completions (None: a round that does not sample), the weights published
        rolled_of = (self._from_engine(model, dataset, plan, round_, pad_id, select_logits)
                     if self.engine is not None else None)
        if rolled_of is None:
            if self.samples_round(round_):
                rows = [share.rows[k][q] for k in share.mine for q in range(per_slot) for _ in range(group)]
                mine = self._roll_out(model, dataset, rows, [prompts[p] for p in share.positions for _ in range(group)],
                                      share.seeds, pad_id, width=max(map(len, prompts)))
            else:  # the rows' own completions (the same decision on every rank: none samples)
                mine = {"completion_ids": [c for k in share.mine for i in share.rows[k]
                                           for c in self.given_completions(dataset, i, group)]}
            rolled_of = {k: v for part in gather_objects(self.accelerator, {
                k: {key: values[i * per_micro:(i + 1) * per_micro] for key, values in mine.items()}
                for i, k in enumerate(share.mine)}) for k, v in part.items()}
        entries = [{"rows": part, "prompt_ids": [prompts[k * per_slot + q] for q in range(per_slot) for _ in range(group)],
                    **rolled_of[k]} for k, part in enumerate(share.rows)]
        probe = ({key: values[:1] for key, values in entries[0].items()} if s.check_reward_determinism else None)
        rewards_of = (self.scorer.gathered(dataset, {k: entries[k] for k in share.mine}, group, probe=probe)
                      if self.rewards else {k: [[]] * len(e["completion_ids"]) for k, e in enumerate(entries)})
        self._keep_logps(model, dataset, entries, share.mine, pad_id, device, select_logits)
        rewards = torch.tensor([r for k in range(len(entries)) for r in rewards_of[k]], dtype=torch.float32)
        weights = torch.tensor([w for *_, w in self.rewards], dtype=torch.float32)
        advantages = self.advantages(rewards, weights, group, entries)
        for k, entry in enumerate(entries):
            entry["rewards"] = rewards_of[k]
            entry["advantages"] = advantages[k * per_micro:(k + 1) * per_micro].tolist()
        self.buffer.round, self.buffer.entries = round_, entries
        self.buffer.stats = {**self.round_stats(rewards, entries), **tool_stats(entries)}
        if s.log_completions and self.accelerator.is_main_process:
            log_completions(Path(self.config.train.output_dir) / "completions.jsonl", s.log_completions, step, dataset,
                            entries, group, self.tokenizer, [name for name, *_ in self.rewards])

    def _from_engine(self, model, dataset, plan, round_: int, pad_id: int,
                     select_logits: bool) -> dict[int, dict] | None:
        """Round ``round_``'s completions and sampler log-probs per micro-batch, from the generation processes
        (:mod:`~hfsdp.builtin.online.engine`): the weights published as version ``round_`` (every round: a later
        round sampled by it needs it, whether this one samples or not), the rounds up to ``round_ +
        max_staleness`` that sample asked for, round ``round_`` waited for (rank 0) and sent to every rank; None
        for a round that does not sample (collective)."""
        from hfsdp.builtin.online.engine import GenerationError
        from hfsdp.errors import UserError
        from hfsdp.parallel.world import gather_objects

        engine = self.engine
        if engine.settings is None:
            engine.settings = self._engine_settings(pad_id, select_logits)
        engine.publish(model, self.unwrapped, round_, self.config.fsdp.gather_for_generation)
        failure, values = None, {}
        if self.accelerator.process_index == 0:
            try:
                if not engine.processes:
                    engine.start()
                for later in range(max(engine.asked + 1, round_), min(round_ + engine.staleness, self._rounds - 1) + 1):
                    if self.samples_round(later):
                        engine.ask(later, *self._round_prompts(dataset, plan, later))
                values = engine.take(round_) if self.samples_round(round_) else None
            except GenerationError as err:
                failure = str(err)
        failure, values = gather_objects(self.accelerator, (failure, values))[0]
        if failure is not None:
            raise UserError(failure)
        return values

    def _engine_settings(self, pad_id: int, select_logits: bool):
        """What the generation processes need to build and run the policy (:class:`~hfsdp.builtin.online.engine.Settings`)."""
        from hfsdp.builtin.online.engine import Settings, peft_dict
        from hfsdp.quiet import hidden

        peft = getattr(self.unwrapped, "peft_config", None)
        return Settings(self.unwrapped.config, self.config.model.dtype, self.unwrapped.config._attn_implementation,
                        peft_dict(peft["default"]) if peft else None, self.section, eos_ids(self.unwrapped, self.tokenizer),
                        pad_id, select_logits, self.section.mask_truncated_completions, torch.get_num_threads(),
                        hidden())

    def _round_prompts(self, dataset, plan, round_: int) -> tuple[dict[int, dict[str, list]], int]:
        """Every micro-batch's prompts of round ``round_`` (one per completion, in order) with their seeds, and the
        width the prompts are padded to (the round's longest)."""
        group = self.section.num_generations
        share = round_share(plan, round_ * self.section.num_iterations, round_, 0, group, self.name,
                            self.config.train.seed)
        per_slot = share.per_micro_batch
        seeds = Seeds(self.name, self.config.train.seed, round_, list(range(len(share.rows) * per_slot)), group)
        prompts = {k: [list(dataset[i]["input_ids"]) for i in part] for k, part in enumerate(share.rows)}
        slots = {k: {"prompt_ids": [p for p in prompts[k] for _ in range(group)],
                     "seeds": [seeds(k * per_slot * group + j) for j in range(per_slot * group)]}
                 for k in prompts}
        return slots, max(len(p) for part in prompts.values() for p in part)

    def _keep_logps(self, model, dataset, entries: list[dict[str, Any]], mine: list[int], pad_id: int, device,
                    select_logits: bool) -> None:
        """The per-token log-probs when sampled (:meth:`keeps_old_logps`) and of the reference
        (:meth:`keeps_ref_logps`) of this rank's entries (``mine``), gathered into every rank's ``entries``
        (collective)."""
        from hfsdp.parallel.world import gather_objects

        if not (self.keeps_old_logps() or self.keeps_ref_logps()):
            return
        temperature, kept = self.section.temperature, {}
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for k in mine:
                batch = self._batch(entries[k], pad_id, device, select_logits, dataset)
                mask = batch.sequence_targets != IGNORE_INDEX
                kept[k] = {}
                if self.keeps_old_logps():
                    kept[k]["old_logps"] = per_row(token_logps(model, batch, temperature)[0], mask)
                if self.keeps_ref_logps():
                    with adapters_disabled(self.unwrapped):
                        kept[k]["ref_logps"] = per_row(token_logps(model, batch, temperature)[0], mask)
        model.train(was_training)
        reshard(model)
        for part in gather_objects(self.accelerator, kept):
            for k, values in part.items():
                entries[k].update(values)

    def _roll_out(self, model, dataset, rows: list[int], prompts: list[list[int]], seeds: Seeds, pad_id: int,
                  width: int) -> dict[str, list]:
        """This rank's completions of dataset ``rows`` (``prompts``: their ids, one per completion, left-padded to
        ``width``; ``seeds``: their generators'), as per-completion lists: ``completion_ids`` sampled in one turn,
        or the rollouts of a section that acts (:meth:`hfsdp.builtin.agent.rollouts.Agent.roll_out`: their prompts,
        turns, tool masks and messages). Collective."""
        if self.agent is None:
            visual = [dataset[r] for r in rows] if self.layout.images is not None else None
            return {"completion_ids": self._sample(model, prompts, seeds.first_turn(), pad_id, width, visual=visual)}
        from hfsdp.parallel.world import gather_objects

        context = getattr(self.unwrapped.config, "max_position_embeddings", None) or sys.maxsize
        return self.agent.roll_out(
            dataset, rows, seeds, lambda ids, drawn, widest, most: self._sample(model, ids, drawn, pad_id, widest, most),
            lambda value: gather_objects(self.accelerator, value), self.section.max_new_tokens, context)

    def _sample(self, model, prompts: list[list[int]], seeds: list[int], pad_id: int, width: int,
                max_new_tokens: int | None = None, visual: list[dict] | None = None) -> list[list[int]]:
        """:func:`~hfsdp.builtin.online.sampling.sample` as the section says, at most ``max_new_tokens`` (default the
        section's); ``visual``: a vision-language model's prompt rows (collective with several ranks)."""
        return sample(model, self.unwrapped, prompts, seeds, pad_id, width, self.section,
                      eos_ids(self.unwrapped, self.tokenizer), self.config.fsdp.gather_for_generation,
                      synced=self.accelerator.num_processes > 1, max_new_tokens=max_new_tokens, visual=visual,
                      pixels=self.layout.images)

    # ---- the eval

    def evaluate(self, model, dataset, accelerator, pad_id, select_logits) -> dict[str, float]:
        """As TRL's eval: the mean weighted reward (``eval_reward``) and each function's mean over
        ``num_generations_eval`` completions of every eval prompt, sampled as training samples them, each by a
        generator seeded by (objective, seed, prompt, generation index) alone, the same at every eval: an eval of
        unchanged weights gives the same completions, on any number of ranks (another objective, e.g. rloo beside
        grpo, draws others from the same weights: :func:`hfsdp.builtin.online.groups.sample_seed`'s tag). Each rank
        samples and scores its share of the prompts (every ``world``-th)."""
        return self._eval_rewards(dataset, *self._eval_samples(model, dataset, accelerator, pad_id))

    def _eval_samples(self, model, dataset, accelerator, pad_id) -> tuple[list[int], int, dict[str, list]]:
        """(this rank's eval prompts, completions per prompt, this rank's completions in order as per-completion
        lists: ``prompt_ids``, ``completion_ids`` and, for rollouts that act, their tool masks and messages) of the
        eval's sampling (see :meth:`evaluate`; collective: every rank samples in lock-step)."""
        group = self.section.num_generations_eval or self.section.num_generations
        prompts = [list(dataset[i]["input_ids"]) for i in range(len(dataset))]
        mine, seeds = eval_share(len(dataset), accelerator.num_processes, accelerator.process_index, group,
                                 self.name, self.config.train.seed)
        rows = [p for p in mine for _ in range(group)]
        rolled = self._roll_out(model, dataset, rows, [prompts[p] for p in rows], seeds, pad_id,
                                width=max(map(len, prompts)))
        return mine, group, {"prompt_ids": [prompts[p] for p in rows], **rolled}

    def _eval_rewards(self, dataset, mine: list[int], group: int, rolled: dict[str, list]) -> dict[str, float]:
        """``eval_reward`` and each function's ``eval_rewards/<name>/mean`` of the eval's completions (none without
        reward functions; collective otherwise)."""
        if not self.rewards:
            return {}
        scores = self.scorer.gathered(dataset, {i: {"rows": [i], **{key: values[n * group:(n + 1) * group]
                                                                     for key, values in rolled.items()}}
                                                for n, i in enumerate(mine)}, group, "eval")
        rewards = torch.tensor([r for i in range(len(dataset)) for r in scores[i]], dtype=torch.float32)
        return {f"eval_{k}": v for k, v in reward_stats(rewards, self.rewards).items() if not k.endswith("std")}

    # ---- the metrics

    def _add(self, name: str, value: torch.Tensor) -> None:
        """Add ``value`` to this step's (or eval's) sum ``name``: a mean per token over all ranks in the metrics."""
        self._sums[name] = self._sums.get(name, 0) + value.detach().double()

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        means, self._sums = means_over_ranks(accelerator, self._sums, "tokens", prefix), {}
        return {**self._own_metrics(prefix), **means}

    def step_sums(self) -> dict[str, Any]:
        sums, self._sums = self._sums, {}
        return sums

    def metrics_of(self, totals: dict[str, float]) -> dict[str, float]:
        return {**self._own_metrics(), **means_of(totals, "tokens")}

    def _own_metrics(self, prefix: str = "") -> dict[str, float]:
        """The round's statistics (the same on every rank), the time spent sampling and the skipped micro-steps."""
        generation_s, self._generation_s = self._generation_s, 0.0
        skipped, self._skipped = self._skipped, 0
        engine = self.engine.take_stats() if self.engine is not None and not prefix else {}  # training steps
        return {**{f"{prefix}{k}": v for k, v in self.buffer.stats.items()}, f"{prefix}generation_s": generation_s,
                f"{prefix}skipped_zero_advantage": skipped, **engine}
