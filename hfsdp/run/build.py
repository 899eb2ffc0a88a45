"""Setting up a training run, in order, as torchtune's recipes do (a ``setup`` calling ``_setup_*``): :func:`build`
reads as the list of steps, each one its own function below, and returns :class:`Built`, what the loop
(:func:`hfsdp.run.loop.train`) needs. The run was decided and checked before anything loads
(:func:`hfsdp.setup.decide.decide`); here it loads: the run folder, the model's config and the accelerator, the
tokenizer and the data, the objective and the plan of steps, the model and its optimizer (sharded), the micro-batches'
layout, the LR schedule and a resume's checkpoint, then the metrics, the evaluator and the checkpoint saver.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from hfsdp.checkpoint import resume, store
from hfsdp.config.schema import HfsdpConfig
from hfsdp.data import batches, cache, images, prepare
from hfsdp.disk import space
from hfsdp.disk.lock import RunLock
from hfsdp.export import staging
from hfsdp.hooks.host import PluginHost
from hfsdp.model import (chat_template, experts, loading, packed_attention, quantized, tiled_mlp, token_loss,
                         vision)
from hfsdp.model.metadata import ModelFiles, model_metadata
from hfsdp.objective import (MicroBatchLayout, Objective, TokenCrossEntropy, micro_batch_packing,
                             micro_batch_padding, objective_of, rows_said)
from hfsdp.parallel import quantized_base, sequence
from hfsdp.parallel.mesh import device_mesh
from hfsdp.parallel.accelerator import (build_accelerator, fsdp1_drop_stale_gathers, grad_scaler,
                                        prepare_model_and_optimizer)
from hfsdp.rules import quantization
from hfsdp.run import generation, optimizers, throughput
from hfsdp.run.evaluate import Evaluator
from hfsdp.run.folder import prepare_run
from hfsdp.run.metrics import MetricsWriter
from hfsdp.run.startup import report_startup
from hfsdp.run.state import Options, Run, TrainerState
from hfsdp.setup.decide import RunSetup, one_process


@dataclass
class Data:
    """The tokenized train and eval splits (eval None without one), the generation-eval items and the data report."""

    train: Any
    eval: Any
    gen_items: list
    report: dict[str, Any]


@dataclass
class Built:
    """What the loop needs of the built run: ``run`` (what the hooks receive), the rows and the plan of every step,
    the LR schedule and the gradient scaler, where the metrics go, the evaluator, the checkpoint saver, the step
    meter, the start-up report and the data report, and the run lock (the main process's), which holds the earlier
    run of the folder set aside until the first step (:mod:`hfsdp.disk.aside`)."""

    setup: RunSetup
    run: Run
    train_set: Any
    plan: batches.BatchPlan
    max_steps: int
    select_logits: bool  # the model computes logits at the labelled positions only
    scheduler: Any
    scaler: Any
    metrics: MetricsWriter
    evaluator: Evaluator
    saver: store.Saver
    meter: throughput.StepMeter
    startup: dict[str, Any]
    data_report: dict[str, Any]
    lock: RunLock | None


def build(setup: RunSetup, host: PluginHost, opts: Options, held: contextlib.ExitStack) -> Built:
    """The run, built in order. What it holds until it ends (the run lock, a borrowed checkpoint's hold, the
    accelerator) goes into ``held``, which releases it, however the run ends."""
    config = setup.config
    model_path, output_dir, lock, borrowed = _setup_folder(setup, opts, held)
    model_config, accelerator, checkpoint_bytes = _setup_accelerator(setup, host, model_path, output_dir, held)
    tokenizer, data = _setup_data(accelerator, config, host, model_path, opts.cache_dir)
    # a plugin's objective (else next-token cross entropy, made with the model below), and its plan of steps
    replaced = objective_of(host, config, tokenizer, opts.cache_dir)
    planned = replaced or TokenCrossEntropy()
    pack_len = micro_batch_packing(host, config, planned)
    plan, max_steps, identity = _plan_steps(setup, data, accelerator.print, planned)
    model, optimizer, flops, objective, router = _setup_model(
        accelerator, setup, host, model_path, model_config, tokenizer,
        packed=batches.is_packed(data.train.column_names) or pack_len is not None, replaced=replaced)
    objective.lay_out(_layout(accelerator, model, setup, flops, pack_len, tokenizer,
                              images.has_images([data.train, data.eval])))
    select_logits = _prepare_objective(accelerator, setup, objective, model, data, plan, max_steps, tokenizer,
                                       opts.cache_dir, model_path)
    startup = report_startup(setup, accelerator, model, output_dir)
    scheduler, state, scaler = _setup_resume(accelerator, setup, model, optimizer, output_dir, max_steps, borrowed)
    # what the hooks receive, where the metrics go, the evaluator and the checkpoint saver
    metrics = MetricsWriter(output_dir, accelerator, config.to_yaml_dict(), trackers=bool(config.train.report_to),
                            continue_from=state.step if setup.resume_asked else None)
    generation_config = model_metadata(model_path)["generation_config"]
    run = Run(config, accelerator, model, tokenizer, output_dir, state, host, accelerator.is_main_process,
              world=setup.world, optimizer=optimizer, model_config=model_config, generation_config=generation_config,
              model_files=ModelFiles.of(model_config, tokenizer, generation_config), resume_identity=identity,
              objective=objective, router=router)
    evaluator = Evaluator(run, accelerator.unwrap_model(model), data.eval, data.gen_items, metrics, select_logits)
    saver = store.Saver(accelerator, model, optimizer, config.train.async_save, config.train.collective_timeout_s,
                        lambda done: checkpoint_complete(run, metrics, done), estimate=checkpoint_bytes, lock=lock,
                        save_timeout_s=config.train.save_timeout_s)
    return Built(setup, run, data.train, plan, max_steps, select_logits, scheduler, scaler, metrics, evaluator, saver,
                 throughput.StepMeter.for_run(flops, config, accelerator), startup, data.report, lock)


def _setup_folder(setup: RunSetup, opts: Options,
                  held: contextlib.ExitStack) -> tuple[str, Path, RunLock | None, RunLock | None]:
    """The model's local path and the run folder, prepared (:func:`hfsdp.run.folder.prepare_run`), with its lock and
    a shared hold on the folder of the checkpoint ``--resume`` names (main process), both released in ``held``."""
    model_path, output_dir, lock, borrowed = prepare_run(setup, opts)
    for hold in (borrowed, lock):  # released in reverse: the run lock first
        if hold is not None:
            held.callback(hold.release)
    return model_path, output_dir, lock, borrowed


def _setup_accelerator(setup: RunSetup, host: PluginHost, model_path: str, output_dir: Path,
                       held: contextlib.ExitStack) -> tuple[Any, Any, int]:
    """The model's config (read first: the FSDP plugin wraps the model's own layer class; its rules were checked
    before the run was decided), the bytes of a checkpoint (estimated with the export's before any weight loads, and
    said where the disk lacks them), and the accelerator, seeded; it ends in ``held``."""
    from accelerate.utils import set_seed

    config = setup.config
    model_config = loading.load_model_config(model_path, config.model)
    checkpoint_bytes, export_bytes = space.estimate(
        loading.build_meta_model(model_config, one_process(config), host, config.model.dtype))
    space_warning = space.check_space(output_dir, checkpoint_bytes, export_bytes, config)
    accelerator = build_accelerator(setup, loading.fsdp_layer_classes(config.fsdp, model_config))
    held.callback(_end, accelerator)
    set_seed(config.train.seed)
    for note in setup.notes + ((space_warning,) if space_warning else ()):
        accelerator.print(note)
    return model_config, accelerator, checkpoint_bytes


def _end(accelerator) -> None:
    """The accelerator's end. The run's wrapped model is freed first, while the process group is still registered
    (after a run that ended well nothing holds :class:`Built` by then): a DDP reducer that outlives
    destroy_process_group destroys the gloo group itself, holding the GIL while it joins gloo's worker threads, one
    of which may need the GIL to free a finished collective's tensor (a hang at exit, seen on 4 CPU ranks). The
    group's own Python object releases the GIL when it is destroyed."""
    accelerator.free_memory()
    accelerator.end_training()


