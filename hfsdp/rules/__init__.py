"""The torch-free rules layer: what a config and a world decide before anything loads, used alike by validation,
``RunSetup``, ``hfsdp plan`` and ``hfsdp bench``: what wraps the model and how its elements are copied
(:mod:`~hfsdp.rules.wrapping`), the 4-bit base (:mod:`~hfsdp.rules.quantization`), attention kernels
(:mod:`~hfsdp.rules.attention`), where each optimizer can run (:mod:`~hfsdp.rules.optimizers`) and what tensor
parallelism needs of the config, the world and the model (:mod:`~hfsdp.rules.parallel`). Nothing
here imports torch, transformers or accelerate."""
