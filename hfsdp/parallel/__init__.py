"""Parallelism with torch: the process group's backend and collectives (:mod:`~hfsdp.parallel.world`), the
Accelerate FSDP plugin built from the ``fsdp:`` section (:mod:`~hfsdp.parallel.fsdp`), hfsdp's size wrap policy, the
Accelerator and the prepared model (:mod:`~hfsdp.parallel.accelerator`), the run's one device mesh
(:mod:`~hfsdp.parallel.mesh`), tensor parallelism's split layers (:mod:`~hfsdp.parallel.tensor`), sequence
parallelism's split rows and the all-to-all around attention (:mod:`~hfsdp.parallel.sequence`), expert
parallelism's split experts and their FSDP2 units (:mod:`~hfsdp.parallel.expert_parallel`), QLoRA's 4-bit base
once sharded (:mod:`~hfsdp.parallel.quantized_base`: the start-up probe, what it costs a rank), and launcher helpers.
They read the run's degrees and the wrapper they make (:class:`hfsdp.layout.degrees.ParallelDims`); the rules they
follow (what tensor, sequence and expert parallelism allow) are torch-free, in :mod:`hfsdp.rules.wrapping` and
:mod:`hfsdp.rules.parallel`."""