def _setup_data(accelerator, config: HfsdpConfig, host: PluginHost, model_path: str, cache_dir: Path) -> tuple[Any, Data]:
    """The tokenizer (with the config's chat template) and the :class:`Data` (its report printed)."""
    # The first process of each node preprocesses; the others poll the cache for its result (no collective waits
    # on it, however long it takes), then all meet in a short barrier.
    from accelerate.utils import broadcast_object_list

    tokenizer = loading.load_tokenizer(model_path, config.model)
    chat_template.use(tokenizer, config.data.chat_template)
    run_id = uuid.uuid4().hex
    if accelerator.num_processes > 1:
        run_id = broadcast_object_list([run_id])[0]
    who = cache.Preprocessing(builder=accelerator.is_local_main_process, run=run_id)
    train_set, eval_set, raw_eval, report = prepare.prepare_datasets(config, host, tokenizer, cache_dir, who)
    accelerator.wait_for_everyone()
    accelerator.print(prepare.format_data_report(report))
    gen_items = []  # checked here, before any weight loads: a row without an answer is a data error
    if config.generation_eval and raw_eval is not None and config.generation_eval.num_samples:
        source = config.data.sources()[0]
        _, split = host.generation_prompts()[source.format]
        gen_items = generation.prompts_and_references(raw_eval, source, tokenizer, config.generation_eval.num_samples,
                                                      split)
    return tokenizer, Data(train_set, eval_set, gen_items, report)


