"""The commands beside training: ``hfsdp plan`` (:mod:`~hfsdp.tools.plan`), ``hfsdp bench``
(:mod:`~hfsdp.tools.bench`) and ``hfsdp eval`` (:mod:`~hfsdp.tools.harness`: lm-evaluation-harness on an exported
model, sharded over the ranks; its bundled task in ``eval_tasks/``). ``hfsdp plot`` draws with
:mod:`hfsdp.run.plots`, which also draws a run's own loss plot."""
