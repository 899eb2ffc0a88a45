"""The host's disk, torch-free: writes that survive a crash (:mod:`~hfsdp.disk.durable`), free space and a full
disk recognised (:mod:`~hfsdp.disk.space`), one run per output folder (:mod:`~hfsdp.disk.lock`), and a run folder's
checkpoints: the complete ones, the latest, a record read back (:mod:`~hfsdp.disk.checkpoints`). Checkpoints, the
data cache and exports all write through it."""
