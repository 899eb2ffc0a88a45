"""Test-only: with this folder on PYTHONPATH, Python starts as if bitsandbytes were not installed
(``importlib.util.find_spec`` answers None for a module whose ``sys.modules`` entry is None, and importing it
fails), so tests see what a user without it sees."""

import sys

sys.modules["bitsandbytes"] = None
