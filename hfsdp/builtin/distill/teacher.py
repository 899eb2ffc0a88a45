"""The frozen teacher of the distillation objectives (``distill``'s off-policy one, ``distill_online``'s on-policy
one): resolved and checked against the student (the same vocabulary size and the same tokenizer vocabulary) before
any weight loads (:meth:`Teacher.check`), loaded after the student is sharded (:meth:`Teacher.load`) in
``model.dtype``, put in eval mode with ``requires_grad`` False, and, on several ranks under FSDP2, sharded with
``fully_shard`` per decoder layer and at its root (so each rank keeps its share of the teacher's weights, as of the
student's). It runs under ``no_grad`` on the student's inputs (:meth:`Teacher.logits`), micro-batch by micro-batch
(every rank runs as many, so its collectives stay in lock-step). Its logits are exact: no top-k truncation, nothing
cached. Its errors name the config key that gave it (``key``: ``distill.teacher``...).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from hfsdp.errors import UserError
from hfsdp.objective import FrozenModel


class Teacher:
    def __init__(self, name: str, key: str, config, tokenizer, cache_dir):
        self.name, self.key, self.config, self.tokenizer, self.cache_dir = name, key, config, tokenizer, cache_dir
        self.model = None
        self.path: str | None = None
        self.selects = False  # it takes logits_to_keep
        self.sharded = False

    @contextlib.contextmanager
    def said(self):
        """The model loaders' errors, said of ``model.name_or_path``, said of the teacher's key."""
        try:
            yield
        except UserError as err:
            raise UserError(f"{self.key}: {str(err).split(': ', 1)[1]}") from None

    def model_cfg(self):
        return self.config.model.model_copy(update={"name_or_path": self.name, "revision": None,
                                                    "quantization": None})

    def frozen_model(self) -> FrozenModel:
        from hfsdp.model.loading import architecture_config

        cfg = self.model_cfg()
        with self.said():
            model_config = architecture_config(self.name, cfg, Path(self.cache_dir))
        return FrozenModel(self.name, model_config, cfg.dtype)

    def check(self) -> None:
        """A UserError, before any weight loads, if the teacher cannot teach this student token by token."""
        from hfsdp.model.loading import load_model_config, load_tokenizer, resolve_model_path

        cfg = self.model_cfg()
        with self.said():
            self.path = resolve_model_path(self.name, Path(self.cache_dir))
            teacher_config = load_model_config(self.path, cfg)
            theirs = load_tokenizer(self.path, cfg)
        student = load_model_config(resolve_model_path(self.config.model.name_or_path, Path(self.cache_dir)),
                                    self.config.model)
        if teacher_config.vocab_size != student.vocab_size:
            raise UserError(f"{self.key}: its vocabulary has {teacher_config.vocab_size} entries, the student's "
                            f"{student.vocab_size}: the teacher must use the student's tokenizer")
        if theirs.get_vocab() != self.tokenizer.get_vocab():
            raise UserError(f"{self.key}: its tokenizer differs from the student's (other tokens or ids): the "
                            "teacher must use the student's tokenizer")

    def load(self, accelerator, pack_segments: bool) -> None:
        """Load, freeze and (several ranks, FSDP2) shard the teacher; say where it is."""
        from hfsdp.model.loading import accepts_logits_to_keep, load_model

        teacher = load_model(self.path, self.model_cfg())
        teacher.requires_grad_(False)
        teacher.eval()
        self.selects = accepts_logits_to_keep(teacher)
        if pack_segments:  # the packed rows' sequences attended one at a time, as the student's
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
        self.model = teacher
        where = (f"sharded over {accelerator.num_processes} ranks (FSDP2)" if self.sharded
                 else "whole on each rank" if accelerator.num_processes > 1 else "whole")
        mine = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in teacher.parameters())
        plugin = self.key.split(".")[0]
        accelerator.print(f"{plugin}: teacher {self.name} loaded frozen, {where}: {mine:,} of its "
                          f"{sum(p.numel() for p in teacher.parameters()):,} parameters on rank 0")

    @torch.no_grad()
    def logits(self, batch) -> torch.Tensor:
        inputs = dict(batch.inputs)
        keep = inputs.pop("logits_to_keep", None)
        if keep is not None and self.selects:
            return self.model(**inputs, logits_to_keep=keep).logits
        logits = self.model(**inputs).logits
        return logits if keep is None else logits[:, keep]
