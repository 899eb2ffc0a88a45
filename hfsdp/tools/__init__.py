"""The commands beside training: ``hfsdp plan`` (:mod:`~hfsdp.tools.plan`), ``hfsdp bench`` and ``hfsdp plot``."""
