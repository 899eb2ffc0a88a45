"""The training loop. Reads top to bottom: set up, load, shard, loop, export.

Loss normalisation: every micro-batch's summed token loss is divided by the number of labelled tokens in the whole
global batch (all micro-batches on all ranks), and multiplied by the data-parallel ranks (the world size, unless
``parallel.tp_size`` groups ranks that share their rows) because FSDP/DDP average gradients over them. A step on N
ranks therefore computes exactly the gradient of a single-process step on the same global batch, whatever the
padding or the split. A plugin's objective (``hfsdp_objective``, :mod:`hfsdp.objective`) is
normalised the same way, by its own units (``MicroBatch.num_targets``: e.g. the preference pairs of DPO).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from hfsdp.checkpoint import resume, store
from hfsdp.disk import space
from hfsdp.config.schema import HfsdpConfig
from hfsdp.data import batches, cache, prepare
from hfsdp.model.metadata import ModelFiles, model_metadata
from hfsdp.hooks.host import PluginHost
from hfsdp.model import chat_template, loading, packed_attention, quantized
from hfsdp.objective import (Objective, TokenCrossEntropy, micro_batch_packing, micro_batch_padding, objective_of,
                             rows_said)
from hfsdp.parallel.accelerator import (build_accelerator, fsdp1_drop_stale_gathers, grad_scaler,
                                        prepare_model_and_optimizer)
from hfsdp.parallel import sequence
from hfsdp.parallel.world import per_rank
from hfsdp.errors import ConfigError
from hfsdp.export import staging
from hfsdp.rules import quantization
from hfsdp.rules.table import Facts, check
from hfsdp.model import token_loss
from hfsdp.run import generation, heap, optimizers, throughput
from hfsdp.run.evaluate import Evaluator
from hfsdp.run.folder import prepare_run
from hfsdp.run.metrics import MetricsWriter
from hfsdp.setup.decide import RunSetup, one_process
from hfsdp.run.startup import report_optimizer_state, report_startup
from hfsdp.run.state import Options, Run, TrainerState
from hfsdp.setup.record import Record
from hfsdp.run.step import compile_metrics, log_step, train_step
from hfsdp.run.summary import export_model, finish


class Preempted(Exception):
    """Raised on every rank once the checkpoint asked for by SIGTERM/SIGINT is complete; the CLI exits 128+signum."""

    def __init__(self, signum: int, step: int | None = None, path: Path | None = None):
        self.signum = signum
        self.path = path
        saved = f" after step {step}; checkpoint {path} is complete" if path is not None else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{saved}")


class PreemptionFlag:
    """First SIGTERM/SIGINT asks for a checkpoint at the next step; a second one exits at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        print(f"\nhfsdp: {signal.Signals(signum).name} received: saving a checkpoint after this step "
              "(send it again to exit now)", file=sys.stderr, flush=True)


