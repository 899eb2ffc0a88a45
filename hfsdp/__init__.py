"""hfsdp: fine-tune Hugging Face causal language models with PyTorch FSDP through Accelerate.

Importing this package stays cheap (no torch): the CLI answers --help and validate without it.
"""

import pluggy

from hfsdp import compat

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("hfsdp")
"""Mark a function as an hfsdp hook implementation (see :mod:`hfsdp.hooks.specs`)."""

IGNORE_INDEX = -100
"""The label of a token that carries no loss (PyTorch's ``cross_entropy`` default ``ignore_index``)."""

REJECTED_PREFIX = "rejected_"
"""The prefix of the rejected sequence's columns of a ``preference`` row (``rejected_input_ids``,
``rejected_labels``, a vision-language processor's ``rejected_mm_token_type_ids``); the chosen one's are unprefixed,
and the images (the prompt's) one ``images`` column for both."""

__all__ = ["IGNORE_INDEX", "REJECTED_PREFIX", "__version__", "hookimpl"]

compat.install()  # the former module paths of the documented plugin API (hfsdp.compat)
