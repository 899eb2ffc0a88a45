"""The objective of plugin ``distill_online`` (:mod:`hfsdp.builtin.distill_online`): on-policy distillation as TRL
1.16's ``DistillationTrainer``.

Each round (``num_iterations`` steps, 1 by default as TRL's) the student samples ``num_generations`` completions of
each of the step's prompts on the online objectives' sampler (seeded per completion: the same on any world size),
or, with ``lmbda`` < 1, in a round drawn off-policy (:meth:`DistillOnline.samples_round`: a draw from the seed and
the round, under ``lmbda`` samples; the same on every rank and after a resume), trains on each row's own completion
(``completion_column``: the assistant reply rendered after the prompt by the chat template, up to its first EOS and
``max_new_tokens``; GKD's off-policy rounds). The round's ``on_policy`` metric says which;
each step the teacher (:class:`hfsdp.builtin.distill.teacher.Teacher`, frozen, sharded) and the student run on the
same prompt + completion rows, and the loss is the generalized JSD of their next-token distributions (both logits
divided by ``temperature``; :func:`hfsdp.builtin.distill.loss.divergence_sum`, TRL's divergence) summed over the
completions' tokens and divided by the global batch's (TRL's ``num_items_in_batch`` reduction of its chunked
divergence). No advantages, no reference, no ratio: every micro-step trains. Metrics: ``distill/divergence`` and the
student's ``entropy`` per completion token, the completions' length, and the rewards where functions are named. The
eval samples ``num_generations_eval`` completions of each eval prompt as GRPO's does and reports their divergence
per token (``eval_loss``) and, with reward functions, ``eval_reward``.
"""

from __future__ import annotations

import json

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.distill.loss import divergence_sum
from hfsdp.builtin.distill.teacher import Teacher
from hfsdp.builtin.online.groups import sample_seed
from hfsdp.builtin.online.objective import OnlineObjective
from hfsdp.builtin.online.rounds import entropies, prompt_completion_batch
from hfsdp.builtin.online.sampling import eos_ids
from hfsdp.builtin.prompt import ROW_COLUMN
from hfsdp.data.batches import MicroBatch, reshard
from hfsdp.errors import UserError


