"""Evaluation during and after training: the eval loss over the eval split (every rank the same number of
forwards), generation exact match, and what they give the metrics and ``hfsdp_on_eval``."""

from __future__ import annotations

from typing import Any

import torch

from hfsdp.config.schema import HfsdpConfig
from hfsdp.data import batches
from hfsdp.objective import Objective
from hfsdp.parallel.world import all_sum
from hfsdp.layout.degrees import World
from hfsdp.parallel.accelerator import fsdp1_drop_stale_gathers
from hfsdp.run import generation, optimizers
from hfsdp.run.metrics import MetricsWriter
from hfsdp.run.state import Run


@torch.no_grad()
def evaluate(model, dataset, config: HfsdpConfig, accelerator, world: World, pad_id: int, select_logits: bool,
             objective: Objective) -> dict[str, float]:
    """The eval loss over ``dataset``, split over the data-parallel ranks (a tensor-parallel group's ranks evaluate
    the same rows: the sums over all ranks count them ``world.dims.tp`` times; a sequence-parallel group's ranks
    each count their share of the positions)."""
    model.eval()
    rank_batches = batches.eval_batches(len(dataset), config.train.per_device_batch_size, world.dims.dp_size,
                                        world.dp_rank)
    if config.train.max_eval_batches:
        rank_batches = rank_batches[: config.train.max_eval_batches]
    loss_sum, tokens = 0.0, 0
    for rows in rank_batches:
        batch = objective.micro_batch([dataset[i] for i in (rows or [0])], pad_id, accelerator.device, select_logits)
        if rows is None:  # filler so that every rank runs the same number of forwards
            batch.make_filler()
        objective.start_step(accelerator, [batch])
        loss_sum += float(objective(model, batch))
        tokens += batch.num_targets
    model.train()
    loss_sum, tokens = (total / world.dims.tp for total in all_sum(accelerator, [loss_sum, tokens]))
    return {**objective.eval_metrics(loss_sum / max(tokens, 1), tokens),
            **objective.take_metrics(accelerator, prefix="eval_")}


class Evaluator:
    """``run_eval(step, label)``: eval loss on the eval split and generation exact match, written to the metrics and
    given to ``hfsdp_on_eval``; the generations stay in ``generations[label]`` for the summary."""

    def __init__(self, run: Run, unwrapped, eval_set, gen_items: list, metrics: MetricsWriter, select_logits: bool):
        self.run, self.unwrapped, self.eval_set, self.gen_items = run, unwrapped, eval_set, gen_items
        self.metrics, self.select_logits = metrics, select_logits
        self.generations: dict[str, generation.GenerationResult] = {}
        self.enabled = eval_set is not None or bool(gen_items)

    def __call__(self, step: int, label: str) -> dict[str, Any]:
        run = self.run
        with optimizers.evaluation_weights(run.optimizer):
            results = self._evaluate(step, label)
        if optimizers.keeps_training_weights(run.optimizer):
            # FSDP1 keeps the root unit gathered after a forward: the eval's averaged weights would be the next
            # training step's (schedule-free's weights changed back underneath)
            fsdp1_drop_stale_gathers(run.model)
        if results:
            self.metrics.write(step, results)
            run.plugins.call("hfsdp_on_eval", run=run, step=step, metrics=results)
        return results

    def _evaluate(self, step: int, label: str) -> dict[str, Any]:
        run = self.run
        results: dict[str, Any] = {}
        if self.eval_set is not None:
            results.update(run.objective.evaluate(run.model, self.eval_set, run.accelerator, run.tokenizer.pad_token_id,
                                                  self.select_logits)
                           or evaluate(run.model, self.eval_set, run.config, run.accelerator, run.world,
                                       run.tokenizer.pad_token_id, self.select_logits, run.objective))
        if self.gen_items:
            gen = generation.generate_eval(run.model, self.unwrapped, run.tokenizer, self.gen_items,
                                           run.config.generation_eval.max_new_tokens,
                                           gather=run.config.fsdp.gather_for_generation)
            results["gen_exact_match"] = gen.accuracy
            self.generations[label] = gen
        return results

    def before_training(self) -> dict[str, Any]:
        """The eval before the first step (``train.eval_at_start``; not when resuming), printed."""
        if not (self.run.config.train.eval_at_start and self.run.state.step == 0):
            return {}
        before = self(self.run.state.step, "before")
        if before:
            self.run.accelerator.print(
                "eval before training: " + (f"reward {before['eval_reward']:.4f}" if "eval_reward" in before else
                                            f"loss {before.get('eval_loss', float('nan')):.4f}")
                + (f", exact match {before['gen_exact_match']:.1%}" if "gen_exact_match" in before else "")
                + (f" (compared: {gen.compared})" if (gen := self.generations.get("before")) and gen.compared else ""))
        return before
