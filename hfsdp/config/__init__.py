"""The training config: its schema (pydantic sections, ``extra="forbid"``), its validation by the schemas (the
core's and the enabled plugins' sections), the config files (YAML, presets, ``base:`` chains, ``--set``), the data
paths it names, and the generated reference. The rules across sections are :mod:`hfsdp.rules`'s, which read it.

Torch-free: ``hfsdp validate --no-rows`` and ``--help`` import this package and :mod:`hfsdp.rules` only.
"""

from hfsdp.config.schema import Section  # the documented plugin-section base class (``hfsdp.config.Section``)

__all__ = ["Section"]