class DistillOnline(OnlineObjective):
    name = "distill_online"
    progress_metrics = ("distill/divergence", "tools/answered_from_result")

    def __init__(self, section, rewards, config, tokenizer, cache_dir):
        super().__init__(section, rewards, config, tokenizer)
        self.teacher = Teacher(section.teacher, "distill_online.teacher", config, tokenizer, cache_dir)
        self._given: dict[int, list[int]] = {}  # row -> its own completion's token ids (rounds that do not sample)

    def frozen_models(self):
        return [self.teacher.frozen_model()]

    def batch_plan(self, dataset, train_config, world_size, mixture):
        self.teacher.check()  # before any weight loads
        if self.section.lmbda < 1:  # every row has its own completion (before any weight loads)
            column = self.section.completion_column
            for i in range(len(dataset)):
                value = json.loads(dataset[i][ROW_COLUMN]).get(column)
                if not isinstance(value, str) or not value:
                    raise UserError(f"distill_online.lmbda {self.section.lmbda:g} trains some rounds on the rows' own "
                                    f"completions, but training row {i} (counting from 0) has no text in column "
                                    f"'{column}': set distill_online.completion_column to the column holding them, "
                                    "or lmbda: 1")
        return super().batch_plan(dataset, train_config, world_size, mixture)

    def samples_round(self, round_: int) -> bool:
        """Under ``lmbda``: a draw in [0, 1) from (seed, round), the same on every rank and after a resume."""
        draw = sample_seed("distill_online-lmbda", self.config.train.seed, round_, 0, 0) / 2 ** 63
        return draw < self.section.lmbda

    def given_completions(self, dataset, row: int, group: int) -> list[list[int]]:
        if row not in self._given:
            self._given[row] = self._own_completion(dataset, row)
        return [self._given[row]] * group

    def _own_completion(self, dataset, row: int) -> list[int]:
        """Row ``row``'s ``completion_column`` as the tokens the chat template puts after its prompt (a text prompt:
        the text's tokens), up to and including the first EOS, at most ``max_new_tokens``."""
        from hfsdp.builtin.chat import chat_ids, conversation

        raw = json.loads(dataset[row][ROW_COLUMN])
        prompt, text = raw["prompt"], raw[self.section.completion_column]
        prompt_ids = list(dataset[row]["input_ids"])
        eos = eos_ids(self.unwrapped, self.tokenizer)
        if isinstance(prompt, list):
            full = chat_ids(conversation([*prompt, {"role": "assistant", "content": text}], self.config.data),
                            self.tokenizer)
            if full[:len(prompt_ids)] != prompt_ids:
                raise UserError(f"distill_online: the chat template renders training row {row}'s prompt otherwise "
                                "with its completion after it than alone, so its completion's tokens cannot be "
                                "told apart: use text prompts, or lmbda: 1")
            ids = full[len(prompt_ids):]
        else:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos[0]]
        ends = set(eos)
        end = next((n + 1 for n, token in enumerate(ids) if token in ends), len(ids))
        return ids[:min(end, self.section.max_new_tokens)]

    def round_stats(self, rewards: torch.Tensor, entries) -> dict[str, float]:
        return {**super().round_stats(rewards, entries), "on_policy": float(self.samples_round(self.buffer.round))}

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        splits = super().prepare(model, accelerator, splits, cache_dir, model_path)
        self.teacher.load(accelerator, self.layout.pack_segments)
        return splits

    def keeps_ref_logps(self) -> bool:
        return False  # beta chooses the divergence here: there is no reference

    def without_signal(self, slots) -> bool:
        return False  # no advantages: every completion is trained on

    def units(self, batch: MicroBatch, completions: int) -> int:
        return batch.num_targets  # the global batch's completion tokens

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int, entries) -> torch.Tensor:
        return torch.zeros(rewards.size(0))

    def divergence(self, model, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed divergence over the batch's labelled tokens, the student's summed entropy there)."""
        s = self.section
        teacher = self.teacher.logits(batch)
        logits = model(**batch.inputs).logits
        entropy = entropies(logits[batch.targets != IGNORE_INDEX].float() / s.temperature).sum()
        return divergence_sum(logits, teacher, batch.targets, s.beta, s.temperature), entropy

    def loss(self, model, batch: MicroBatch) -> torch.Tensor:
        divergence, entropy = self.divergence(model, batch)
        self._add("tokens", (batch.targets != IGNORE_INDEX).sum())
        self._add("distill/divergence", divergence)
        self._add("entropy", entropy)
        return divergence

    def evaluate(self, model, dataset, accelerator, pad_id, select_logits) -> dict[str, float]:
        """``eval_loss``: the divergence per token of ``num_generations_eval`` completions of every eval prompt,
        sampled as GRPO's eval samples them; ``eval_reward`` with reward functions. Each rank samples its share of
        the prompts and runs one forward of the student and the teacher over them (a rank without prompts: one
        padding row, in step)."""
        from hfsdp.parallel.world import all_sum

        mine, group, rolled = self._eval_samples(model, dataset, accelerator, pad_id)
        results = self._eval_rewards(dataset, mine, group, rolled)
        sampled = rolled["completion_ids"]
        rows = rolled["prompt_ids"] or [[pad_id]]
        completions = sampled or [[pad_id]]
        labelled = [bool(sampled)] * len(rows)  # the padding row: nothing labelled
        batch = prompt_completion_batch(rows, completions, pad_id, accelerator.device, select_logits, labelled,
                                        rolled.get("tool_masks") or None)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            divergence, _ = self.divergence(model, batch)
        model.train(was_training)
        reshard(model)
        total, tokens = all_sum(accelerator, [float(divergence), float((batch.targets != IGNORE_INDEX).sum())])
        return {**results, "eval_loss": total / tokens if tokens else float("nan"), "eval_tokens": int(tokens)}