def _plan_steps(setup: RunSetup, data: Data, say, objective: Objective) -> tuple[batches.BatchPlan, int, dict]:
    """The rows of every step (a pure function of seed and step, over the mixture of the sources; the objective's
    plan), the run's length, and what a checkpoint must resume on (its schedule length and data); a resume's
    checkpoint is checked against them here, before any weight loads."""
    config = setup.config
    objective.check_rows({"train": data.train, **({"eval": data.eval} if data.eval is not None else {})})
    plan = objective.batch_plan(data.train, config.train, setup.world.dims.dp_size,
                                batches.Mixture.of(config.data, [s["rows"] for s in data.report["sources"]]))
    max_steps = config.train.max_steps or plan.steps_for_epochs(config.train.epochs)
    if config.data.datasets:
        say(prepare.format_sources(prepare.with_realised_shares(data.report["sources"], plan, max_steps), max_steps))
    identity = {"max_steps": max_steps, **batches.identity(data.train)}
    if setup.resume:
        setup.resume.check_data(identity, config.train.lr_scheduler)
    return plan, max_steps, identity


def _setup_model(accelerator, setup: RunSetup, host: PluginHost, model_path: str, model_config, tokenizer,
                 packed: bool, replaced: Objective | None = None
                 ) -> tuple[Any, Any, throughput.FlopsModel, Objective, experts.Router | None]:
    """The model loaded, modified by plugins (LoRA) and prepared by Accelerate with its optimizer, the FLOPs model of
    it (counted before sharding), the objective to train it with (``replaced``, a plugin's, else next-token cross
    entropy through, by ``train.chunked_loss``, :class:`token_loss.ChunkedLoss` where the probe proves it exact,
    else :func:`token_loss.token_loss_sum`) and a mixture of experts' router (None for a dense model). ``packed``
    rows: proves attention stays inside each sample."""
    config, world = setup.config, setup.world
    empty = config.fsdp.cpu_ram_efficient_loading and not accelerator.is_main_process  # never with DDP: refused
    host.call("hfsdp_before_model_load", config=config, world=world, model_config=model_config, setup=setup)
    model = loading.load_model(model_path, config.model, empty=empty, quant=quantization.settings(config))
    if config.train.tiled_mlp:
        tiled = tiled_mlp.tile_mlps(model, loading.layer_classes(config.fsdp, model_config), config.train.tiled_mlp)
        accelerator.print(f"train.tiled_mlp {config.train.tiled_mlp}: the MLPs of {tiled} layers in tiles of "
                          f"{config.train.tiled_mlp} positions, each recomputed in the backward")
    if config.model.freeze:
        params = list(model.parameters())
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        accelerator.print(f"model.freeze {', '.join(config.model.freeze)}: {frozen:,} of "
                          f"{sum(p.numel() for p in params):,} parameters frozen")
    model = host.chain("hfsdp_modify_model", "model", model, config=config, tokenizer=tokenizer, world=world,
                       setup=setup)
    probe = quantized.probe_before_sharding(model) if config.model.quantization else None
    flops = throughput.FlopsModel.of(model, model_config)
    router = experts.Router.of(model, config, model_config)
    vocab_size = model.config.get_text_config().vocab_size
    chunked = (token_loss.ChunkedLoss(model, vocab_size)
               if config.train.chunked_loss and replaced is None and token_loss.output_head(model) else None)
    model, optimizer = prepare_model_and_optimizer(accelerator, setup, model,
                                                   lambda m, matrices=None: optimizers.build(m, config.train, matrices))
    quantized_base.check_sharded_forward(model, probe, accelerator)
    if packed:
        batches.check_packed_attention(model, vocab_size, accelerator.device)
    if replaced is not None:
        return model, optimizer, flops, replaced, router
    loss_sum = token_loss.run_loss(model, chunked, accelerator, vocab_size) if config.train.chunked_loss \
        else token_loss.token_loss_sum
    return model, optimizer, flops, TokenCrossEntropy(loss_sum), router


