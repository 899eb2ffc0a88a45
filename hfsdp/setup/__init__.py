"""The decided run, torch-free: a checkpoint's record and the resume point (:mod:`~hfsdp.setup.record`), and
:func:`~hfsdp.setup.decide.decide`, which makes them, the effective config and the world's degrees one
:class:`~hfsdp.setup.decide.RunSetup` before any weight loads (after the rule table checked the config against what it
runs on)."""
