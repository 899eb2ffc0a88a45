"""The plugin hooks: their specs (:mod:`~hfsdp.hooks.specs`, docstring-only, pluggy's ``hfsdp`` project) and the
host that discovers plugins through the ``hfsdp`` entry-point group and calls them (:mod:`~hfsdp.hooks.host`)."""
