"""One training run, in the order it happens (the run itself decided before, by :mod:`hfsdp.setup`): its set-up,
step by step (:mod:`~hfsdp.run.build`), the loop (:mod:`~hfsdp.run.loop`), its step (:mod:`~hfsdp.run.step`),
evaluation, the optimizer and LR schedule, generation eval, and what the run reports (start-up, metrics, throughput,
the summary, the final export and the loss plot)."""
