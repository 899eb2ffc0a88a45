"""The rule table and its rules, torch-free: every check of a config before anything loads, by phase
(:mod:`~hfsdp.rules.table`: the config alone, the data it names, the launched world and its degrees, a trial of its
values on torch, the model's architecture and tokenizer), used alike by ``hfsdp validate``, ``hfsdp train`` before it
decides the run (:mod:`hfsdp.setup`), ``hfsdp plan``, ``hfsdp bench`` and ``hfsdp export``: the FSDP options beside
the degrees and CPU rehearsal (:mod:`~hfsdp.rules.wrapping`), the 4-bit base (:mod:`~hfsdp.rules.quantization`),
attention kernels (:mod:`~hfsdp.rules.attention`), the optimizer (:mod:`~hfsdp.rules.optimizers`), what tensor and
sequence parallelism need of the config and the model (:mod:`~hfsdp.rules.parallel`), asynchronous saves
(:mod:`~hfsdp.rules.checkpoints`), the data's formats (:mod:`~hfsdp.rules.formats`) and what a model name can be
(:mod:`~hfsdp.rules.models`: a misspelt built-in one, a hub id offline); plugins add theirs through ``hfsdp_rules``.
Nothing here imports torch, transformers or accelerate, but the ``trial`` phase when it runs."""