def train(setup: RunSetup, host: PluginHost, opts: Options) -> dict[str, Any]:
    # ---- set up: the run was decided and checked before anything loads (hfsdp.setup.decide.decide)
    config, world = setup.config, setup.world
    model_path, output_dir, lock, borrowed = prepare_run(setup, opts)
    from accelerate.utils import set_seed

    accelerator = None
    try:
        # ---- load the model config first: the FSDP plugin wraps the model's own layer class
        model_config = loading.load_model_config(model_path, config.model)
        if problems := check("model", config, Facts(plugins=host, world=world, model_config=model_config)):
            raise ConfigError(problems, source=f"the config, for {model_path}")
        checkpoint_bytes, export_bytes = space.estimate(  # before any weight loads
            loading.build_meta_model(model_config, one_process(config), host, config.model.dtype))
        space_warning = space.check_space(output_dir, checkpoint_bytes, export_bytes, config)
        accelerator = build_accelerator(setup, loading.fsdp_layer_classes(config.fsdp, model_config))
        set_seed(config.train.seed)
        is_main = accelerator.is_main_process
        say = accelerator.print
        for note in setup.notes + ((space_warning,) if space_warning else ()):
            say(note)

        # ---- data
        tokenizer = loading.load_tokenizer(model_path, config.model)
        chat_template.use(tokenizer, config.data.chat_template)
        train_set, eval_set, gen_items, data_report = load_data(accelerator, config, host, tokenizer, opts.cache_dir)
        replaced = objective_of(host, config, tokenizer, opts.cache_dir)  # a plugin's objective, or None
        pack_len = micro_batch_packing(host, config, replaced or TokenCrossEntropy())
        plan, max_steps, identity = plan_steps(setup, train_set, data_report, say, replaced or TokenCrossEntropy())

        # ---- model: load, let plugins modify it (LoRA), shard
        model, optimizer, flops, objective = load_and_shard(accelerator, setup, host, model_path, model_config,
                                                            tokenizer, packed=batches.is_packed(train_set.column_names)
                                                            or pack_len is not None, replaced=replaced)
        if pack_len is not None:
            objective.pack_len = pack_len
            # sdpa attends each packed sequence on its own (hfsdp.model.packed_attention), flash attention's
            # variable-length kernels too (transformers finds the sequences from position_ids); another attention
            # computes a packed row's whole square, which the packer weighs against the padding it saves
            objective.pack_segments = packed_attention.use_sequence_sdpa(accelerator.unwrap_model(model))
            flash = str(accelerator.unwrap_model(model).config._attn_implementation).startswith("flash")
            objective.pack_attention = 0.0 if objective.pack_segments or flash else flops.attention_per_pair()
        # before a resume restores the checkpoint: e.g. DPO's reference log-probs of the base
        splits = objective.prepare(model, accelerator, {"train": train_set, **({"eval": eval_set} if eval_set
                                   is not None else {})}, opts.cache_dir, model_path)
        train_set, eval_set = splits["train"], splits.get("eval")
        unwrapped = accelerator.unwrap_model(model)
        # (a split micro-batch keeps every logit: its targets are cut at the same positions as its inputs)
        select_logits = loading.accepts_logits_to_keep(unwrapped) and world.dims.sp == 1
        if pack_len is not None:
            data_report["padding"] = (micro_batch_padding(objective, train_set, plan, max_steps, tokenizer.pad_token_id,
                                                          select_logits) if objective.sampling() is None else
                                      f"micro-batches of sampled completions packed in {rows_said(pack_len)} (each "
                                      "step's share of padding: metric padding)")
            say(f"packing: {data_report['padding']}")
        if world.dims.sp > 1:  # attention exchanges the split rows' positions for heads (hfsdp.parallel.sequence)
            objective.sequence_split = sequence.SequenceSplit.of(world)
            sequence.use_ulysses(accelerator.unwrap_model(model))
        report = report_startup(setup, accelerator, model, output_dir)

        scheduler = optimizers.build_scheduler(optimizer, config.train, max_steps)
        state = TrainerState()
        accelerator.register_for_checkpointing(scheduler, state)
        scaler = grad_scaler(setup, accelerator)
        optimizers.set_training(optimizer)  # schedule-free steps in train mode (resume's state-making step too)
        if setup.resume_asked:
            resume.restore(accelerator, optimizer, setup.resume, config, output_dir / "checkpoints", state, world,
                           loading=lambda record: optimizers.loading_training_weights(optimizer,
                                                                                       bool(record.training_weights)))
            if borrowed is not None:  # another run's checkpoint, loaded: that run may start again
                borrowed.release()
            if setup.wrapper == "fsdp1":
                fsdp1_drop_stale_gathers(model)  # before set_training changes the weights the load gathered
            optimizers.set_training(optimizer)  # (a checkpoint written before hfsdp kept schedule-free's training weights)
            if is_main:  # (the run lock is this run's: no other process exports into its final/)
                for stale in staging.remove_unfinished(output_dir / "final"):
                    say(f"removed {stale.name}, an export a stopped run left unfinished")
        if is_main:
            (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_yaml_dict(), sort_keys=False))

        metrics = MetricsWriter(output_dir, accelerator, config.to_yaml_dict(), trackers=bool(config.train.report_to),
                                continue_from=state.step if setup.resume_asked else None)
        generation_config = model_metadata(model_path)["generation_config"]
        run = Run(config, accelerator, model, tokenizer, output_dir, state, host, is_main, world=world,
                  optimizer=optimizer, model_config=model_config, generation_config=generation_config,
                  model_files=ModelFiles.of(model_config, tokenizer, generation_config), resume_identity=identity,
                  objective=objective)
        run_eval = Evaluator(run, unwrapped, eval_set, gen_items, metrics, select_logits)
        saver = store.Saver(accelerator, model, optimizer, config.train.async_save,
                                 config.train.collective_timeout_s, lambda done: checkpoint_complete(run, metrics, done),
                                 estimate=checkpoint_bytes, lock=lock, save_timeout_s=config.train.save_timeout_s)
        before = run_eval.before_training()
        host.call("hfsdp_on_train_start", run=run)

        # ---- loop
        preemption = PreemptionFlag()
        preemption.install()
        progress = _progress(is_main, state.step, max_steps)
        meter = throughput.StepMeter.for_run(flops, config, accelerator)
        model.train()
        last_eval: dict[str, Any] = {}
        loop_started = time.perf_counter()
        # CPU: no page faults for what each step reallocates (unless the environment sets malloc itself); what an
        # eval or a save frees goes back after it
        kept = not opts.malloc_set and heap.keep_freed_memory(accelerator.device)
        try:
            while state.step < max_steps:
                t0 = time.perf_counter()
                resume.seed_step(config.train.seed, state.step, world.dp_rank)  # a tp group: the same dropout
                micro = objective.step_batches(model, train_set, plan, state.step, world.dp_rank,
                                               tokenizer.pad_token_id, accelerator.device, select_logits)
                result = train_step(run, micro, scaler, scheduler)
                if lock is not None:  # the earlier run set aside is not needed any more (hfsdp.disk.aside)
                    lock.first_step_done()
                if result.stepped:
                    report_optimizer_state(report, optimizer, output_dir, world.rank)
                elapsed = time.perf_counter() - t0
                step_metrics = {
                    "loss": result.loss, "lr": scheduler.get_last_lr()[0], "grad_norm": result.grad_norm,
                    "tokens": int(result.tokens), "padding": 1 - result.tokens / max(result.positions, 1),
                    "step_time_s": elapsed,
                    **meter.step(result.tokens, result.sq_lengths, elapsed),
                    "epoch": plan.epoch_of(state.step), "skipped_steps": state.skipped_steps,
                    **compile_metrics(config),
                    **result.metrics,
                }
                log_step(run, step_metrics, metrics, progress, meter, max_steps)
                if config.train.eval_every and state.step % config.train.eval_every == 0 and state.step < max_steps:
                    last_eval = run_eval(state.step, f"step{state.step}")
                    if kept:
                        heap.give_back_free_memory()
                # a background save every rank has written becomes complete; a signal on any rank stops every rank
                (preempted,) = saver.poll([preemption.signum is not None])
                if (config.train.save_every and state.step % config.train.save_every == 0) or preempted:
                    save_checkpoint(run, saver)
                    if kept:
                        heap.give_back_free_memory()
                if preempted:
                    saved = saver.wait()
                    host.call("hfsdp_on_train_end", run=run, metrics=last_eval)
                    metrics.close()
                    raise Preempted(preemption.signum or signal.SIGTERM, state.step, saved)
        except BaseException:
            saver.abandon()
            raise
        finally:
            if kept:
                heap.give_back_free_memory()
            preemption.uninstall()
            if progress is not None:
                progress.close()
        saver.wait()  # the last checkpoint complete (or its failure reported) before the final eval and export
        if lock is not None:  # (a resume with no step left to train)
            lock.first_step_done()
        loop_s = time.perf_counter() - loop_started

        # ---- finish: final eval, export, summary
        speed = meter.summary(per_rank(accelerator, throughput.peak_memory_gib(accelerator.device)))
        after = run_eval(state.step, "after") if run_eval.enabled else last_eval
        if config.train.export_final:
            export_model(run, output_dir / "final")
        summary = {"steps": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
                   "before": before, "after": after, "startup": report,
                   "resumed_from": str(setup.resume.path if setup.resume else ""),
                   "data": {**data_report, "sources": prepare.with_realised_shares(data_report["sources"], plan,
                                                                                 state.step)},
                   "throughput": speed,
                   "last_checkpoint": str(store.latest(output_dir / "checkpoints") or ""),
                   "saves": saver.summary(), "train_loop_s": loop_s,
                   **({"eval_reward": {"before": before.get("eval_reward"), "after": after["eval_reward"]}}
                      if "eval_reward" in after else {})}
        finish(run, summary, metrics, run_eval.generations)
        return summary
    finally:
        if accelerator is not None:
            # Free the wrapped model while the process group is still registered: a DDP reducer that outlives
            # destroy_process_group destroys the gloo group itself, holding the GIL while it joins gloo's worker
            # threads, one of which may need the GIL to free a finished collective's tensor (a hang at exit, seen
            # on 4 CPU ranks). The group's own Python object releases the GIL when it is destroyed.
            model = run = run_eval = None  # noqa: F841
            accelerator.free_memory()
            accelerator.end_training()
        for held in (lock, borrowed):
            if held is not None:
                held.release()


