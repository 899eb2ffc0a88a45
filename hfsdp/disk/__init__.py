"""The host's disk, torch-free: writes that survive a crash (:mod:`~hfsdp.disk.durable`), free space and a full
disk recognised (:mod:`~hfsdp.disk.space`), and one run per output folder (:mod:`~hfsdp.disk.lock`). Checkpoints,
the data cache and exports all write through it."""
