"""Hook specifications: the whole plugin API of hfsdp.

Implement any subset in a module or class, mark each function with ``hfsdp.hookimpl``, and expose the module
through the ``hfsdp`` entry-point group (or name it by dotted path in the config's ``plugins:`` list).

Order: pluggy calls the implementations: built-in plugins first, then the plugins in the order of the config's
``plugins:`` list, unless an implementation is marked ``tryfirst``/``trylast``; hook wrappers
(``hookimpl(wrapper=True)``) wrap the calls as pluggy documents. "Chained" hooks (``hfsdp_transform_dataset``,
``hfsdp_modify_model``) hand each plugin the previous plugin's result, in the same order; they cannot be wrapped.
Ranks: unless a hook says otherwise it runs on every rank, and a plugin that raises on any rank stops all ranks
with an error naming the plugin and the hook.
Stability: hooks and arguments are only ever added. An implementation may accept any subset of a hook's
arguments by name, so one written for fewer arguments keeps working when a hook gains one.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("hfsdp")


@hookspec
def hfsdp_config_section():
    """Declare this plugin's config section.

    Return ``(section_name, PydanticModelClass)`` or None. The top-level YAML key ``section_name`` is validated
    with the model (use ``extra="forbid"``); the validated object is ``config.section(section_name)``.
    Called while the config is validated (``train``, ``validate``, ``export``), before anything is loaded, in
    every process (also by ``hfsdp config-reference`` and, for an installed plugin that is not enabled, to say
    "enable plugin X" when its section is used).
    """


@hookspec
def hfsdp_validate_config(config):
    """Check the validated config as a whole. Return a list of ``(yaml_path, message)`` problems, or None.

    The older spelling of a ``config`` rule (``hfsdp_rules`` is the one way hfsdp's own plugins add rules, and says
    more: the phase). Runs in every process before any model or data is loaded; problems are reported together with
    the core's own. When a section has problems of its own, reading it here skips this check (the user sees that
    section's problems instead).
    """


@hookspec
def hfsdp_rules():
    """Add rules to hfsdp's rule table (:mod:`hfsdp.rules.table`): return a list of ``hfsdp.rules.table.Rule`` or
    None. Each rule has a phase, the config keys it names and a check ``(config, facts) -> [(yaml_path, message)]``
    (a ``ConfigError`` it raises is read the same way), every phase before any weight loads: ``config`` (the config
    alone: what ``hfsdp validate`` reports), ``data`` (the data files it names), ``world`` (``facts.world``: the
    launched world and its parallel degrees, ``facts.world.dims``, with the wrapper they make; also by ``hfsdp plan``
    for every row it predicts), ``trial`` (a small trial on torch, ``hfsdp train`` and ``hfsdp validate`` with its
    rows) or ``model`` (``facts.model_config``: the architecture's config, no weights; ``facts.tokenizer``, None in
    ``hfsdp plan``; also by ``hfsdp export`` for the checkpoint's model). ``facts.plugins`` is the plugin host. A
    rule's problems are reported together with the core's, before them; a rule that reads a section with problems of
    its own is skipped.
    """


@hookspec
def hfsdp_data_readers():
    """Register readers of raw rows for file kinds or sources hfsdp does not read itself: ``{key: read}`` or None.

    ``key`` is a file suffix (``".tsv"``, matched case-insensitively against the end of ``data.path`` /
    ``data.eval_path``) or a source prefix ending in ``"://"`` (``"mydb://"``, matched against the start).
    ``read(path, split, data_config)`` returns the rows of one split: a list of dicts, a dict of column lists, or a
    ``datasets.Dataset``; a ``section`` parameter, if declared, receives this plugin's validated config section.
    Validation checks that a local ``data.path`` exists, is readable, and has a reader (hfsdp's own or a plugin's);
    a ``prefix://`` source is the plugin's to check in ``hfsdp_validate_config``. ``read`` runs on every rank
    (the main process first) when the data is prepared; it must return the same rows for the same arguments.
    """


@hookspec
def hfsdp_dataset_formats():
    """Register dataset formats: return ``{format_name: tokenize}`` or None.

    ``tokenize(batch, tokenizer, data_config) -> {"input_ids": [[int]], "labels": [[int]]}`` receives a batch of
    raw rows (a dict of column lists, as ``datasets.map(batched=True)`` gives) and returns one tokenized sample
    per row; label ``hfsdp.IGNORE_INDEX`` (-100) marks tokens without loss. A ``section`` parameter, if declared,
    receives this plugin's validated config section. Rows longer than ``data_config.max_seq_len`` are cut or
    dropped by hfsdp afterwards, so return them whole. Two plugins registering one name is a config error.
    Called in every process while the config is validated (to check ``data.format``) and when the data is prepared.
    """


@hookspec
def hfsdp_objective_formats():
    """Say which of the formats you register (``hfsdp_dataset_formats``) only an objective trains on (rows without
    next-token labels, e.g. preference pairs): return ``{format_name: refusal}`` or None. ``refusal`` is what hfsdp
    says when such rows are given with no objective enabled, ``{plugins}`` in it standing for the plugins whose
    objective trains on the format (``hfsdp_trains_on``), e.g. ``"preference rows train a preference objective:
    enable one ({plugins})"``. Called while the config is validated.
    """


@hookspec
def hfsdp_trains_on():
    """Say which data format your objective (``hfsdp_objective``) trains on: return the format's name (e.g.
    ``"preference"``), or None. hfsdp names your plugin among those to enable when rows of that format are given
    without an objective (``hfsdp_objective_formats``). Asked of every installed plugin, enabled or not, when that
    refusal is said.
    """


@hookspec
def hfsdp_generation_prompts():
    """Register how generation eval (the ``generation_eval`` section) splits a format's rows: return
    ``{format_name: split}`` or None.

    ``split(row, data_config, tokenizer) -> (prompt, shown, reference)`` receives one raw eval row and returns the
    text the model continues (its chat template applied, with the generation prompt), a short prompt to print, and
    the reference answer that greedy generation is compared with (exact match, whitespace normalised). A split may
    return a fourth value, the row's own ``score(generated) -> bool`` (or None), which then decides instead of that
    comparison; ``str(reference)`` is still what is printed as expected, and the score's ``compared`` attribute,
    if it has one, a few words the summary prints to say what is compared (chat scores a tool-calling turn by its
    first tool call: :class:`hfsdp.builtin.chat.tool_calls.ToolCallMatch`). A fifth value, for a vision-language
    model, is the prompt's images (their encoded bytes, in the order of the prompt's image placeholders): the
    processor expands the placeholders and the model generates seeing them. Raise
    :class:`hfsdp.errors.RowError` when a row has no answer to compare with; hfsdp adds the row's number. A format
    without a split cannot be evaluated by generation (a config error names the formats that can). Called in every
    process while the config is validated and before any weight loads.
    """


@hookspec
def hfsdp_transform_dataset(dataset, config, tokenizer):
    """Chained: transform the tokenized ``datasets.DatasetDict`` (``train`` and maybe ``eval``).

    Return a new DatasetDict or None to keep it. Rows must keep ``input_ids`` and ``labels``; they may add
    ``position_ids``, which makes them packed rows (several samples each, positions restarting at 0 where a sample
    begins, as the packing plugin writes them): hfsdp then gives the model no attention mask, so that attention
    stays inside each sample, and before step 1 proves on the sharded model that it does. Runs only when the
    preprocessing cache misses, on the first process of each node (the other ranks read its cached result), so it
    must depend on nothing but its arguments. With several ``data.datasets`` sources it runs once per source (that
    source's ``train`` rows, and its ``eval`` rows if it has some), so that every training row stays one source's.
    """


@hookspec
def hfsdp_pack_micro_batches(config):
    """Say whether each micro-batch's sequences are laid end to end in packed rows (padding-free micro-batches, as
    the packing plugin's ``scope: micro_batch``): return the most tokens of a packed row (or of the micro-batch's
    longest item, if longer: e.g. a preference pair's two sequences, which share a row; 0: no limit), or None.
    Within it, hfsdp packs each micro-batch in the rows that cost least (``hfsdp.data.layout.cheapest_rows``). The
    same rows train each step as without it; only the padding goes. At most one enabled plugin may return a
    number; the objective must read per-sequence values through ``MicroBatch.per_sequence``
    (``Objective.packs_micro_batches``), else the run is refused before any weight loads. Called once on every
    rank, after the objective is made.
    """


@hookspec
def hfsdp_trains_adapters(config):
    """Say whether this plugin, as ``config`` configures it, trains adapters on a frozen base model (LoRA does):
    return True, or None. A 4-bit base (``model.quantization``) has no gradients of its own, so a config that
    quantizes it is refused unless an enabled plugin says it trains adapters. Called while the config is validated.
    """


@hookspec
def hfsdp_packed_row_tokens(config):
    """Say how long the training rows are that your ``hfsdp_transform_dataset`` packs several samples into (as the
    packing plugin's ``scope: dataset`` does): return the most tokens of such a row, or None. ``hfsdp plan`` then
    traces micro-batches of rows that long instead of ``data.max_seq_len`` (the most any enabled plugin returns).
    Called by ``hfsdp plan``, before anything loads.
    """


@hookspec
def hfsdp_before_model_load(config, world, model_config, setup):
    """The process group is up and the data is prepared; the model is about to be loaded. Every rank.

    ``world`` is an :class:`hfsdp.parallel.world.World` (``rank``, ``size``, ``local_size``, ``on_cpu``, ``dims``);
    ``model_config`` is the model's transformers config (no weight is loaded yet): a ``ConfigError`` raised here
    still stops the run before any weight loads, but a ``model`` rule (``hfsdp_rules``) says it earlier, with the
    other problems, and in ``hfsdp export``. ``setup`` is the run as decided before anything
    loaded (:class:`hfsdp.setup.decide.RunSetup`: ``wrapper`` ``none``/``ddp``/``fsdp1``/``fsdp2``, ``world``, the
    effective ``config``, the ``resume`` point). ``hfsdp plan`` calls it for each row it predicts (rank 0 of that
    row's world, no resume): a ConfigError raised here is the row's reason it cannot run.
    """


@hookspec
def hfsdp_modify_model(model, config, tokenizer, world, setup):
    """Chained: change the model before it is sharded (e.g. add LoRA adapters, freeze layers).

    Runs on every rank, after loading and before ``accelerator.prepare``. Return the replacement model or None
    when the model was changed in place. Only parameters with ``requires_grad`` are given to the optimizer.
    ``world`` is an :class:`hfsdp.parallel.world.World` (``rank``, ``size``, ``local_size``, ``on_cpu``); ``setup``
    the run as decided (see ``hfsdp_before_model_load``). ``hfsdp plan`` calls it too, to predict what training
    holds: the model is then on the meta device (no weights), ``tokenizer`` is None, ``world`` is one process, and
    what the plugin prints is not shown.
    """


@hookspec
def hfsdp_export(state_dict, model_config, tokenizer, out_dir, generation_config, config, model_files, max_shard_bytes,
                 merge_adapters):
    """Write consolidated weights. The first plugin that returns a truthy value handles the export.

    ``state_dict`` maps names to full CPU tensors (as ``model.state_dict()`` of the unwrapped model would),
    ``model_config`` is the transformers config, ``generation_config`` the base model's (or None); in a QLoRA run
    (``model.quantization``) the 4-bit weights arrive dequantized in the compute dtype, on first access. ``out_dir`` is an
    empty temporary folder next to the destination: write the files there; hfsdp records them and renames the folder
    into place once the export hooks return (and removes it if one raises). ``model_files``
    (``hfsdp.model.metadata.ModelFiles``) writes the config, generation config and tokenizer files and knows the
    architecture's tensor shapes; in ``hfsdp export`` it copies the checkpoint's files, and ``model_config``,
    ``tokenizer`` and ``generation_config`` are only loaded (with transformers) if an implementation asks for them.
    ``max_shard_bytes``: the most bytes one weights file may hold (``hfsdp export --max-shard-size``), or None for
    the default; pass it to ``write_hf_folder``. ``merge_adapters``: the user asked for full weights with any
    adapters merged in (``hfsdp export --merge-lora``) instead of the adapters alone; a plugin section's own ``merge:
    true`` asks the same (a QLoRA base is then loaded again to dequantize it). Runs on the main process only. Add
    files to someone else's export in ``hfsdp_on_export``. The built-in implementation writes a Hugging Face folder with
    safetensors shards and runs last.
    """


@hookspec
def hfsdp_on_export(out_dir, destination, config, written_by, model_config, tokenizer):
    """An export is written in ``out_dir``; add files to it here. Main process only.

    ``out_dir`` (a ``pathlib.Path``) is still the temporary folder: files added here become part of the export
    (listed in its ``hfsdp_export.json``, replaced with it on ``--overwrite``), and the folder is renamed to
    ``destination`` when this hook returns. Called after every export: the end of training (``<output_dir>/final``),
    ``hfsdp export CHECKPOINT OUT``, LoRA adapter and merged exports alike. ``written_by`` names the plugin whose
    ``hfsdp_export`` wrote the folder (``safetensors_export`` for the built-in one, ``lora`` for LoRA).
    """


@hookspec
def hfsdp_objective(config, tokenizer, cache_dir):
    """Replace the training objective (the summed next-token cross entropy of labelled tokens) with another one:
    return an :class:`hfsdp.objective.Objective` or None. At most one enabled plugin may return one.

    Called once on every rank, after the data is prepared and before the model loads. The loop stays the same: the
    objective builds each micro-batch from its rows (``micro_batch``; its ``num_targets`` is what the loss is averaged
    over, e.g. the preference pairs), gives the micro-batch's summed loss (``loss``; hfsdp divides by the global
    batch's ``num_targets``, so N ranks compute the gradient of one process), may prepare the splits once the model is
    sharded (``prepare``, e.g. reference log-probs) and reports its metrics (``take_metrics``) for each step and eval.
    Preference losses (DPO, IPO, ORPO, SimPO...) read rows of the built-in ``preference`` format. ``hfsdp plan``
    calls it too, with ``tokenizer`` None, to learn what a micro-batch forwards (``Objective.sequences_per_row``),
    which frozen models run beside the trained one (``Objective.frozen_models()``, e.g. a teacher: their bytes join
    each row's peak) and what it generates each step (``Objective.sampling()``, e.g. GRPO's completions: their KV
    cache joins each row's peak): keep the construction light and read the tokenizer when the objective runs. ``cache_dir``:
    hfsdp's cache folder (where built-in models are built; e.g. to find a second model's files before any weight
    loads).
    """


@hookspec
def hfsdp_reward_functions():
    """Offer reward functions to ``grpo``, ``rloo`` and ``distill_online`` (any plugin that scores completions):
    return ``{name: function}`` or None. ``grpo.rewards`` names them (a name two enabled plugins offer, as other
    functions, is a config error; ``module:function`` names any importable function without a plugin).

    The calling convention is TRL's ``GRPOTrainer``'s, so reward code written for it runs unchanged:
    ``function(prompts=..., completions=..., completion_ids=..., **columns)``, one list entry per completion:
    ``prompts`` the rows' ``prompt`` values (a text, or a list of messages), ``completions`` the generated texts (for
    conversational prompts ``[{"role": "assistant", "content": text}]``), ``completion_ids`` their token ids, and
    every other column of the rows under its own name (a vision-language model's prompts with images: ``images``,
    each completion's prompt's images as PIL images, as TRL passes an image column). Return a list of floats of the
    same length (None: no reward from this function for that completion). Declare ``**kwargs`` to accept the
    columns you do not read. Called on every rank for the completions that rank trains on, while the completions of
    a step are scored; a function that raises, returns another length or a non-number stops every rank with an
    error naming the plugin, the function and the row. Asked for once per run, while the config is validated and
    when the objective is built.
    """


@hookspec
def hfsdp_on_train_start(run):
    """Training is about to start: the model is sharded and the "before" eval ran; step 1 (or the resumed step)
    comes next. Every rank. ``run`` is the :class:`hfsdp.run.state.Run` (config, accelerator, model, optimizer,
    world, ...)."""


@hookspec
def hfsdp_on_step_end(run, step, metrics):
    """An optimizer step finished. Every rank. ``metrics`` holds loss, lr, grad_norm, tokens and timing of this
    step."""


@hookspec
def hfsdp_on_eval(run, step, metrics):
    """An evaluation finished: before training, every ``train.eval_every`` steps, after training. Every rank.
    ``metrics`` holds eval_loss and eval_ppl (plus generation-eval results if on)."""


@hookspec
def hfsdp_on_checkpoint(run, step, path):
    """A complete checkpoint for ``step`` now exists at ``path`` (all ranks finished writing it). Every rank. With
    ``train.async_save`` that may be a few steps later: ``run.state.step`` is then past ``step``."""


@hookspec
def hfsdp_on_train_end(run, metrics):
    """Training stops: it reached its last step (after the final eval, export and summary), or a preemption
    (SIGTERM/SIGINT) checkpoint is complete and the process is about to exit. Not called after an error. Every
    rank. ``metrics`` holds the last eval metrics, if any."""
