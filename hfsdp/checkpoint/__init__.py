"""Checkpoints: the store (folders, records, the save phases every rank agrees on, pruning:
:mod:`~hfsdp.checkpoint.store`), resume (:mod:`~hfsdp.checkpoint.resume`), loading without running a checkpoint's
code (:mod:`~hfsdp.checkpoint.safe_load`), durable writes and the host's disk and run lock
(:mod:`~hfsdp.checkpoint.durable`, :mod:`~hfsdp.checkpoint.storage`)."""
