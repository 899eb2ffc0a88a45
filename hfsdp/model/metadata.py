"""What a model folder holds besides its weights: :class:`ModelFiles` (the config, generation config and tokenizer
files, and the tensor shapes an export checks the weights against), the architecture's expected shapes, and a
folder's generation config. Checkpoints record them at every save and exports write them
(:mod:`hfsdp.export.hf_folder`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable


def expected_shapes(model_config) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes of the architecture, from a model built on the meta device."""
    from hfsdp.model.loading import meta_model

    return {name: tuple(t.shape) for name, t in meta_model(model_config).state_dict().items()}


SHAPES_NAME = "hfsdp_model_shapes.json"  # in a checkpoint's model/: what an export checks, without transformers


class ModelFiles:
    """A model's files other than its weights (config, generation config, tokenizer), and what an export checks
    the weights against: the architecture's tensor shapes and whether the output embedding is tied.

    :meth:`of` wraps the transformers objects of a training run; :meth:`in_folder` a checkpoint's ``model/`` folder,
    whose files are copied as they are and whose shapes hfsdp recorded at save time, so that exporting a checkpoint
    needs no transformers import (a checkpoint without the record falls back to transformers)."""

    def __init__(self, save, expected: dict[str, tuple[int, ...]], tied: bool):
        self.save = save  # save(out_dir): write the files
        self.expected = expected
        self.tied = tied

    @classmethod
    def of(cls, model_config, tokenizer, generation_config=None) -> "ModelFiles":
        def save(out_dir: Path) -> None:
            model_config.save_pretrained(out_dir)
            if generation_config is not None:
                generation_config.save_pretrained(out_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)

        return cls(save, expected_shapes(model_config), bool(getattr(model_config, "tie_word_embeddings", False)))

    @classmethod
    def in_folder(cls, folder: Path, keep: Callable[[str], bool] = lambda name: True) -> "ModelFiles":
        """``keep``: the names of the files to copy (a folder that also holds weights: not those)."""
        def save(out_dir: Path) -> None:
            for path in sorted(folder.iterdir()):
                if path.is_file() and path.name != SHAPES_NAME and keep(path.name):
                    shutil.copyfile(path, out_dir / path.name)

        record = folder / SHAPES_NAME
        if record.is_file():
            plan = json.loads(record.read_text())
            return cls(save, {k: tuple(v) for k, v in plan["shapes"].items()}, bool(plan["tie_word_embeddings"]))
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(str(folder))
        return cls(save, expected_shapes(model_config), bool(getattr(model_config, "tie_word_embeddings", False)))

    def record(self, folder: Path) -> None:
        """Write what :meth:`in_folder` reads back (into a checkpoint's ``model/``)."""
        (folder / SHAPES_NAME).write_text(json.dumps(
            {"tie_word_embeddings": self.tied, "shapes": {k: list(v) for k, v in self.expected.items()}}))


def model_metadata(model_dir: str | Path) -> dict[str, Any]:
    """The generation config of a model folder, if it has one."""
    from transformers import GenerationConfig

    try:
        return {"generation_config": GenerationConfig.from_pretrained(str(model_dir))}
    except OSError:
        return {"generation_config": None}
