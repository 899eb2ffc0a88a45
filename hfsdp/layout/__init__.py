"""The run's layout on its ranks, torch-free: where a process is in the job (:class:`hfsdp.layout.degrees.World`)
and the parallel degrees in one value (:class:`hfsdp.layout.degrees.ParallelDims`: data-parallel replicas and
shards, sequence- and tensor-parallel groups, and the wrapper they make), derived from the config and the world,
validating itself. The rules (:mod:`hfsdp.rules`), the decided run (:mod:`hfsdp.setup`), the one device-mesh builder
(:mod:`hfsdp.parallel.mesh`), the batch plan, the checkpoint record and ``hfsdp plan`` all read the degrees from it.
"""
