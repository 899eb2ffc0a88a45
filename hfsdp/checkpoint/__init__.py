"""Checkpoints: the store (folders, records, the save phases every rank agrees on, pruning:
:mod:`~hfsdp.checkpoint.store`), resume (:mod:`~hfsdp.checkpoint.resume`), loading without running a checkpoint's
code (:mod:`~hfsdp.checkpoint.safe_load`). Their durable writes, free space and run lock are :mod:`hfsdp.disk`'s."""
