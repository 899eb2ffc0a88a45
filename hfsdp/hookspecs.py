"""Hook specifications: the whole plugin API of hfsdp.

Implement any subset in a module or class, mark each function with ``hfsdp.hookimpl``, and expose the module
through the ``hfsdp`` entry-point group (or name it by dotted path in the config's ``plugins:`` list).

Order: hfsdp calls implementations one plugin at a time, built-in plugins first, then the plugins in the order
of the config's ``plugins:`` list. "Chained" hooks hand each plugin the previous plugin's result.
Ranks: unless a hook says otherwise it runs on every rank, and a plugin that raises on any rank stops all ranks
with an error naming the plugin and the hook.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("hfsdp")


@hookspec
def hfsdp_config_section():
    """Declare this plugin's config section.

    Return ``(section_name, PydanticModelClass)`` or None. The top-level YAML key ``section_name`` is validated
    with the model (use ``extra="forbid"``); the validated object is ``config.section(section_name)``.
    Called once per process while the config is validated, before anything is loaded.
    """


@hookspec
def hfsdp_validate_config(config):
    """Check the validated config as a whole. Return a list of ``(yaml_path, message)`` problems, or None.

    Runs before any model or data is loaded; problems are reported together with the core's own.
    """


@hookspec
def hfsdp_dataset_formats():
    """Register dataset formats: return ``{format_name: tokenize}`` or None.

    ``tokenize(batch, tokenizer, data_config) -> {"input_ids": [[int]], "labels": [[int]]}`` receives a batch of
    raw rows (a dict of column lists, as ``datasets.map(batched=True)`` gives) and returns one tokenized sample
    per row; label -100 marks tokens without loss. Rows longer than ``data_config.max_seq_len`` are cut or dropped
    by hfsdp afterwards, so return them whole. Two plugins registering one name is a config error.
    """


@hookspec
def hfsdp_transform_dataset(dataset, config, tokenizer):
    """Chained: transform the tokenized ``datasets.DatasetDict`` (``train`` and maybe ``eval``).

    Return a new DatasetDict or None to keep it. Rows must keep ``input_ids`` and ``labels``; they may add
    ``position_ids`` (packing restarts them at each packed sample). Runs only when the preprocessing cache misses,
    on the main process (the other ranks read its cached result), so it must depend on nothing but its arguments.
    """


@hookspec
def hfsdp_modify_model(model, config, tokenizer):
    """Chained: change the model before it is sharded (e.g. add LoRA adapters, freeze layers).

    Runs on every rank, after loading and before ``accelerator.prepare``. Return the replacement model or None
    when the model was changed in place. Only parameters with ``requires_grad`` are given to the optimizer.
    """


@hookspec(firstresult=True)
def hfsdp_export(state_dict, model_config, tokenizer, out_dir, generation_config, config):
    """Write consolidated weights. The first plugin that returns a truthy value handles the export.

    ``state_dict`` maps names to full CPU tensors (as ``model.state_dict()`` of the unwrapped model would),
    ``model_config`` is the transformers config, ``generation_config`` the base model's (or None). ``out_dir`` is an
    empty temporary folder next to the destination: write the files there; hfsdp records them and renames the folder
    into place when the hook returns (and removes it if the hook raises). Runs on the main process only. The built-in implementation
    writes a Hugging Face folder with safetensors shards and runs last.
    """


@hookspec
def hfsdp_on_train_start(run):
    """Training is about to start; ``run`` is the :class:`hfsdp.train.Run` (config, accelerator, model, ...)."""


@hookspec
def hfsdp_on_step_end(run, step, metrics):
    """An optimizer step finished. ``metrics`` holds loss, lr, grad_norm, tokens and timing of this step."""


@hookspec
def hfsdp_on_eval(run, step, metrics):
    """An evaluation finished. ``metrics`` holds eval_loss and eval_ppl (plus generation-eval results if on)."""


@hookspec
def hfsdp_on_checkpoint(run, step, path):
    """A complete checkpoint for ``step`` now exists at ``path`` (all ranks finished writing it)."""


@hookspec
def hfsdp_on_train_end(run, metrics):
    """Training reached its last step (after the final eval, export and summary; not called after a preemption
    save or an error). ``metrics`` holds the final eval metrics, if any."""
