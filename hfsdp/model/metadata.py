"""What a model folder holds besides its weights: :class:`ModelFiles` (the config, generation config and tokenizer
files, and the tensor shapes an export checks the weights against), the architecture's expected shapes, and a
folder's generation config. Checkpoints record them at every save and exports write them
(:mod:`hfsdp.export.hf_folder`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from hfsdp.data.images import processor_of
from hfsdp.model import vision


def _shapes(model) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes of a model (built on the meta device)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


class SavedLayout:
    """The layout transformers' ``save_pretrained`` writes an architecture's weights in, where it differs from the
    model's own: the reverse of the conversion its ``from_pretrained`` applies (a mixture of experts' fused expert
    weights written back as one tensor per expert and projection, as the hub holds them), one tensor at a time.
    :meth:`of` is None where the architecture converts nothing."""

    def __init__(self, model):
        self._model = model  # on the meta device

    @classmethod
    def of(cls, model) -> "SavedLayout | None":
        """The layout of ``model`` (on the meta device), or None."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        converts = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
        return cls(model) if converts else None

    def __call__(self, name: str, tensor) -> dict[str, Any]:
        """The tensors ``save_pretrained`` writes for the model's tensor ``name``."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self._model, {name: tensor})

    def names(self, name: str) -> list[str]:
        """The names ``save_pretrained`` writes the model's tensor ``name`` under (a vision-language model's output
        head: ``language_model.lm_head.weight`` for Gemma 3)."""
        state = self._model.state_dict()
        return list(self(name, state[name])) if name in state else [name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The saved tensors' shapes."""
        from transformers.core_model_loading import revert_weight_conversion

        return {name: tuple(t.shape) for name, t in revert_weight_conversion(
            self._model, dict(self._model.state_dict())).items()}


SHAPES_NAME = "hfsdp_model_shapes.json"  # in a checkpoint's model/: what an export checks, without transformers


class ModelFiles:
    """A model's files other than its weights (config, generation config, tokenizer), and what an export checks
    the weights against: the architecture's tensor shapes and whether the output embedding is tied.

    :meth:`of` wraps the transformers objects of a training run; :meth:`in_folder` a checkpoint's ``model/`` folder,
    whose files are copied as they are and whose shapes hfsdp recorded at save time, so that exporting a checkpoint
    needs no transformers import (a checkpoint without the record falls back to transformers)."""

    def __init__(self, save, expected: dict[str, tuple[int, ...]], tied: bool, layout: "SavedLayout | None" = None):
        self.save = save  # save(out_dir): write the files
        self.expected = expected
        self.tied = tied
        self.layout = layout  # the architecture's saved layout, where it has one: exports write it

    @classmethod
    def of(cls, model_config, tokenizer, generation_config=None) -> "ModelFiles":
        def save(out_dir: Path) -> None:
            model_config.save_pretrained(out_dir)
            if generation_config is not None:
                generation_config.save_pretrained(out_dir)
            if processor_of(tokenizer) is not None:  # (it writes its tokenizer's files too)
                vision.save_processor(processor_of(tokenizer), out_dir, tokenizer.chat_template)
            elif tokenizer is not None:
                tokenizer.save_pretrained(out_dir)

        return cls.of_architecture(save, model_config)

    @classmethod
    def of_architecture(cls, save, model_config) -> "ModelFiles":
        """``save`` with what the architecture of ``model_config`` implies: its shapes, tied embeddings and saved
        layout, from one model built on the meta device."""
        from hfsdp.model.loading import meta_model

        model = meta_model(model_config)
        return cls(save, _shapes(model), bool(getattr(model_config, "tie_word_embeddings", False)),
                   SavedLayout.of(model))

    @classmethod
    def in_folder(cls, folder: Path, keep: Callable[[str], bool] = lambda name: True) -> "ModelFiles":
        """``keep``: the names of the files to copy (a folder that also holds weights: not those)."""
        def save(out_dir: Path) -> None:
            for path in sorted(folder.iterdir()):
                if path.is_file() and path.name != SHAPES_NAME and keep(path.name):
                    shutil.copyfile(path, out_dir / path.name)

        record = folder / SHAPES_NAME
        plan = json.loads(record.read_text()) if record.is_file() else None
        if plan is not None and not plan.get("saved_layout", True):  # (a record before saved_layout: asked below)
            return cls(save, {k: tuple(v) for k, v in plan["shapes"].items()}, bool(plan["tie_word_embeddings"]))
        from transformers import AutoConfig

        return cls.of_architecture(save, AutoConfig.from_pretrained(str(folder)))

    def record(self, folder: Path) -> None:
        """Write what :meth:`in_folder` reads back (into a checkpoint's ``model/``): the shapes, and whether the
        architecture has a saved layout (then the export asks transformers for it)."""
        (folder / SHAPES_NAME).write_text(json.dumps(
            {"tie_word_embeddings": self.tied, "shapes": {k: list(v) for k, v in self.expected.items()},
             "saved_layout": self.layout is not None}))


def model_metadata(model_dir: str | Path) -> dict[str, Any]:
    """The generation config of a model folder, if it has one."""
    from transformers import GenerationConfig

    try:
        return {"generation_config": GenerationConfig.from_pretrained(str(model_dir))}
    except OSError:
        return {"generation_config": None}
