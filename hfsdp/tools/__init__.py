"""The commands beside training: ``hfsdp plan`` (:mod:`~hfsdp.tools.plan`) and ``hfsdp bench``
(:mod:`~hfsdp.tools.bench`). ``hfsdp plot`` draws with :mod:`hfsdp.run.plots`, which also draws a run's own loss
plot."""
