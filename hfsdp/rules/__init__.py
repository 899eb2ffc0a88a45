"""The torch-free rules: what a config and a world decide before anything loads, used alike by validation, the
decided run (:mod:`hfsdp.setup`), ``hfsdp plan`` and ``hfsdp bench``: what wraps the model
(:mod:`~hfsdp.rules.wrapping`), the 4-bit base (:mod:`~hfsdp.rules.quantization`), attention kernels
(:mod:`~hfsdp.rules.attention`), whether and where each optimizer can run (:mod:`~hfsdp.rules.optimizers`) and what
tensor parallelism needs of the config, the world and the model (:mod:`~hfsdp.rules.parallel`), and what a model name
can be (:mod:`~hfsdp.rules.models`: a misspelt built-in one). Nothing here imports torch, transformers or
accelerate."""
