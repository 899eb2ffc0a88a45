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
    run = _preset_run(name)
    if run is not None:
        return (f"{name} does not exist: it is what `hfsdp train {run}` writes (the {run} preset's final weights); "
                f"run that first, from this folder, or point model.name_or_path at a run of it")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return f"{name} does not exist; give a Hugging Face folder, a hub id (owner/name), or a built-in model ({builtin})"
    return None


def _preset_run(name: str) -> str | None:
    """The bundled preset whose run writes ``name`` (``runs/<preset>/final``, its output_dir's final weights, as a
    preset that starts from another's names it), or None."""
    from hfsdp.config.files import list_presets

    parts = Path(name).parts
    if len(parts) == 3 and parts[0] == "runs" and parts[2] == "final" and parts[1] in list_presets():
        return parts[1]
    return None


def problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    problem = model_name_problem(config.model.name_or_path)
    return [("model.name_or_path", problem)] if problem else []
