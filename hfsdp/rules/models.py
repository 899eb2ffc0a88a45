"""What ``model.name_or_path`` can name, from the name alone (torch-free, no network): a built-in model, a local
folder, or a hub id (``owner/name``, or a legacy bare name); a name a letter or two away from a built-in one is a
typo, said with the name meant (``did you mean``), before anything spends time on the hub."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from hfsdp.config.schema import BUILTIN_MODEL_NAMES

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


def model_name_problem(name: str) -> str | None:
    """What is wrong with the model name ``name``, if anything (None: a built-in model, a folder that exists, or what
    may be a hub id)."""
    if name in BUILTIN_MODEL_NAMES or Path(name).expanduser().exists():
        return None
    builtin = f"built-in models: {', '.join(BUILTIN_MODEL_NAMES)}"
    close = difflib.get_close_matches(name.lower(), BUILTIN_MODEL_NAMES, n=1, cutoff=0.8)
    if close:
        return f"'{name}' is not a built-in model: did you mean {close[0]}? ({builtin})"
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return f"{name} does not exist; give a Hugging Face folder, a hub id (owner/name), or a built-in model ({builtin})"
    return None


def problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    problem = model_name_problem(config.model.name_or_path)
    return [("model.name_or_path", problem)] if problem else []
