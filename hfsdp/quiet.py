"""What hfsdp hides of its libraries' output (the CLI decides: ``--verbose`` or ``HFSDP_DEBUG`` shows everything),
kept here so that a process hfsdp starts (a generation process) hides the same: :func:`hidden` says whether this
process does."""

_hidden = False


def hidden() -> bool:
    """Whether :func:`hide_library_warnings` ran in this process."""
    return _hidden


def hide_library_warnings() -> None:
    """Hide warnings a user cannot act on (libraries' deprecations, Accelerate's OMP_NUM_THREADS notice, DCP's
    single-process note on export), in this process and in the processes it starts that ask :func:`hidden`."""
    global _hidden
    _hidden = True
    import logging
    import warnings

    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS/MKL_NUM_THREADS unset")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    # FSDP1's sharded optimizer-state load asks torch for a device in a way torch itself deprecated.
    warnings.filterwarnings("ignore", message="`_get_pg_default_device` will be deprecated")
    warnings.filterwarnings("ignore", message="Multiple backends are registered with this ProcessGroup")
    # FSDP1 on one process says it shards nothing (the start-up report says what runs) and returns full state dicts.
    warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD` instead of")
    warnings.filterwarnings("ignore", message="When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will")
    # Qwen-VL models return rope_deltas as a view (an unsqueeze); FSDP2 warns on every forward that an in-place op on
    # it would skip a hook, and hfsdp changes no output in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    # torch's notice about how Accelerate slices HYBRID_SHARD's mesh (every HYBRID_SHARD run, FSDP2).
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh will be deprecated")
    # Accelerate logs this for every plugin with a sharding_strategy, FSDP1's own (where it is not deprecated) too.
    logging.getLogger("accelerate.utils.dataclasses").addFilter(
        lambda record: not record.getMessage().startswith("sharding_strategy is deprecated in favor of"))
    # lm-eval on a model hfsdp loaded and sharded (hfsdp eval): its warnings are about models it loads itself, and
    # its note on custom task arguments is about its own command line
    for name, said in (("lm_eval.models.huggingface", "`pretrained` model kwarg is not of type `str`"),
                       ("lm_eval.models.huggingface", "Passed an already-initialized model through `pretrained`"),
                       ("lm_eval.api.task", "Custom kwargs can be passed to `--metadata`")):
        logging.getLogger(name).addFilter(lambda record, said=said: said not in record.getMessage())
    # A checkpoint of the model without a wrapper (one process) is written with safetensors, which keeps one of two
    # tied tensors (the input and output embeddings, tie_word_embeddings): the reload ties them again (a resume is
    # bit for bit: tests/test_resume.py).
    logging.getLogger("accelerate.utils.other").addFilter(
        lambda record: "Removed shared tensor" not in record.getMessage())
    # bitsandbytes on the CPU looks for an optional faster kernel package on import and falls back to its own.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community"))
    # ... through the kernels package, which says, with the hub offline (HF_HUB_OFFLINE), that it skips its check
    logging.getLogger("kernels._internals.hf_hub").addFilter(
        lambda record: not record.getMessage().startswith("Skipping publisher trust check for 'kernels-community/"))
