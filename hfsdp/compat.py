"""Former module paths of the documented plugin API, still importable: a plugin written against them keeps working.

Each former path imports as a module holding the names of the module that replaced it, with a DeprecationWarning
that names the new path. Only what docs/plugins.md and the hook specs named is here; hfsdp's own code uses the new
paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

FORMER = {
    "hfsdp.batches": "hfsdp.data.batches",
    "hfsdp.builtin.dpo_loss": "hfsdp.builtin.dpo.loss",
    "hfsdp.builtin.online.sampler": "hfsdp.builtin.online.objective",
    "hfsdp.builtin.tool_calls": "hfsdp.builtin.chat.tool_calls",
    "hfsdp.components.export": "hfsdp.export.hf_folder",
    "hfsdp.components.hf_folder": "hfsdp.export.hf_folder",
    "hfsdp.distributed": "hfsdp.parallel.world",
    "hfsdp.hookspecs": "hfsdp.hooks.specs",
    "hfsdp.run_setup": "hfsdp.setup.decide",
    "hfsdp.run.setup": "hfsdp.setup.decide",
    "hfsdp.train": "hfsdp.run.loop",
}
# Packages that only held former modules.
_FORMER_PACKAGES = {"hfsdp.components"}


class _Former(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in FORMER or name in _FORMER_PACKAGES:
            return importlib.machinery.ModuleSpec(name, self, is_package=name in _FORMER_PACKAGES)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ in _FORMER_PACKAGES:
            return
        new = FORMER[module.__name__]
        warnings.warn(f"{module.__name__} is now {new}; import from there", DeprecationWarning, stacklevel=2)
        real = importlib.import_module(new)
        module.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})


def install() -> None:
    if not any(isinstance(finder, _Former) for finder in sys.meta_path):
        sys.meta_path.append(_Former())
