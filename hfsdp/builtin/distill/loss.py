"""The objective of plugin ``distill`` (:mod:`hfsdp.builtin.distill`): the teacher, the divergence and the metrics.

:func:`divergence_sum` is TRL 1.16's ``generalized_jsd_loss`` (``trl.experimental.gkd``) summed over the labelled
positions instead of averaged: hfsdp divides the micro-batch's sum by the global batch's labelled tokens, which is
TRL's ``batchmean`` on one process (tests/test_distill.py compares the two within 1e-6).

The teacher: resolved and checked against the student (the same vocabulary size and the same tokenizer vocabulary)
before any weight loads (:meth:`Distill.batch_plan`), loaded after the student is sharded (:meth:`Distill.prepare`)
in ``model.dtype``, put in eval mode with ``requires_grad`` False, and, on several ranks under FSDP2, sharded with
``fully_shard`` per decoder layer and at its root (so each rank keeps its share of the teacher's weights, as of the
student's). It is run under ``no_grad`` on the same inputs as the student, micro-batch by micro-batch (every rank
runs the same number of micro-batches, so the teacher's collectives stay in lock-step). Its logits are exact: no
top-k truncation, nothing cached.

Metrics (per labelled token, over all ranks; eval: prefixed ``eval_``): ``distill/ce`` (the student's cross entropy)
and ``distill/divergence``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.errors import UserError
from hfsdp.objective import FrozenModel, Objective, means_of, means_over_ranks

BETA_OF = {"forward_kl": 0.0, "reverse_kl": 1.0}  # TRL's beta of each named divergence; jsd: the section's beta


def divergence_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, beta: float,
                   temperature: float) -> torch.Tensor:
    """TRL's generalized JSD per position (beta 0: KL(teacher || student), 1: KL(student || teacher)), in float32,
    summed over the positions whose target is not IGNORE_INDEX."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        per_vocab = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        per_vocab = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        per_vocab = (b * F.kl_div(mixture, teacher, reduction="none", log_target=True)
                     + (1 - b) * F.kl_div(mixture, student, reduction="none", log_target=True))
    return per_vocab[targets != IGNORE_INDEX].sum()


@contextlib.contextmanager
def as_teacher():
    """The model loaders' errors, said of ``model.name_or_path``, said of ``distill.teacher``: here it is the teacher."""
    try:
        yield
    except UserError as err:
        raise UserError(f"distill.teacher: {str(err).split(': ', 1)[1]}") from None


def check_teacher(teacher_path: str, student_config, tokenizer, model_cfg) -> None:
    """A UserError, before any weight loads, if the teacher cannot teach this student token by token."""
    from hfsdp.model.loading import load_model_config, load_tokenizer

    with as_teacher():
        teacher_config = load_model_config(teacher_path, model_cfg)
        theirs = load_tokenizer(teacher_path, model_cfg)
    if teacher_config.vocab_size != student_config.vocab_size:
        raise UserError(f"distill.teacher: its vocabulary has {teacher_config.vocab_size} entries, the student's "
                        f"{student_config.vocab_size}: the teacher must use the student's tokenizer")
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError("distill.teacher: its tokenizer differs from the student's (other tokens or ids): the "
                        "teacher must use the student's tokenizer")


class Distill(Objective):
    progress_metrics = ("distill/divergence",)
    packs_micro_batches = True  # sums over labelled tokens; the teacher sees the same packed rows

    def __init__(self, section, config, tokenizer, cache_dir):
        self.section, self.config, self.tokenizer, self.cache_dir = section, config, tokenizer, cache_dir
        self.beta = BETA_OF.get(section.loss, section.beta)
        self.teacher = None
        self.teacher_path: str | None = None
        self.teacher_selects = False
        self._sums: dict[str, torch.Tensor | float] = {}

    def teacher_model_cfg(self):
        return self.config.model.model_copy(update={"name_or_path": self.section.teacher, "revision": None,
                                                    "quantization": None})

    def frozen_models(self):
        from hfsdp.model.loading import architecture_config

        cfg = self.teacher_model_cfg()
        teacher = self.section.teacher
        with as_teacher():
            model_config = architecture_config(teacher, cfg, Path(self.cache_dir))
        return [FrozenModel(teacher, model_config, cfg.dtype)]

    def batch_plan(self, dataset, train_config, world_size, mixture):
        from hfsdp.model.loading import load_model_config, resolve_model_path

        cfg = self.teacher_model_cfg()
        with as_teacher():
            self.teacher_path = resolve_model_path(self.section.teacher, Path(self.cache_dir))
        student = load_model_config(resolve_model_path(self.config.model.name_or_path, Path(self.cache_dir)),
                                    self.config.model)
        check_teacher(self.teacher_path, student, self.tokenizer, cfg)  # before any weight loads
        return super().batch_plan(dataset, train_config, world_size, mixture)

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        from hfsdp.model.loading import accepts_logits_to_keep, load_model

        teacher = load_model(self.teacher_path, self.teacher_model_cfg())
        teacher.requires_grad_(False)
        teacher.eval()
        self.teacher_selects = accepts_logits_to_keep(teacher)
        if self.pack_segments:  # the packed rows' sequences attended one at a time, as the student's
            from hfsdp.model.packed_attention import use_sequence_sdpa

            use_sequence_sdpa(teacher)
        teacher.to(accelerator.device)
        self.sharded = accelerator.num_processes > 1 and self.config.fsdp.version == 2
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            from hfsdp.model.loading import default_layer_classes

            mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
            classes = set(default_layer_classes(teacher.config))
            for module in teacher.modules():
                if type(module).__name__ in classes:
                    fully_shard(module, mesh=mesh)
            fully_shard(teacher, mesh=mesh)
        self.teacher = teacher
        where = (f"sharded over {accelerator.num_processes} ranks (FSDP2)" if self.sharded
                 else "whole on each rank" if accelerator.num_processes > 1 else "whole")
        mine = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in teacher.parameters())
        accelerator.print(f"distill: teacher {self.section.teacher} loaded frozen, {where}: {mine:,} of its "
                          f"{sum(p.numel() for p in teacher.parameters()):,} parameters on rank 0")
        return splits

    @torch.no_grad()
    def teacher_logits(self, batch) -> torch.Tensor:
        inputs = dict(batch.inputs)
        keep = inputs.pop("logits_to_keep", None)
        if keep is not None and self.teacher_selects:
            return self.teacher(**inputs, logits_to_keep=keep).logits
        logits = self.teacher(**inputs).logits
        return logits if keep is None else logits[:, keep]

    def loss(self, model, batch) -> torch.Tensor:
        s = self.section
        teacher = self.teacher_logits(batch)
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
