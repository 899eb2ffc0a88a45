"""One training run, in the order it happens: the run decided once before any weight loads
(:mod:`~hfsdp.run.setup`), the loop (:mod:`~hfsdp.run.loop`), its step (:mod:`~hfsdp.run.step`), evaluation, the
loss, the optimizer and LR schedule, generation eval, and what the run reports (start-up, metrics, throughput)."""
