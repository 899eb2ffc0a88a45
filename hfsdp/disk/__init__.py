"""The host's disk, torch-free: writes that survive a crash (:mod:`~hfsdp.disk.durable`), free space and a full
disk recognised (:mod:`~hfsdp.disk.space`), the file locks: one run per output folder, one process building a cache
entry (:mod:`~hfsdp.disk.lock`), a run folder's checkpoints: the complete ones, the latest, a record read back
(:mod:`~hfsdp.disk.checkpoints`), and the earlier run of a folder kept whole until the run replacing or continuing it
has done its first step (:mod:`~hfsdp.disk.aside`). Checkpoints, the data cache and exports all write through it."""