def plan_steps(setup: RunSetup, train_set, data_report: dict[str, Any], say,
               objective: Objective) -> tuple[batches.BatchPlan, int, dict]:
    """The rows of every step (a pure function of seed and step, over the mixture of the sources; the objective's
    plan), the run's length, and what a checkpoint must resume on (its schedule length and data); a resume's
    checkpoint is checked against them here, before any weight loads."""
    config = setup.config
    plan = objective.batch_plan(train_set, config.train, setup.world.dims.dp_size,
                                batches.Mixture.of(config.data, [s["rows"] for s in data_report["sources"]]))
    max_steps = config.train.max_steps or plan.steps_for_epochs(config.train.epochs)
    if config.data.datasets:
        say(prepare.format_sources(prepare.with_realised_shares(data_report["sources"], plan, max_steps), max_steps))
    identity = {"max_steps": max_steps, **batches.identity(train_set)}
    if setup.resume:
        setup.resume.check_data(identity, config.train.lr_scheduler)
    return plan, max_steps, identity


def load_data(accelerator, config: HfsdpConfig, host: PluginHost, tokenizer, cache_dir: Path):
    """The tokenized train and eval splits, the generation-eval items and the data report (printed)."""
    # The first process of each node preprocesses; the others poll the cache for its result (no collective waits
    # on it, however long it takes), then all meet in a short barrier.
    from accelerate.utils import broadcast_object_list

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
    return train_set, eval_set, gen_items, report


