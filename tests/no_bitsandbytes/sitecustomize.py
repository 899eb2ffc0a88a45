"""Test-only: with this folder on PYTHONPATH, Python starts as if bitsandbytes were not installed (an import finder
that answers "no such module" for it), so the bad-input test sees what a user without it sees."""

import sys


class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return None


sys.meta_path.insert(0, _Hide())