def _layout(accelerator, model, setup: RunSetup, flops: throughput.FlopsModel, pack_len: int | None,
            tokenizer, with_images: bool) -> MicroBatchLayout:
    """How the micro-batches are laid out (packed rows of at most ``pack_len`` tokens; a sequence-parallel rank's
    share of each row's positions; a vision-language model's pixel inputs, from the processor ``tokenizer``
    carries: where the rows have images (``with_images``), a micro-batch without any runs the tower on a
    placeholder), the model's attention switched to read them."""
    unwrapped = accelerator.unwrap_model(model)
    processor = images.processor_of(tokenizer)
    pixels = None
    if processor is not None:
        keys = loading.forward_arguments(unwrapped)
        if with_images:
            vision.TowerTouch(unwrapped, keys)
        pixels = images.PixelInputs(processor, keys, touch_tower=with_images)
    layout = MicroBatchLayout(images=pixels)
    if pack_len is not None:
        # sdpa attends each packed sequence on its own (hfsdp.model.packed_attention), flash attention's
        # variable-length kernels too (transformers finds the sequences from position_ids); another attention
        # computes a packed row's whole square, which the packer weighs against the padding it saves
        segments = packed_attention.use_sequence_sdpa(unwrapped)
        flash = str(unwrapped.config._attn_implementation).startswith("flash")
        layout = replace(layout, pack_len=pack_len, pack_attention=0.0 if segments or flash else
                         flops.attention_per_pair(), pack_segments=segments)
    if setup.world.dims.token_split > 1:  # attention over the split rows' positions (hfsdp.parallel.sequence)
        mesh = accelerator.torch_device_mesh  # (FSDP1's run gives Accelerate no mesh: its groups are made here)
        mesh = mesh if mesh is not None else device_mesh(setup.world.dims, accelerator.device.type)
        layout = replace(layout, sequence_split=sequence.SequenceSplit.of(setup.world, mesh))
        sequence.use_split_attention(unwrapped)
    return layout


def _prepare_objective(accelerator, setup: RunSetup, objective: Objective, model, data: Data, plan, max_steps: int,
                       tokenizer, cache_dir: Path, model_path: str) -> bool:
    """The objective prepared (before a resume restores the checkpoint: e.g. DPO's reference log-probs of the base),
    its splits in ``data``, and what packing saves said; whether the model computes logits at the labelled
    positions only (a split micro-batch keeps every logit: its targets are cut at the same positions as its
    inputs)."""
    splits = objective.prepare(model, accelerator, {"train": data.train, **({"eval": data.eval} if data.eval
                               is not None else {})}, cache_dir, model_path)
    data.train, data.eval = splits["train"], splits.get("eval")
    select_logits = loading.accepts_logits_to_keep(accelerator.unwrap_model(model)) and setup.world.dims.token_split == 1
    pack_len = objective.layout.pack_len
    if pack_len is not None:
        data.report["padding"] = (micro_batch_padding(objective, data.train, plan, max_steps, tokenizer.pad_token_id,
                                                      select_logits) if objective.sampling() is None else
                                  f"micro-batches of sampled completions packed in {rows_said(pack_len)} (each "
                                  "step's share of padding: metric padding)")
        accelerator.print(f"packing: {data.report['padding']}")
    return select_logits


def _setup_resume(accelerator, setup: RunSetup, model, optimizer, output_dir: Path, max_steps: int,
                  borrowed: RunLock | None) -> tuple[Any, TrainerState, Any]:
    """The LR schedule, the run's progress and the gradient scaler, restored from the checkpoint a resume names;
    the run's config written into its folder."""
    config = setup.config
    scheduler = optimizers.build_scheduler(optimizer, config.train, max_steps)
    state = TrainerState()
    accelerator.register_for_checkpointing(scheduler, state)
    scaler = grad_scaler(setup, accelerator)
    optimizers.set_training(optimizer)  # schedule-free steps in train mode (resume's state-making step too)
    if setup.resume_asked:
        resume.restore(accelerator, optimizer, setup.resume, config, output_dir / "checkpoints", state, setup.world,
                       loading=lambda record: optimizers.loading_training_weights(optimizer,
                                                                                   bool(record.training_weights)))
        if borrowed is not None:  # another run's checkpoint, loaded: that run may start again
            borrowed.release()
        if setup.wrapper == "fsdp1":
            fsdp1_drop_stale_gathers(model)  # before set_training changes the weights the load gathered
        optimizers.set_training(optimizer)  # (a checkpoint written before hfsdp kept schedule-free's training weights)
        if accelerator.is_main_process:  # (the run lock is this run's: no other process exports into its final/)
            for stale in staging.remove_unfinished(output_dir / "final"):
                accelerator.print(f"removed {stale.name}, an export a stopped run left unfinished")
    if accelerator.is_main_process:
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_yaml_dict(), sort_keys=False))
    return scheduler, state, scaler


def checkpoint_complete(run: Run, metrics: MetricsWriter, done: store.Pending) -> None:
    """A checkpoint is complete: prune older ones (``train.keep_last``), record its times, tell the plugins."""
    if run.accelerator.is_main_process:
        store.prune(done.checkpoints, run.config.train.keep_last)
    metrics.write(run.state.step, {"checkpoint_step": done.step, "save_stall_s": done.stall_s,
                                   "save_write_s": done.write_s})
    run.plugins.call("hfsdp_on_checkpoint", run=run, step=done.step, path=done.final)
