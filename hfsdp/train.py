"""The training loop. Reads top to bottom: set up, load, shard, loop, export.

Loss normalisation: every micro-batch's summed token loss is divided by the number of labelled tokens in the whole
global batch (all micro-batches on all ranks), and multiplied by the world size because FSDP/DDP average gradients
over ranks. A step on N ranks therefore computes exactly the gradient of a single-process step on the same global
batch, whatever the padding or the split. A plugin's objective (``hfsdp_objective``, :mod:`hfsdp.objective`) is
normalised the same way, by its own units (``MicroBatch.num_targets``: e.g. the preference pairs of DPO).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from hfsdp import batches, data, loss as losses, models, optimizers, quantization
from hfsdp.components import checkpoint, data_cache, generation, plots, resume, storage, throughput
from hfsdp.components.hf_folder import ModelFiles, model_metadata
from hfsdp.components.metrics import MetricsWriter
from hfsdp.components.outputs import check_export_target, staged_export
from hfsdp.components.startup import report_optimizer_state, report_startup
from hfsdp.config import HfsdpConfig
from hfsdp.distributed import World, all_sum, any_rank, clip_grad_norm, per_rank
from hfsdp.errors import UserError
from hfsdp.objective import Objective, TokenCrossEntropy, objective_of
from hfsdp.plugins import PluginHost
from hfsdp.run_setup import RunSetup
from hfsdp.wrapping import build_accelerator, fsdp1_drop_stale_gathers, grad_scaler, prepare_model_and_optimizer

OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "config.yaml", "summary.json", "loss.png",
           "completions.jsonl")


class NonFiniteLoss(UserError):
    exit_code = 3


class Preempted(Exception):
    """Raised on every rank once the checkpoint asked for by SIGTERM/SIGINT is complete; the CLI exits 128+signum."""

    def __init__(self, signum: int, step: int | None = None, path: Path | None = None):
        self.signum = signum
        self.path = path
        saved = f" after step {step}; checkpoint {path} is complete" if path is not None else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{saved}")


@dataclass
class TrainerState:
    """Progress that a checkpoint must carry besides model, optimizer and RNG (registered with Accelerate)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


@dataclass
class Run:
    """What hooks receive as ``run``."""

    config: HfsdpConfig
    accelerator: Any
    model: Any
    tokenizer: Any
    output_dir: Path
    state: TrainerState
    plugins: PluginHost
    is_main_process: bool
    extras: dict[str, Any] = field(default_factory=dict)  # for plugins; hfsdp keeps nothing here
    world: World | None = None
    optimizer: Any = None  # as prepared by Accelerate (``.optimizer`` is the torch optimizer)
    model_config: Any = None  # the transformers config
    generation_config: dict[str, Any] | None = None  # the model's generation_config.json, as exports write it
    model_files: ModelFiles | None = None  # what checkpoints and exports write besides the weights
    resume_identity: dict[str, Any] = field(default_factory=dict)  # the schedule length and data a resume must keep
    objective: Objective = field(default_factory=TokenCrossEntropy)  # what the loop trains: ``objective(model,
    # batch)`` is the micro-batch's summed loss (a plugin's, hook hfsdp_objective, else next-token cross entropy)


@dataclass
class Options:
    """What the CLI read of argv and the environment besides the run it decided (``RunSetup``)."""

    cache_dir: Path
    overwrite: bool = False


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


