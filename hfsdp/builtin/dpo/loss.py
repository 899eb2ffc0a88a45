"""The DPO objective of plugin ``dpo`` (:mod:`hfsdp.builtin.dpo`).

The loss of a pair, with ``d = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`` (summed
completion log-probs): sigmoid ``-(1-e) log sigmoid(beta d) - e log sigmoid(-beta d)``; hinge ``relu(1 - beta d)``;
ipo ``(d' - 1/(2 beta))^2`` with each log-ratio divided by its completion's tokens (as TRL). The step's loss is the
mean over the global batch's pairs (hfsdp's normalisation, with pairs as the units), whatever the split over ranks
and micro-batches. Chosen and rejected sequences go through the model in one forward.

The reference is never a second copy of the model:

* ``adapter`` (LoRA): the base model, by running the same micro-batch with the adapters disabled (peft's
  ``disable_adapter``) without gradients, just before the policy's forward;
* ``precomputed`` (full fine-tuning; also with LoRA): every row's reference log-probs are computed once after the
  model is sharded, before training and before a resume restores a checkpoint (so from the base weights; with LoRA
  with the adapters disabled), and cached under the cache folder, keyed by the model files' contents, the tokenized
  rows and the model settings; every epoch (and every later run on the same data and model) reads them back.

Metrics (each step, in ``metrics.jsonl``, the trackers and, the margin and accuracy, the progress bar; on the eval
split prefixed ``eval_``): ``rewards/chosen`` and ``rewards/rejected`` (``beta`` times the log-ratio),
``rewards/margins``, ``rewards/accuracy`` (share of pairs whose chosen reward is higher), ``logps/chosen``,
``logps/rejected``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hfsdp.errors import UserError
from hfsdp.objective import PairBatch, PreferenceObjective, adapters_disabled

if TYPE_CHECKING:
    from hfsdp.builtin.dpo.schema import DpoSection

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's names


def weights_identity(model_path: str, config) -> str:
    """A digest of the model's weight files (their names and contents), or of its hub id and revision."""
    digest = hashlib.sha256()
    folder = Path(model_path)
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")) if folder.is_dir() else []
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    if not files:
        digest.update(f"{model_path}@{config.model.revision}".encode())
    return digest.hexdigest()


class ReferenceRoutes(PreferenceObjective):
    """The reference routes of a preference objective against a reference model (DPO's; KTO's,
    ``hfsdp.builtin.kto.loss``): ``adapter`` or ``precomputed``, whose two log-probs per row (those
    :meth:`completion_logps` returns: the first and second half of the micro-batch) become the columns
    :attr:`reference_columns`; :attr:`plugin` names the messages' plugin and config section."""

    plugin = "dpo"
    reference_columns = REFERENCE_COLUMNS
    units = "pairs"  # what a row is, in the messages

    def __init__(self, section, reference: str, config, tokenizer):
        super().__init__()
        self.section, self.reference, self.config, self.tokenizer = section, reference, config, tokenizer
        self.unwrapped = None

    def base_only(self):
        """The reference's context: the adapters disabled (a LoRA model), else nothing to change."""
        return adapters_disabled(self.unwrapped)

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        self.unwrapped = accelerator.unwrap_model(model)
        if self.reference == "adapter" and not hasattr(self.unwrapped, "disable_adapter"):
            raise UserError(f"{self.plugin}.reference: adapter needs a model with adapters (the lora plugin's)")
        if self.reference != "precomputed":
            return splits
        identity = weights_identity(model_path, self.config)
        return {name: self._with_reference(model, accelerator, split, Path(cache_dir), identity, name)
                for name, split in splits.items()}

    def _with_reference(self, model, accelerator, split, cache_dir: Path, identity: str, name: str):
        from hfsdp.data.batches import identity as rows_identity
        from hfsdp.parallel.world import any_rank

        key = hashlib.sha256(json.dumps([identity, rows_identity(split), self.config.model.model_dump(mode="json"),
                                         self.config.fsdp.mixed_precision, sorted(self.config.plugins),
                                         self.config.plugin_config.get("lora"), self.plugin], sort_keys=True, default=str
                                        ).encode()).hexdigest()[:20]
        path = cache_dir / "reference" / f"{key}.json"
        if not any_rank(accelerator, not path.is_file()):
            values = json.loads(path.read_text())
            accelerator.print(f"{self.plugin}: reference log-probs of the {name} split read from the cache ({path})")
        else:
            values = self._compute(model, accelerator, split, name)
            if accelerator.is_main_process:
                from hfsdp.disk.durable import write_atomic

                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps(values))
            accelerator.wait_for_everyone()
        for column, column_values in zip(self.reference_columns, values):
            split = split.add_column(column, column_values)
        return split

    @torch.no_grad()
    def _compute(self, model, accelerator, split, name: str) -> list[list[float]]:
        """[first, second] reference log-probs of each row (DPO: chosen, rejected), each rank computing its share (collective)."""
        from hfsdp.data.batches import eval_batches, reshard
        from hfsdp.parallel.world import gather_objects

        from hfsdp.model.loading import accepts_logits_to_keep

        cfg = self.config.train
        select = accepts_logits_to_keep(self.unwrapped)
        mine: dict[int, tuple[float, float]] = {}
        batches = eval_batches(len(split), cfg.per_device_batch_size, accelerator.num_processes,
                               accelerator.process_index)
        accelerator.print(f"{self.plugin}: computing the reference log-probs of the {name} split ({len(split)} {self.units})")
        was_training = model.training
        model.eval()
        try:
            for rows in batches:
                batch = self.micro_batch([split[i] for i in (rows or [0])], self.tokenizer.pad_token_id,
                                         accelerator.device, select)
                with self.base_only():
                    chosen, rejected = self.completion_logps(model, batch)
                for k, i in enumerate(rows or []):
                    mine[i] = (float(chosen[k]), float(rejected[k]))
        finally:
            model.train(was_training)
            reshard(model)
        merged = {i: v for part in gather_objects(accelerator, mine) for i, v in part.items()}
        return [[merged[i][0] for i in range(len(split))], [merged[i][1] for i in range(len(split))]]


class DPO(ReferenceRoutes):

    def loss(self, model, batch: PairBatch) -> torch.Tensor:
        s: DpoSection = self.section
        if self.reference == "precomputed":
            ref_chosen, ref_rejected = (batch.values[c] for c in REFERENCE_COLUMNS)
        else:  # the base's log-probs of the same micro-batch, before the policy's forward
            with torch.no_grad(), self.base_only():
                ref_chosen, ref_rejected = self.completion_logps(model, batch)
        chosen, rejected = self.completion_logps(model, batch)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        if s.loss_type == "sigmoid":
            per_pair = (-(1 - s.label_smoothing) * F.logsigmoid(s.beta * delta)
                        - s.label_smoothing * F.logsigmoid(-s.beta * delta))
        elif s.loss_type == "hinge":
            per_pair = torch.relu(1 - s.beta * delta)
        else:  # ipo, with each log-ratio per completion token (as TRL)
            tokens = batch.completion_tokens.clamp(min=1).float()
            per_pair = (chosen_ratio / tokens[:batch.pairs] - rejected_ratio / tokens[batch.pairs:]
                        - 1 / (2 * s.beta)) ** 2
        chosen_reward, rejected_reward = s.beta * chosen_ratio, s.beta * rejected_ratio
        self.record(batch, **{"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
                              "rewards/margins": chosen_reward - rejected_reward,
                              "rewards/accuracy": (chosen_reward > rejected_reward).float(),
                              "logps/chosen": chosen, "logps/rejected": rejected})
        return (per_pair * batch.weights).sum()
