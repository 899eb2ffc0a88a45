"""The training config: its schema (pydantic sections, ``extra="forbid"``), its validation, the config files
(YAML, presets, ``base:`` chains, ``--set``), the data paths it names, and the generated reference.

Torch-free: ``hfsdp validate`` and ``--help`` import this package and :mod:`hfsdp.rules` only.
"""

from hfsdp.config.schema import Section  # the documented plugin-section base class (``hfsdp.config.Section``)

__all__ = ["Section"]