def prepare_output_dir(output_dir: Path, opts: Options, resuming: bool, is_main: bool) -> storage.RunLock | None:
    """Check and prepare ``train.output_dir`` (writable; not another live run's: the main process takes its
    :class:`storage.RunLock` first, before ``--overwrite`` removes anything); the lock, held by the main process."""
    blocking = next((p for p in (output_dir, *output_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"train.output_dir {output_dir}: {blocking} is a file, not a folder; "
                        "set train.output_dir to a folder (it is created if missing)")
    check_export_target(output_dir / "final", overwrite=True)  # replaced only if it is an earlier hfsdp export
    existing = [name for name in OUTPUTS if (output_dir / name).exists()]
    if existing and not resuming and not opts.overwrite:
        raise UserError(
            f"train.output_dir {output_dir} already holds a run ({', '.join(existing)}). Pass --resume to continue "
            "it, --overwrite to replace it, or set another train.output_dir"
        )
    _check_writable(output_dir, "train.output_dir", "choose a folder you can write to")
    lock = storage.RunLock.take(output_dir) if is_main else None
    if existing and opts.overwrite and is_main:  # only once the folder is this run's
        for name in existing:
            target = output_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        for stale in output_dir.glob("startup_rank*.json"):
            stale.unlink()
    return lock


def _check_writable(folder: Path, what: str, fix: str) -> None:
    """``folder`` exists (created if missing) and this process can create a file in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".hfsdp-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"{what} {folder}: cannot write there ({err.strerror}); {fix}") from None


@torch.no_grad()
def evaluate(model, dataset, config: HfsdpConfig, accelerator, pad_id: int, select_logits: bool,
             objective: Objective) -> dict[str, float]:
    model.eval()
    rank_batches = batches.eval_batches(len(dataset), config.train.per_device_batch_size,
                                        accelerator.num_processes, accelerator.process_index)
    if config.train.max_eval_batches:
        rank_batches = rank_batches[: config.train.max_eval_batches]
    loss_sum, tokens = 0.0, 0
    for rows in rank_batches:
        batch = objective.micro_batch([dataset[i] for i in (rows or [0])], pad_id, accelerator.device, select_logits)
        if rows is None:  # filler so that every rank runs the same number of forwards
            batch.make_filler()
        objective.start_step(accelerator, [batch])
        loss_sum += float(objective(model, batch))
        tokens += batch.num_targets
    model.train()
    loss_sum, tokens = all_sum(accelerator, [loss_sum, tokens])
    return {**objective.eval_metrics(loss_sum / max(tokens, 1), tokens),
            **objective.take_metrics(accelerator, prefix="eval_")}


def prepare(setup: RunSetup, opts: Options) -> tuple[str, Path, storage.RunLock | None]:
    """The model's local path (built-in models are converted once into the cache; concurrent ranks wait on its file
    lock), the prepared output folder and its lock (main process), for a run whose checks
    :func:`hfsdp.run_setup.decide` made. The cache folder and the output folder are checked writable first."""
    config = setup.config
    _check_writable(opts.cache_dir, "the hfsdp cache folder", "set HFSDP_CACHE_DIR to a folder you can write to")
    output_dir = Path(config.train.output_dir)
    lock = prepare_output_dir(output_dir, opts, resuming=setup.resume_asked, is_main=setup.world.rank == 0)
    try:
        model_path = models.resolve_model_path(config.model.name_or_path, opts.cache_dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if config.train.deterministic:
        torch.use_deterministic_algorithms(True)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if setup.world.rank != 0:  # one "Loading weights" bar, beside rank 0's other bars (not one per rank)
        hf_logging.disable_progress_bar()
    return model_path, output_dir, lock


def train(setup: RunSetup, host: PluginHost, opts: Options) -> dict[str, Any]:
    # ---- set up: the run was decided and checked before anything loads (hfsdp.run_setup.decide)
    config, world = setup.config, setup.world
    model_path, output_dir, lock = prepare(setup, opts)
    from accelerate.utils import set_seed

    accelerator = None
    try:
        # ---- load the model config first: the FSDP plugin wraps the model's own layer class
        model_config = models.load_model_config(model_path, config.model)
        checkpoint_bytes, export_bytes = storage.estimate(model_config, config, host)  # before any weight loads
        space_warning = storage.check_space(output_dir, checkpoint_bytes, export_bytes, config)
        accelerator = build_accelerator(setup, models.fsdp_layer_classes(config.fsdp, model_config))
        set_seed(config.train.seed)
        is_main = accelerator.is_main_process
        say = accelerator.print
        for note in setup.notes + ((space_warning,) if space_warning else ()):
            say(note)

        # ---- data
        tokenizer = models.load_tokenizer(model_path, config.model)
        train_set, eval_set, gen_items, data_report = load_data(accelerator, config, host, tokenizer, opts.cache_dir)
        replaced = objective_of(host, config, tokenizer)  # a plugin's objective, or None
        plan, max_steps, identity = plan_steps(setup, train_set, data_report, say, replaced or TokenCrossEntropy())

        # ---- model: load, let plugins modify it (LoRA), shard
        model, optimizer, flops, objective = load_and_shard(accelerator, setup, host, model_path, model_config,
                                                            tokenizer, packed=batches.is_packed(train_set.column_names),
                                                            replaced=replaced)
        # before a resume restores the checkpoint: e.g. DPO's reference log-probs of the base
        splits = objective.prepare(model, accelerator, {"train": train_set, **({"eval": eval_set} if eval_set
                                   is not None else {})}, opts.cache_dir, model_path)
        train_set, eval_set = splits["train"], splits.get("eval")
        unwrapped = accelerator.unwrap_model(model)
        select_logits = models.accepts_logits_to_keep(unwrapped)
        report = report_startup(setup, accelerator, model, output_dir)

        scheduler = optimizers.build_scheduler(optimizer, config.train, max_steps)
        state = TrainerState()
        accelerator.register_for_checkpointing(scheduler, state)
        scaler = grad_scaler(setup, accelerator)
        optimizers.set_training(optimizer)  # schedule-free steps in train mode (resume's state-making step too)
        if setup.resume_asked:
            resume.restore(accelerator, optimizer, setup.resume, config, output_dir / "checkpoints", state, world)
            if setup.wrapper == "fsdp1":
                fsdp1_drop_stale_gathers(model)  # before set_training changes the weights the load gathered
            optimizers.set_training(optimizer)  # a checkpoint holds schedule-free's evaluation weights
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
        saver = checkpoint.Saver(accelerator, model, optimizer, config.train.async_save,
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
        try:
            while state.step < max_steps:
                t0 = time.perf_counter()
                resume.seed_step(config.train.seed, state.step, accelerator.process_index)
                micro = objective.step_batches(model, train_set, plan, state.step, accelerator.process_index,
                                               tokenizer.pad_token_id, accelerator.device, select_logits)
                result = train_step(run, micro, scaler, scheduler)
                if result.stepped:
                    report_optimizer_state(report, optimizer, output_dir, world.rank)
                elapsed = time.perf_counter() - t0
                step_metrics = {
                    "loss": result.loss, "lr": scheduler.get_last_lr()[0], "grad_norm": result.grad_norm,
                    "tokens": int(result.tokens), "step_time_s": elapsed,
                    **meter.step(result.tokens, result.sq_lengths, elapsed),
                    "epoch": plan.epoch_of(state.step), "skipped_steps": state.skipped_steps,
                    **compile_metrics(config),
                    **objective.take_metrics(accelerator),
                }
                log_step(run, step_metrics, metrics, progress, meter, max_steps)
                if config.train.eval_every and state.step % config.train.eval_every == 0 and state.step < max_steps:
                    last_eval = run_eval(state.step, f"step{state.step}")
                saver.poll()  # a background save every rank has written becomes complete
                preempted = any_rank(accelerator, preemption.signum is not None)
                if (config.train.save_every and state.step % config.train.save_every == 0) or preempted:
                    save_checkpoint(run, saver)
                if preempted:
                    saved = saver.wait()
                    host.call("hfsdp_on_train_end", run=run, metrics=last_eval)
                    metrics.close()
                    raise Preempted(preemption.signum or signal.SIGTERM, state.step, saved)
        except BaseException:
            saver.abandon()
            raise
        finally:
            preemption.uninstall()
            if progress is not None:
                progress.close()
        saver.wait()  # the last checkpoint complete (or its failure reported) before the final eval and export
        loop_s = time.perf_counter() - loop_started

        # ---- finish: final eval, export, summary
        speed = meter.summary(per_rank(accelerator, throughput.peak_memory_gib(accelerator.device)))
        after = run_eval(state.step, "after") if run_eval.enabled else last_eval
        if config.train.export_final:
            export_model(run, output_dir / "final")
        summary = {"steps": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
                   "before": before, "after": after, "startup": report,
                   "resumed_from": str(setup.resume.path if setup.resume else ""),
                   "data": {**data_report, "sources": data.with_realised_shares(data_report["sources"], plan,
                                                                                 state.step)},
                   "throughput": speed,
                   "last_checkpoint": str(checkpoint.latest(output_dir / "checkpoints") or ""),
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
        if lock is not None:
            lock.release()


def plan_steps(setup: RunSetup, train_set, data_report: dict[str, Any], say,
               objective: Objective) -> tuple[batches.BatchPlan, int, dict]:
    """The rows of every step (a pure function of seed and step, over the mixture of the sources; the objective's
    plan), the run's length, and what a checkpoint must resume on (its schedule length and data); a resume's
    checkpoint is checked against them here, before any weight loads."""
    config = setup.config
    plan = objective.batch_plan(train_set, config.train, setup.world.size,
                                batches.Mixture.of(config.data, [s["rows"] for s in data_report["sources"]]))
    max_steps = config.train.max_steps or plan.steps_for_epochs(config.train.epochs)
    if config.data.datasets:
        say(data.format_sources(data.with_realised_shares(data_report["sources"], plan, max_steps), max_steps))
    identity = {"max_steps": max_steps, **batches.identity(train_set)}
    if setup.resume:
        resume.check_resume_record(setup.resume.record, setup.resume.path, identity, config.train.lr_scheduler)
    return plan, max_steps, identity


def load_data(accelerator, config: HfsdpConfig, host: PluginHost, tokenizer, cache_dir: Path):
    """The tokenized train and eval splits, the generation-eval items and the data report (printed)."""
    # The first process of each node preprocesses; the others poll the cache for its result (no collective waits
    # on it, however long it takes), then all meet in a short barrier.
    from accelerate.utils import broadcast_object_list

    run_id = uuid.uuid4().hex
    if accelerator.num_processes > 1:
        run_id = broadcast_object_list([run_id])[0]
    who = data_cache.Preprocessing(builder=accelerator.is_local_main_process, run=run_id)
    train_set, eval_set, raw_eval, report = data.prepare_datasets(config, host, tokenizer, cache_dir, who)
    accelerator.wait_for_everyone()
    accelerator.print(data.format_data_report(report))
    gen_items = []  # checked here, before any weight loads: a row without an answer is a data error
    if config.generation_eval and raw_eval is not None and config.generation_eval.num_samples:
        gen_items = generation.prompts_and_references(raw_eval, config.data.sources()[0], tokenizer,
                                                      config.generation_eval.num_samples)
    return train_set, eval_set, gen_items, report


def load_and_shard(accelerator, setup: RunSetup, host: PluginHost, model_path: str, model_config, tokenizer,
                   packed: bool, replaced: Objective | None = None):
    """The model loaded, modified by plugins (LoRA) and prepared by Accelerate with its optimizer, the FLOPs model of
    it (counted before sharding) and the objective to train it with (``replaced``, a plugin's, else next-token cross
    entropy through, by ``train.chunked_loss``, :class:`loss.ChunkedLoss` where the probe proves it exact, else
    :func:`loss.token_loss_sum`). ``packed`` rows: proves attention stays inside each sample."""
    config, world = setup.config, setup.world
    empty = config.fsdp.cpu_ram_efficient_loading and not accelerator.is_main_process  # never with DDP: refused
    host.call("hfsdp_before_model_load", config=config, world=world, model_config=model_config, setup=setup)
    model = models.load_model(model_path, config.model, empty=empty, quant=quantization.settings(config))
    model = host.chain("hfsdp_modify_model", "model", model, config=config, tokenizer=tokenizer, world=world,
                       setup=setup)
    probe = quantization.probe_before_sharding(model) if config.model.quantization else None
    flops = throughput.FlopsModel.of(model, model_config)
    vocab_size = model.config.vocab_size
    chunked = (losses.ChunkedLoss(model, vocab_size)
               if config.train.chunked_loss and replaced is None and losses.output_head(model) else None)
    model, optimizer = prepare_model_and_optimizer(accelerator, setup, model,
                                                   lambda m, matrices=None: optimizers.build(m, config.train, matrices))
    quantization.check_sharded_forward(model, probe, accelerator)
    if packed:
        batches.check_packed_attention(model, vocab_size, accelerator.device)
    if replaced is not None:
        return model, optimizer, flops, replaced
    loss_sum = losses.run_loss(model, chunked, accelerator, vocab_size) if config.train.chunked_loss \
        else losses.token_loss_sum
    return model, optimizer, flops, TokenCrossEntropy(loss_sum)


class Evaluator:
    """``run_eval(step, label)``: eval loss on the eval split and generation exact match, written to the metrics and
    given to ``hfsdp_on_eval``; the generations stay in ``generations[label]`` for the summary."""

    def __init__(self, run: Run, unwrapped, eval_set, gen_items: list, metrics: MetricsWriter, select_logits: bool):
        self.run, self.unwrapped, self.eval_set, self.gen_items = run, unwrapped, eval_set, gen_items
        self.metrics, self.select_logits = metrics, select_logits
        self.generations: dict[str, generation.GenerationResult] = {}
        self.enabled = eval_set is not None or bool(gen_items)

    def __call__(self, step: int, label: str) -> dict[str, Any]:
        run = self.run
        with optimizers.evaluation_weights(run.optimizer):
            results = self._evaluate(step, label)
        if results:
            self.metrics.write(step, results)
            run.plugins.call("hfsdp_on_eval", run=run, step=step, metrics=results)
        return results

    def _evaluate(self, step: int, label: str) -> dict[str, Any]:
        run = self.run
        results: dict[str, Any] = {}
        if self.eval_set is not None:
            results.update(run.objective.evaluate(run.model, self.eval_set, run.accelerator, run.tokenizer.pad_token_id,
                                                  self.select_logits)
                           or evaluate(run.model, self.eval_set, run.config, run.accelerator,
                                       run.tokenizer.pad_token_id, self.select_logits, run.objective))
        if self.gen_items:
            gen = generation.generate_eval(run.model, self.unwrapped, run.tokenizer, self.gen_items,
                                           run.config.generation_eval.max_new_tokens)
            results["gen_exact_match"] = gen.accuracy
            self.generations[label] = gen
        return results

    def before_training(self) -> dict[str, Any]:
        """The eval before the first step (``train.eval_at_start``; not when resuming), printed."""
        if not (self.run.config.train.eval_at_start and self.run.state.step == 0):
            return {}
        before = self(self.run.state.step, "before")
        if before:
            self.run.accelerator.print(
                "eval before training: " + (f"reward {before['eval_reward']:.4f}" if "eval_reward" in before else
                                            f"loss {before.get('eval_loss', float('nan')):.4f}")
                + (f", exact match {before['gen_exact_match']:.1%}" if "gen_exact_match" in before else ""))
        return before


@dataclass
class StepResult:
    loss: float  # the global batch's mean token loss
    grad_norm: float
    tokens: float  # in the global batch (rows' lengths), and the sum of their squares (attention FLOPs)
    sq_lengths: float
    stepped: bool  # False: a non-finite loss or gradient norm skipped the step (train.on_nonfinite: skip)


def train_step(run: Run, micro: list[batches.MicroBatch], scaler, scheduler) -> StepResult:
    """One optimizer step on this rank's micro-batches of the global batch: forward and backward (the loss normalised
    as the module docstring says), gradient clipping, then the optimizer step, or, on a non-finite loss or gradient
    norm, ``train.on_nonfinite``; then the LR schedule and ``run.state`` advance. Collective: every rank calls it for
    every step."""
    accelerator, model, optimizer, config = run.accelerator, run.model, run.optimizer, run.config
    local_tokens, local_sq_lengths = throughput.tokens_and_square_lengths(micro)
    global_labels, global_tokens, global_sq_lengths = all_sum(
        accelerator, [sum(b.num_targets for b in micro), local_tokens, local_sq_lengths])
    run.objective.start_step(accelerator, micro)
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in micro:  # no host sync in here: the loss is summed on the device
        part = run.objective(model, batch)
        loss = part * run.world.size / max(global_labels, 1)
        accelerator.backward(scaler.scale(loss) if scaler else loss)
        loss_sum += part.detach().double()
    (total_loss,) = all_sum(accelerator, [float(loss_sum)])
    step_loss = total_loss / max(global_labels, 1)
    if scaler:
        scaler.unscale_(optimizer)
    # Listed every step: FSDP2 swaps a module's parameters between sharded and unsharded ones.
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(clip_grad_norm(accelerator, trainable, config.train.max_grad_norm, config, run.world))
    finite = math.isfinite(step_loss) and math.isfinite(grad_norm)
    if scaler and not math.isfinite(grad_norm):
        finite = True  # fp16 overflow: the scaler skips the step and lowers its scale
    if finite:
        run.state.consecutive_skips = 0
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if not finite:
        skip_nonfinite(run, f"non-finite loss/grad norm at step {run.state.step + 1} (loss {step_loss}, "
                            f"grad norm {grad_norm})")
    scheduler.step()
    run.state.step += 1
    run.state.tokens_seen += int(global_tokens)
    return StepResult(step_loss, grad_norm, global_tokens, global_sq_lengths, finite)


def compile_metrics(config: HfsdpConfig) -> dict[str, int]:
    """With ``train.compile``: the graphs dynamo has compiled so far (``compile_graphs``; it stops growing once
    every input variant has been seen: a count that keeps growing means recompiles) and the graph breaks."""
    if config.train.compile is None:
        return {}
    from torch._dynamo.utils import counters

    return {"compile_graphs": int(counters["stats"]["unique_graphs"]),
            "compile_graph_breaks": int(sum(counters["graph_break"].values()))}


def skip_nonfinite(run: Run, what: str) -> None:
    """Count a skipped step, or stop the run as ``train.on_nonfinite`` / ``train.max_consecutive_skips`` say."""
    state, cfg = run.state, run.config.train
    state.skipped_steps += 1
    state.consecutive_skips += 1
    if cfg.on_nonfinite == "stop":
        raise NonFiniteLoss(f"{what}; stopped without saving (train.on_nonfinite: stop). "
                            "Lower the learning rate or check the data, then --resume")
    if state.consecutive_skips > cfg.max_consecutive_skips:
        raise NonFiniteLoss(f"{what}; {state.consecutive_skips} consecutive skipped steps "
                            f"exceed train.max_consecutive_skips ({cfg.max_consecutive_skips})")
    run.accelerator.print(f"warning: {what}; step skipped")


def log_step(run: Run, step_metrics: dict[str, Any], metrics: MetricsWriter, progress, meter: throughput.StepMeter,
             max_steps: int) -> None:
    """The step's metrics to the progress bar, the metrics files (every ``train.log_every`` steps, the first and the
    last) and ``hfsdp_on_step_end``."""
    step = run.state.step
    if progress is not None:
        progress.update(1)
        shown = run.objective.progress_metrics
        progress.set_postfix(loss=f"{step_metrics['loss']:.4f}", lr=f"{step_metrics['lr']:.2e}",
                             **{name.rsplit("/", 1)[-1]: f"{step_metrics[name]:.3f}" for name in shown},
                             **meter.postfix(step_metrics))
    if step % run.config.train.log_every == 0 or step == max_steps or step == 1:
        metrics.write(step, step_metrics)
    run.plugins.call("hfsdp_on_step_end", run=run, step=step, metrics=step_metrics)


def finish(run: Run, summary: dict[str, Any], metrics: MetricsWriter,
           generations: dict[str, generation.GenerationResult]) -> None:
    """The end of a completed run: ``summary.json``, ``hfsdp_on_train_end``, the summary and the loss plot."""
    import json

    if run.is_main_process:
        (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    run.plugins.call("hfsdp_on_train_end", run=run, metrics=summary["after"])
    metrics.close()
    run.accelerator.print(format_summary(summary, generations, run.config))
    if run.is_main_process:
        run.accelerator.print(plots.run_plot(run.output_dir))


def save_checkpoint(run: Run, saver: checkpoint.Saver) -> None:
    """Save the current step (``train.async_save``: start writing it; :func:`checkpoint_complete` follows once it
    is complete)."""
    accelerator = run.accelerator
    record = resume.checkpoint_record(run.config, run.state.step, accelerator.num_processes, run.plugins,
                                      run.resume_identity,
                                      resume.optimizer_digest(accelerator, run.optimizer, run.config, run.world))
    with optimizers.evaluation_weights(run.optimizer):  # staged before save returns, also when asynchronous
        saver.save(checkpoint.Pending(accelerator, run.output_dir / "checkpoints", run.state.step, record,
                                      run.model_files, yaml.safe_dump(run.config.to_yaml_dict(), sort_keys=False)))


def checkpoint_complete(run: Run, metrics: MetricsWriter, done: checkpoint.Pending) -> None:
    """A checkpoint is complete: prune older ones (``train.keep_last``), record its times, tell the plugins."""
    if run.accelerator.is_main_process:
        checkpoint.prune(done.checkpoints, run.config.train.keep_last)
    metrics.write(run.state.step, {"checkpoint_step": done.step, "save_stall_s": done.stall_s,
                                   "save_write_s": done.write_s})
    run.plugins.call("hfsdp_on_checkpoint", run=run, step=done.step, path=done.final)


def export_model(run: Run, out_dir: Path) -> None:
    # schedule-free: the averaged weights it evaluates with, held while they are written (one process's state dict
    # holds the parameters themselves)
    with optimizers.evaluation_weights(run.optimizer):
        _export_weights(run, out_dir)


def _export_weights(run: Run, out_dir: Path) -> None:
    accelerator = run.accelerator
    state_dict = accelerator.get_state_dict(run.model)  # collective: full tensors land on the main process
    unwrapped = accelerator.unwrap_model(run.model)
    state_dict = quantization.exported_weights(state_dict, run.config,
                                               lambda: dict(quantization.quantized_linears(unwrapped)),
                                               check_bytes=False)
    if accelerator.is_main_process:
        with staged_export(out_dir, overwrite=True) as tmp:
            run.plugins.export(state_dict=state_dict, model_config=run.model_config, tokenizer=run.tokenizer,
                               out_dir=tmp, destination=out_dir, generation_config=run.generation_config,
                               config=run.config, model_files=run.model_files, max_shard_bytes=None)
    accelerator.wait_for_everyone()


def _progress(is_main: bool, start: int, total: int):
    if not is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="training", dynamic_ncols=True)


def format_summary(summary: dict[str, Any], generations: dict[str, generation.GenerationResult],
                   config: HfsdpConfig) -> str:
    before, after = summary["before"], summary["after"]
    lines = [f"done: {summary['steps']} steps, {summary['tokens_seen']} tokens"
             + (f", {summary['skipped_steps']} skipped" if summary["skipped_steps"] else ""),
             throughput.format_throughput(summary["throughput"])]
    if "eval_loss" in before and "eval_loss" in after:
        lines.append(f"eval loss {before['eval_loss']:.4f} -> {after['eval_loss']:.4f}"
                     + (f" (perplexity {before['eval_ppl']:.2f} -> {after['eval_ppl']:.2f})" if "eval_ppl" in after
                        else ""))
    elif "eval_loss" in after:
        lines.append(f"eval loss {after['eval_loss']:.4f}"
                     + (f" (perplexity {after['eval_ppl']:.2f})" if "eval_ppl" in after else ""))
    if "eval_reward" in after:
        lines.append(f"eval reward {before['eval_reward']:.4f} -> {after['eval_reward']:.4f}" if "eval_reward" in before
                     else f"eval reward {after['eval_reward']:.4f}")
    if "gen_exact_match" in before and "gen_exact_match" in after:
        lines.append(f"generation exact match {before['gen_exact_match']:.1%} -> {after['gen_exact_match']:.1%}")
    show = config.generation_eval.show if config.generation_eval else 0
    gen_before, gen_after = generations.get("before"), generations.get("after")
    if gen_before and gen_after:
        for (prompt, ref, out_before), (_, _, out_after) in list(zip(gen_before.examples, gen_after.examples))[:show]:
            lines += ["", f"prompt:    {prompt}", f"expected:  {ref}", f"before:    {out_before}", f"after:     {out_after}"]
    if summary["last_checkpoint"]:
        lines.append(f"latest checkpoint: {summary['last_checkpoint']} (`hfsdp export` consolidates it)")
    saves = summary["saves"]
    if saves["count"]:
        lines.append(f"checkpoints saved {saves['mode']}: {saves['count']}, training blocked "
                     f"{saves['stall_s_median']:.2f} s per save (median), each complete after "
                     f"{saves['write_s_median']:.2f} s")
    if config.train.export_final:
        lines.append(f"\nmodel written to {Path(config.train.output_dir) / 'final'}")
    return "\n".join(lines)
