"""Checkpoints with torch: the store that writes them (the save phases every rank agrees on, pruning:
:mod:`~hfsdp.checkpoint.store`), reading them without running a checkpoint's code, its weights one tensor at a time
included (:mod:`~hfsdp.checkpoint.safe_load`), and resume's last phase, loading one (:mod:`~hfsdp.checkpoint.resume`).
The folder layout, the record and the resume point, decided before anything loads, are :mod:`hfsdp.setup.record`'s;
their durable writes, free space and run lock are :mod:`hfsdp.disk`'s."""
