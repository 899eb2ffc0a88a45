"""Deprecated name of :mod:`hfsdp.components.hf_folder` (the Hugging Face folder writer), kept so that plugins
written against the guide's ``hfsdp.components.export.write_hf_folder`` / ``ModelFiles`` keep working."""

import warnings

from hfsdp.components.hf_folder import ModelFiles, write_hf_folder

warnings.warn("hfsdp.components.export is now hfsdp.components.hf_folder; import write_hf_folder and ModelFiles "
              "from there", DeprecationWarning, stacklevel=2)

__all__ = ["ModelFiles", "write_hf_folder"]
