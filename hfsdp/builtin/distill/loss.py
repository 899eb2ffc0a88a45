"""The objective of plugin ``distill`` (:mod:`hfsdp.builtin.distill`): the teacher, the divergence and the metrics.

:func:`divergence_sum` is TRL 1.16's ``generalized_jsd_loss`` (``trl.experimental.gkd``) summed over the labelled
positions instead of averaged: hfsdp divides the micro-batch's sum by the global batch's labelled tokens, which is
TRL's ``batchmean`` on one process (tests/test_distill.py compares the two within 1e-6).

The teacher (:class:`hfsdp.builtin.distill.teacher.Teacher`): checked against the student before any weight loads
(:meth:`Distill.batch_plan`), loaded frozen and sharded after the student (:meth:`Distill.prepare`), run on the same
inputs as the student, micro-batch by micro-batch.

Metrics (per labelled token, over all ranks; eval: prefixed ``eval_``): ``distill/ce`` (the student's cross entropy)
and ``distill/divergence``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.objective import Objective, means_of, means_over_ranks

BETA_OF = {"forward_kl": 0.0, "reverse_kl": 1.0}  # TRL's beta of each named divergence; jsd: the section's beta


def divergence_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, beta: float,
                   temperature: float) -> torch.Tensor:
    """TRL's generalized JSD per position (beta 0: KL(teacher || student), 1: KL(student || teacher)), in float32,
    summed over the positions whose target is not IGNORE_INDEX (only those computed). The log-probabilities are the
    logits minus their ``logsumexp``, which on a CPU is closer to a float64 computation than ``log_softmax`` (see
    :func:`hfsdp.objective.target_logps`): on SmolLM2's 49,152 tokens the forward KL from the real teacher came out
    1.7e-6 off float64 with ``log_softmax``, 3.6e-7 so (TRL's chunked kernel: 1.9e-7)."""
    labelled = targets != IGNORE_INDEX
    student = student_logits[labelled].float() / temperature
    teacher = teacher_logits[labelled].float() / temperature
    student = student - torch.logsumexp(student, -1, keepdim=True)
    teacher = teacher - torch.logsumexp(teacher, -1, keepdim=True)
    if beta == 0:
        per_vocab = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        per_vocab = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        per_vocab = (b * F.kl_div(mixture, teacher, reduction="none", log_target=True)
                     + (1 - b) * F.kl_div(mixture, student, reduction="none", log_target=True))
    return per_vocab.sum()


class Distill(Objective):
    progress_metrics = ("distill/divergence",)
    packs_micro_batches = True  # sums over labelled tokens; the teacher sees the same packed rows

    def __init__(self, section, config, tokenizer, cache_dir):
        from hfsdp.builtin.distill.teacher import Teacher

        self.section, self.config = section, config
        self.beta = BETA_OF.get(section.loss, section.beta)
        self.teacher = Teacher(section.teacher, "distill.teacher", config, tokenizer, cache_dir)
        self._sums: dict[str, torch.Tensor | float] = {}

    def frozen_models(self):
        return [self.teacher.frozen_model()]

    def batch_plan(self, dataset, train_config, world_size, mixture):
        self.teacher.check()  # before any weight loads
        return super().batch_plan(dataset, train_config, world_size, mixture)

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        self.teacher.load(accelerator, self.layout.pack_segments)
        return splits

    def loss(self, model, batch) -> torch.Tensor:
        s = self.section
        teacher = self.teacher.logits(batch)
        logits = model(**batch.inputs).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch.targets.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")
        divergence = divergence_sum(logits, teacher, batch.targets, self.beta, s.temperature)
        self._sums["tokens"] = self._sums.get("tokens", 0) + batch.num_targets
        self._sums["distill/ce"] = self._sums.get("distill/ce", 0) + ce.detach()
        self._sums["distill/divergence"] = self._sums.get("distill/divergence", 0) + divergence.detach()
        return (1 - s.alpha) * ce + s.alpha * divergence

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        metrics, self._sums = means_over_ranks(accelerator, self._sums, "tokens", prefix), {}
        return metrics

    def step_sums(self) -> dict[str, Any]:
        sums, self._sums = self._sums, {}
        return sums

    def metrics_of(self, totals: dict[str, float]) -> dict[str, float]:
        return means_of(totals, "tokens")

    def eval_metrics(self, loss: float, targets: int) -> dict[str, float]:
        return {"eval_loss": loss, "eval_tokens": int(targets)}
