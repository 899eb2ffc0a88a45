"""The reference routes of the objectives that pull towards a reference model (DPO's, KTO's): the base with the
adapters disabled (``adapter``), or log-probs computed once from the base weights before training and cached
(``precomputed``), as :class:`ReferenceRoutes`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from hfsdp.errors import UserError
from hfsdp.objective import PreferenceObjective, adapters_disabled

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