def load_and_shard(accelerator, setup: RunSetup, host: PluginHost, model_path: str, model_config, tokenizer,
                   packed: bool, replaced: Objective | None = None):
    """The model loaded, modified by plugins (LoRA) and prepared by Accelerate with its optimizer, the FLOPs model of
    it (counted before sharding) and the objective to train it with (``replaced``, a plugin's, else next-token cross
    entropy through, by ``train.chunked_loss``, :class:`loss.ChunkedLoss` where the probe proves it exact, else
    :func:`token_loss.token_loss_sum`). ``packed`` rows: proves attention stays inside each sample."""
    config, world = setup.config, setup.world
    empty = config.fsdp.cpu_ram_efficient_loading and not accelerator.is_main_process  # never with DDP: refused
    host.call("hfsdp_before_model_load", config=config, world=world, model_config=model_config, setup=setup)
    model = loading.load_model(model_path, config.model, empty=empty, quant=quantization.settings(config))
    model = host.chain("hfsdp_modify_model", "model", model, config=config, tokenizer=tokenizer, world=world,
                       setup=setup)
    probe = quantized.probe_before_sharding(model) if config.model.quantization else None
    flops = throughput.FlopsModel.of(model, model_config)
    vocab_size = model.config.vocab_size
    chunked = (token_loss.ChunkedLoss(model, vocab_size)
               if config.train.chunked_loss and replaced is None and token_loss.output_head(model) else None)
    model, optimizer = prepare_model_and_optimizer(accelerator, setup, model,
                                                   lambda m, matrices=None: optimizers.build(m, config.train, matrices))
    quantized.check_sharded_forward(model, probe, accelerator)
    if packed:
        batches.check_packed_attention(model, vocab_size, accelerator.device)
    if replaced is not None:
        return model, optimizer, flops, replaced
    loss_sum = token_loss.run_loss(model, chunked, accelerator, vocab_size) if config.train.chunked_loss \
        else token_loss.token_loss_sum
    return model, optimizer, flops, TokenCrossEntropy(loss_sum)


def save_checkpoint(run: Run, saver: store.Saver) -> None:
    """Save the current step (``train.async_save``: start writing it; :func:`checkpoint_complete` follows once it
    is complete)."""
    accelerator = run.accelerator
    kept = optimizers.keeps_training_weights(run.optimizer)
    record = Record.of_run(run.config, run.state.step, run.world.dims, run.plugins, run.resume_identity,
                           resume.optimizer_digest(accelerator, run.optimizer, run.config, run.world),
                           training_weights=kept or None).to_json()
    # staged before save returns, also when asynchronous (schedule-free's training weights too)
    with optimizers.evaluation_weights(run.optimizer):
        saver.save(store.Pending(accelerator, run.output_dir / "checkpoints", run.state.step, record,
                                      run.model_files, yaml.safe_dump(run.config.to_yaml_dict(), sort_keys=False)))


def checkpoint_complete(run: Run, metrics: MetricsWriter, done: store.Pending) -> None:
    """A checkpoint is complete: prune older ones (``train.keep_last``), record its times, tell the plugins."""
    if run.accelerator.is_main_process:
        store.prune(done.checkpoints, run.config.train.keep_last)
    metrics.write(run.state.step, {"checkpoint_step": done.step, "save_stall_s": done.stall_s,
                                   "save_write_s": done.write_s})
    run.plugins.call("hfsdp_on_checkpoint", run=run, step=done.step, path=done.final)


def _progress(is_main: bool, start: int, total: int):
    if not is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="training", dynamic_ncols=True)


