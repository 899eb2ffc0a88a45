"""The training loop. Reads top to bottom: set up, load, shard, loop, export.

Loss normalisation: every micro-batch's summed token loss is divided by the number of labelled tokens in the whole
global batch (all micro-batches on all ranks), and multiplied by the world size because FSDP/DDP average gradients
over ranks. A step on N ranks therefore computes exactly the gradient of a single-process step on the same global
batch, whatever the padding or the split.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from hfsdp import __version__, data, models
from hfsdp.components import checkpoint, generation, plots, resume, throughput
from hfsdp.components.hf_folder import ModelFiles, model_metadata
from hfsdp.components.metrics import MetricsWriter
from hfsdp.components.outputs import check_export_target, staged_export
from hfsdp.components.safe_load import verify_checkpoint
from hfsdp.config import HfsdpConfig
from hfsdp.distributed import (
    World, all_sum, any_rank, build_accelerator, checkpointed_layers, clip_grad_norm, local_parameter_bytes,
    optimizer_state_bytes, per_rank, rehearsal_problems, uses_fsdp, wrapped_units, wrapper_note,
)
from hfsdp.errors import ConfigError, UserError
from hfsdp.fsdp import check_world, hybrid_mesh_shape
from hfsdp.plugins import PluginHost

# Keys that may change between a checkpoint and its resume; anything else changes the run and is refused.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.epochs", "train.log_every", "train.eval_every", "train.save_every", "train.keep_last",
    "train.export_final", "train.report_to", "train.on_nonfinite", "train.max_consecutive_skips", "train.output_dir",
    "train.eval_at_start", "train.max_eval_batches", "train.collective_timeout_s", "generation_eval",
    "fsdp.single_process",  # how one process runs the same steps; the CLI keeps FSDP to resume an FSDP checkpoint
)
OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "config.yaml", "summary.json", "loss.png")


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
    extras: dict[str, Any] = field(default_factory=dict)
    world: World | None = None
    optimizer: Any = None  # as prepared by Accelerate (``.optimizer`` is the torch optimizer)


@dataclass
class Options:
    """What the CLI decided from argv and the environment."""

    cache_dir: Path
    world: World
    resume: str | None = None  # "latest" or a path
    overwrite: bool = False
    config_source: str = ""


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


def prepare_output_dir(output_dir: Path, opts: Options, is_main: bool) -> None:
    blocking = next((p for p in (output_dir, *output_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"train.output_dir {output_dir}: {blocking} is a file, not a folder; "
                        "set train.output_dir to a folder (it is created if missing)")
    check_export_target(output_dir / "final", overwrite=True)  # replaced only if it is an earlier hfsdp export
    existing = [name for name in OUTPUTS if (output_dir / name).exists()]
    if existing and not opts.resume and not opts.overwrite:
        raise UserError(
            f"train.output_dir {output_dir} already holds a run ({', '.join(existing)}). Pass --resume to continue "
            "it, --overwrite to replace it, or set another train.output_dir"
        )
    if existing and opts.overwrite and is_main:
        for name in existing:
            target = output_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        for stale in output_dir.glob("startup_rank*.json"):
            stale.unlink()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".hfsdp-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"train.output_dir {output_dir}: cannot write there ({err.strerror}); "
                        "choose a folder you can write to") from None


def find_resume_checkpoint(output_dir: Path, resume: str) -> Path | None:
    if resume != "latest":
        path = Path(resume)
        checkpoint.read_record(path)  # refuses incomplete folders
        return path
    complete = checkpoint.complete_checkpoints(output_dir / "checkpoints")
    return complete[-1][1] if complete else None


def run_fingerprint(config: HfsdpConfig) -> str:
    """What a checkpoint records of its config: the keys that change the run (the batch keys are checked through
    the global batch, :mod:`hfsdp.components.resume`)."""
    return config.fingerprint(exclude=RESUMABLE_CHANGES + resume.BATCH_KEYS)


def check_resume_record(record: dict[str, Any], config: HfsdpConfig, path: Path, identity: dict[str, Any]) -> None:
    """``identity``: this run's schedule length and training data (:func:`data.identity`), as the record keeps them
    (records written before they were recorded are not checked for them)."""
    problems = []
    saved_steps = record.get("max_steps", identity["max_steps"])
    if saved_steps != identity["max_steps"] and config.train.lr_scheduler != "constant":
        problems.append(f"its {config.train.lr_scheduler} LR schedule runs over {saved_steps} steps, this run's over "
                        f"{identity['max_steps']} (train.max_steps/train.epochs changed), so the learning rate would "
                        "jump: resume with the run's length, or use lr_scheduler: constant to extend a run")
    if any(key in record and record[key] != identity[key] for key in ("train_rows", "train_fingerprint")):
        problems.append(f"it was trained on other data ({record.get('train_rows')} rows, fingerprint "
                        f"{record.get('train_fingerprint')}; this run's data: {identity['train_rows']} rows, "
                        f"fingerprint {identity['train_fingerprint']}): resume with the data the run started on")
    if record["config_hash"] != run_fingerprint(config):
        problems.append("the config changed in keys that change the run (model, data, optimizer, fsdp, batch); "
                        f"only these may change on resume: {', '.join(RESUMABLE_CHANGES)}")
    if problems:
        raise UserError(f"cannot resume from {path}: " + "; ".join(problems))


def token_loss_sum(model, batch: data.MicroBatch) -> torch.Tensor:
    """Summed next-token cross entropy of a micro-batch (over its ``num_targets`` labelled positions)."""
    logits = model(**batch.inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch.targets.reshape(-1),
                           ignore_index=data.IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(model, dataset, config: HfsdpConfig, accelerator, pad_id: int, select_logits: bool) -> dict[str, float]:
    model.eval()
    batches = data.eval_batches(len(dataset), config.train.per_device_batch_size,
                                accelerator.num_processes, accelerator.process_index)
    if config.train.max_eval_batches:
        batches = batches[: config.train.max_eval_batches]
    loss_sum, tokens = 0.0, 0
    for rows in batches:
        batch = data.micro_batch([dataset[i] for i in (rows or [0])], pad_id, accelerator.device, select_logits)
        if rows is None:  # filler so that every rank runs the same number of forwards
            batch.targets.fill_(data.IGNORE_INDEX)
            batch.num_targets = 0
        loss_sum += float(token_loss_sum(model, batch))
        tokens += batch.num_targets
    model.train()
    loss_sum, tokens = all_sum(accelerator, [loss_sum, tokens])
    loss = loss_sum / max(tokens, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(tokens)}


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel per step instead of a loop of per-parameter ops (CPU's default); 3x faster on 2 CPU cores.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True)


def startup_report(config: HfsdpConfig, accelerator, model, world: World) -> dict[str, Any]:
    local, full = local_parameter_bytes(model)
    fsdp = config.fsdp
    mesh = hybrid_mesh_shape(fsdp, world.size, world.local_size)
    report = {
        "world_size": world.size,
        "distributed_type": accelerator.distributed_type.value,
        "process_group_backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None,
        "device": "cpu (rehearsal, gloo)" if world.on_cpu and accelerator.distributed_type.value != "NO"
                  else str(accelerator.device),
        "fsdp_version": fsdp.version,
        "strategy": fsdp.sharding_strategy + wrapper_note(config, world.size)
                    + (f" (replicate {mesh[0]} x shard {mesh[1]})" if mesh else ""),
        "wrap_policy": fsdp.wrap_policy,
        "wrapped_units": wrapped_units(model),
        "checkpointed_layers": checkpointed_layers(model),
        "mixed_precision": fsdp.precision_name,
        "param_bytes_this_rank": local,
        "param_bytes_full_model": full,
    }
    sharded = fsdp.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD") and uses_fsdp(config, world.size)
    group = mesh[1] if mesh else world.size
    if sharded and group > 1 and local > 0.75 * full:
        raise UserError(
            f"the model did not end up sharded: this rank holds {local} of {full} parameter bytes under "
            f"{fsdp.sharding_strategy} on {world.size} ranks. This is a bug in the launcher adaptation; "
            "please report it with the output of `hfsdp train --help` and your launcher command"
        )
    return report


def write_rank_report(output_dir: Path, rank: int, report: dict[str, Any]) -> None:
    """Every rank's own startup numbers (what it holds, its peak RSS so far), as ``<output_dir>/startup_rank<r>.json``."""
    import json
    import resource

    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    report.setdefault("peak_rss_bytes_after_sharding", peak_rss)
    (output_dir / f"startup_rank{rank}.json").write_text(
        json.dumps({"rank": rank, **report, "peak_rss_bytes": peak_rss}, indent=2))


def format_report(report: dict[str, Any]) -> str:
    mib = 1024**2
    return (
        f"hfsdp {__version__} | world size {report['world_size']} | {report['distributed_type']} on {report['device']}\n"
        f"  FSDP{report['fsdp_version']} {report['strategy']} | wrap {report['wrap_policy']} "
        f"({report['wrapped_units']} units) | mixed precision {report['mixed_precision']}\n"
        f"  parameters on this rank: {report['param_bytes_this_rank'] / mib:.1f} MiB of "
        f"{report['param_bytes_full_model'] / mib:.1f} MiB "
        f"({100 * report['param_bytes_this_rank'] / max(1, report['param_bytes_full_model']):.0f}%)"
    )


def train(config: HfsdpConfig, host: PluginHost, opts: Options) -> dict[str, Any]:
    # ---- set up: everything that can be checked is checked before any weight is loaded
    world = opts.world
    problems = check_world(config.fsdp, world.size, world.local_size)
    if world.on_cpu:
        problems += rehearsal_problems(config)
    if problems:
        raise ConfigError(problems, source=opts.config_source or "config")
    # Built-in models are converted once into the cache; concurrent ranks wait on its file lock.
    model_path = models.resolve_model_path(config.model.name_or_path, opts.cache_dir)
    output_dir = Path(config.train.output_dir)
    prepare_output_dir(output_dir, opts, is_main=world.rank == 0)

    if config.train.deterministic:
        torch.use_deterministic_algorithms(True)
    from accelerate.utils import set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    accelerator = None
    try:
        # ---- load the model config first: the FSDP plugin wraps the model's own layer class
        model_config = models.load_model_config(model_path, config.model)
        layer_classes = config.fsdp.transformer_layer_cls or models.default_layer_classes(model_config)
        if config.fsdp.wrap_policy == "transformer" and not layer_classes:
            raise UserError("fsdp.transformer_layer_cls: the model declares no _no_split_modules; name its "
                            "decoder layer class (e.g. [LlamaDecoderLayer]) or use wrap_policy: size")
        if config.fsdp.wrap_policy == "size" and getattr(model_config, "tie_word_embeddings", False):
            # Seen on 2 ranks: the policy puts embed_tokens and the tied lm_head in different FSDP units, and the
            # first forward fails ("size mismatch ... vec").
            raise UserError("fsdp.wrap_policy 'size' splits this model's tied input and output embeddings into "
                            "different FSDP units, which FSDP cannot run: use wrap_policy 'transformer' or 'none'")
        accelerator = build_accelerator(config, layer_classes, world)
        set_seed(config.train.seed)
        is_main = accelerator.is_main_process
        say = accelerator.print

        # ---- data
        tokenizer = models.load_tokenizer(model_path, config.model)
        with accelerator.main_process_first():
            train_set, eval_set, raw_eval, data_report = prepare_datasets(config, host, tokenizer, opts.cache_dir)
        say(f"data: train {data_report['train']}; eval {data_report.get('eval', 'none')}; {data_report['padding']}; "
            f"preprocessing {data_report['preprocess_s']:.2f} s"
            f"{' (preprocessing cache hit)' if data_report['cache_hit'] else ''}")
        gen_items = []  # checked here, before any weight loads: a row without an answer is a data error
        if config.generation_eval and raw_eval is not None and config.generation_eval.num_samples:
            gen_items = generation.prompts_and_references(raw_eval, config.data, tokenizer,
                                                          config.generation_eval.num_samples)
        # A checkpoint of another world size resumes with the accumulation that keeps its global batch.
        resumed_from = find_resume_checkpoint(output_dir, opts.resume) if opts.resume else None
        record = checkpoint.read_record(resumed_from) if resumed_from is not None else None
        if resumed_from is not None:
            config, note = resume.keep_global_batch(record, config, world.size, resumed_from)
            if note:
                say(note)
            if uses_fsdp(config, world.size) and not checkpoint.saved_by_fsdp(resumed_from):
                raise UserError(f"cannot resume from {resumed_from} under FSDP: one process without a wrapper (or "
                                "DDP) saved it; resume it on one process, or start runs that must resume on other "
                                "world sizes with fsdp.single_process: fsdp")
        plan = data.BatchPlan(len(train_set), config.train.per_device_batch_size, world.size,
                              config.train.gradient_accumulation_steps, config.train.seed,
                              lengths=data.row_lengths(train_set) if config.train.group_by_length else None)
        max_steps = config.train.max_steps or plan.steps_for_epochs(config.train.epochs)
        identity = {"max_steps": max_steps, **data.identity(train_set)}  # what a checkpoint must resume on

        # ---- model: load, let plugins modify it (LoRA), shard
        fsdp_wraps = uses_fsdp(config, world.size)
        empty = config.fsdp.cpu_ram_efficient_loading and not is_main  # never with DDP: the config refuses that
        host.call("hfsdp_before_model_load", config=config, world=world)
        model = models.load_model(model_path, config.model, empty=empty)
        model = host.chain("hfsdp_modify_model", "model", model, config=config, tokenizer=tokenizer, world=world)
        flops = throughput.FlopsModel.of(model, model_config)  # counted before sharding
        if config.fsdp.activation_checkpointing and not fsdp_wraps:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.fsdp.version == 1 and fsdp_wraps:
            # FSDP1 flattens parameters on wrap; an optimizer built before it would hold stale tensors.
            model = accelerator.prepare(model)
            optimizer = accelerator.prepare(build_optimizer(model, config.train))
        else:
            model, optimizer = accelerator.prepare(model, build_optimizer(model, config.train))
        unwrapped = accelerator.unwrap_model(model)
        if "position_ids" in train_set.column_names:  # packed rows: prove attention stays inside each sample
            data.check_packed_attention(model, unwrapped.config.vocab_size, accelerator.device)
        select_logits = models.accepts_logits_to_keep(unwrapped)
        report = startup_report(config, accelerator, model, world)
        say(format_report(report))
        write_rank_report(output_dir, world.rank, report)

        from transformers import get_scheduler

        scheduler = get_scheduler(config.train.lr_scheduler if config.train.lr_scheduler != "constant"
                                  else "constant_with_warmup", optimizer,
                                  num_warmup_steps=config.train.warmup_steps, num_training_steps=max_steps)
        state = TrainerState()
        accelerator.register_for_checkpointing(scheduler, state)
        scaler = _grad_scaler(config, accelerator)
        if scaler is not None:
            accelerator.register_for_checkpointing(scaler)

        # ---- resume
        if opts.resume:
            if is_main:  # folders of saves killed midway (kill -9, node loss) are never used: remove them
                for stale in checkpoint.remove_incomplete(output_dir / "checkpoints"):
                    say(f"removed {stale.name}, an incomplete checkpoint a stopped run left behind")
            if resumed_from is not None:
                check_resume_record(record, config, resumed_from, identity)
                verify_checkpoint(resumed_from)  # every file Accelerate/DCP would unpickle: plain data only
                accelerator.load_state(str(resumed_from))
                say(f"resumed from {resumed_from} at step {state.step}")
            else:
                say(f"--resume: no complete checkpoint in {output_dir / 'checkpoints'}; starting from step 0")
        if is_main:
            (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_yaml_dict(), sort_keys=False))

        metrics = MetricsWriter(output_dir, accelerator, config.to_yaml_dict(), trackers=bool(config.train.report_to),
                                continue_from=state.step if opts.resume else None)
        run = Run(config, accelerator, model, tokenizer, output_dir, state, host, is_main, world=world,
                  optimizer=optimizer)
        run.extras["generation_config"] = model_metadata(model_path)["generation_config"]
        run.extras["resume_identity"] = identity
        run.extras["model_files"] = ModelFiles.of(model_config, tokenizer, run.extras["generation_config"])

        def run_eval(step: int, label: str) -> dict[str, Any]:
            results: dict[str, Any] = {}
            if eval_set is not None:
                results.update(evaluate(model, eval_set, config, accelerator, tokenizer.pad_token_id, select_logits))
            if gen_items:
                gen = generation.generate_eval(model, unwrapped, tokenizer, gen_items,
                                               config.generation_eval.max_new_tokens)
                results["gen_exact_match"] = gen.accuracy
                run.extras[f"generation_{label}"] = gen
            if results:
                metrics.write(step, results)
                host.call("hfsdp_on_eval", run=run, step=step, metrics=results)
            return results

        before = run_eval(state.step, "before") if config.train.eval_at_start and state.step == 0 else {}
        if before:
            say(f"eval before training: loss {before.get('eval_loss', float('nan')):.4f}"
                + (f", exact match {before['gen_exact_match']:.1%}" if "gen_exact_match" in before else ""))
        host.call("hfsdp_on_train_start", run=run)

        # ---- loop
        preemption = PreemptionFlag()
        preemption.install()
        progress = _progress(is_main, state.step, max_steps)
        meter = throughput.StepMeter.for_run(flops, config, accelerator)
        model.train()
        last_eval: dict[str, Any] = {}
        try:
            while state.step < max_steps:
                t0 = time.perf_counter()
                resume.seed_step(config.train.seed, state.step, accelerator.process_index)
                batches = data.micro_batches(train_set, plan, state.step, accelerator.process_index,
                                             tokenizer.pad_token_id, accelerator.device, select_logits)
                local_tokens, local_sq_lengths = throughput.row_lengths(batches)
                global_labels, global_tokens, global_sq_lengths = all_sum(
                    accelerator, [sum(b.num_targets for b in batches), local_tokens, local_sq_lengths])
                loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
                for batch in batches:  # no host sync in here: the loss is summed on the device
                    part = token_loss_sum(model, batch)
                    loss = part * world.size / max(global_labels, 1)
                    accelerator.backward(scaler.scale(loss) if scaler else loss)
                    loss_sum += part.detach().double()
                (total_loss,) = all_sum(accelerator, [float(loss_sum)])
                step_loss = total_loss / max(global_labels, 1)
                if scaler:
                    scaler.unscale_(optimizer)
                # Listed every step: FSDP2 swaps a module's parameters between sharded and unsharded ones.
                trainable = [p for p in model.parameters() if p.requires_grad]
                grad_norm = float(clip_grad_norm(accelerator, trainable, config.train.max_grad_norm))
                finite = math.isfinite(step_loss) and math.isfinite(grad_norm)
                if scaler and not math.isfinite(grad_norm):
                    finite = True  # fp16 overflow: the scaler skips the step and lowers its scale
                if not finite:
                    optimizer.zero_grad(set_to_none=True)
                    state.skipped_steps += 1
                    state.consecutive_skips += 1
                    what = f"non-finite loss/grad norm at step {state.step + 1} (loss {step_loss}, grad norm {grad_norm})"
                    if config.train.on_nonfinite == "stop":
                        raise NonFiniteLoss(f"{what}; stopped without saving (train.on_nonfinite: stop). "
                                            "Lower the learning rate or check the data, then --resume")
                    if state.consecutive_skips > config.train.max_consecutive_skips:
                        raise NonFiniteLoss(f"{what}; {state.consecutive_skips} consecutive skipped steps "
                                            f"exceed train.max_consecutive_skips ({config.train.max_consecutive_skips})")
                    say(f"warning: {what}; step skipped")
                else:
                    state.consecutive_skips = 0
                    if scaler:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if "optimizer_state_bytes_this_rank" not in report:  # the state exists after the first step
                        report["optimizer_state_bytes_this_rank"] = optimizer_state_bytes(optimizer)
                        write_rank_report(output_dir, world.rank, report)
                scheduler.step()
                state.step += 1
                state.tokens_seen += int(global_tokens)
                elapsed = time.perf_counter() - t0
                step_metrics = {
                    "loss": step_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                    "tokens": int(global_tokens), "step_time_s": elapsed,
                    **meter.step(global_tokens, global_sq_lengths, elapsed),
                    "epoch": plan.epoch_of(state.step), "skipped_steps": state.skipped_steps,
                }
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{step_loss:.4f}", lr=f"{step_metrics['lr']:.2e}",
                                         **meter.postfix(step_metrics))
                if state.step % config.train.log_every == 0 or state.step == max_steps or state.step == 1:
                    metrics.write(state.step, step_metrics)
                host.call("hfsdp_on_step_end", run=run, step=state.step, metrics=step_metrics)
                if config.train.eval_every and state.step % config.train.eval_every == 0 and state.step < max_steps:
                    last_eval = run_eval(state.step, f"step{state.step}")
                preempted = any_rank(accelerator, preemption.signum is not None)
                saved = None
                if (config.train.save_every and state.step % config.train.save_every == 0) or preempted:
                    saved = save_checkpoint(accelerator, run, model_config)
                if preempted:
                    host.call("hfsdp_on_train_end", run=run, metrics=last_eval)
                    metrics.close()
                    raise Preempted(preemption.signum or signal.SIGTERM, state.step, saved)
        finally:
            preemption.uninstall()
            if progress is not None:
                progress.close()

        # ---- finish: final eval, export, summary
        speed = meter.summary(per_rank(accelerator, throughput.peak_memory_gib(accelerator.device)))
        after = run_eval(state.step, "after") if (eval_set is not None or gen_items) else last_eval
        if config.train.export_final:
            export_model(accelerator, model, run, model_config, output_dir / "final")
        summary = {"steps": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
                   "before": before, "after": after, "startup": report, "resumed_from": str(resumed_from or ""),
                   "data": data_report, "throughput": speed}
        if is_main:
            import json

            (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        host.call("hfsdp_on_train_end", run=run, metrics=after)
        metrics.close()
        say(format_summary(summary, run.extras, config))
        if is_main:
            say(plots.run_plot(output_dir))
        return summary
    finally:
        if accelerator is not None:
            # Free the wrapped model while the process group is still registered: a DDP reducer that outlives
            # destroy_process_group destroys the gloo group itself, holding the GIL while it joins gloo's worker
            # threads, one of which may need the GIL to free a finished collective's tensor (a hang at exit, seen
            # on 4 CPU ranks). The group's own Python object releases the GIL when it is destroyed.
            model = run = None  # noqa: F841 (also clears the closures' cells)
            accelerator.free_memory()
            accelerator.end_training()


def save_checkpoint(accelerator, run: Run, model_config) -> Path:
    from importlib.metadata import version

    record = {
        "step": run.state.step,
        "world_size": accelerator.num_processes,
        "config_hash": run_fingerprint(run.config),
        "global_batch": resume.global_batch(run.config, accelerator.num_processes),
        "versions": {"hfsdp": __version__, "torch": torch.__version__, "accelerate": version("accelerate"),
                     "transformers": version("transformers")},
        "plugins": {p.name: p.version for p in run.plugins.plugins},
        "state_dict_type": run.config.fsdp.state_dict_type,
        **run.extras["resume_identity"],
    }
    checkpoints_dir = run.output_dir / "checkpoints"
    path = checkpoint.save(accelerator, checkpoints_dir, run.state.step, record, run.extras["model_files"],
                           yaml.safe_dump(run.config.to_yaml_dict(), sort_keys=False))
    if accelerator.is_main_process:
        checkpoint.prune(checkpoints_dir, run.config.train.keep_last)
    run.plugins.call("hfsdp_on_checkpoint", run=run, step=run.state.step, path=path)
    return path


def export_model(accelerator, model, run: Run, model_config, out_dir: Path) -> None:
    state_dict = accelerator.get_state_dict(model)  # collective: full tensors land on the main process
    if accelerator.is_main_process:
        with staged_export(out_dir, overwrite=True) as tmp:
            run.plugins.export(state_dict=state_dict, model_config=model_config, tokenizer=run.tokenizer, out_dir=tmp,
                               destination=out_dir, generation_config=run.extras["generation_config"], config=run.config,
                               model_files=run.extras["model_files"])
    accelerator.wait_for_everyone()


def prepare_datasets(config: HfsdpConfig, host: PluginHost, tokenizer, cache_dir: Path):
    import datasets

    owner, tokenize_fn = host.tokenize_function(config)
    raw_train, raw_eval = data.load_raw(config.data, config.train.seed, host.data_readers(config))
    owner_version = next((p.version for p in host.plugins if p.name == owner), "?")
    transforms = ",".join(host.implementers("hfsdp_transform_dataset"))
    key = data.cache_key([raw_train._fingerprint, raw_eval._fingerprint if raw_eval is not None else ""],
                         tokenizer, config.data, f"{owner}=={owner_version}",
                         extra=transforms + repr(sorted((k, repr(v)) for k, v in config.plugin_config.items())))
    stats: dict[str, data.TokenizeStats] = {}

    def build():
        splits = {"train": raw_train, **({"eval": raw_eval} if raw_eval is not None else {})}
        tokenized = {}
        for name, split in splits.items():
            tokenized[name], stats[name] = data.tokenize(split, tokenize_fn, tokenizer, config.data, config.data.num_proc)
            if len(tokenized[name]) == 0:  # checked before caching: datasets cannot reload an empty saved split
                where = "data.path" if name == "train" else "the eval data"
                raise UserError(f"data: no {name} rows left after tokenization of {where} ({stats[name].summary()}); "
                                "raise data.max_seq_len or use data.too_long: truncate")
        result = datasets.DatasetDict(tokenized)
        return host.chain("hfsdp_transform_dataset", "dataset", result, config=config, tokenizer=tokenizer)

    t0 = time.perf_counter()
    result, hit = data.load_or_build(cache_dir, key, build)
    seconds = time.perf_counter() - t0
    if len(result["train"]) == 0:
        summary = stats["train"].summary() if "train" in stats else "no rows"
        raise UserError(f"data: no training rows left after tokenization ({summary}); "
                        "raise data.max_seq_len or use data.too_long: truncate")
    report = {"train": f"{len(result['train'])} rows", "cache_hit": hit, "preprocess_s": seconds,
              "padding": data.padding_report(result["train"], config.train.per_device_batch_size, config.train.seed,
                                             config.train.group_by_length)}
    if "train" in stats:
        report["train"] += f" ({stats['train'].summary()})"
    if "eval" in result:
        report["eval"] = f"{len(result['eval'])} rows"
    return result["train"], result.get("eval"), raw_eval, report


def _grad_scaler(config: HfsdpConfig, accelerator):
    if config.fsdp.precision_name != "fp16":
        return None
    if config.fsdp.version == 1 and uses_fsdp(config, accelerator.num_processes):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler()
    return torch.amp.GradScaler(accelerator.device.type)


def _progress(is_main: bool, start: int, total: int):
    if not is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="training", dynamic_ncols=True)


def format_summary(summary: dict[str, Any], extras: dict[str, Any], config: HfsdpConfig) -> str:
    before, after = summary["before"], summary["after"]
    lines = [f"done: {summary['steps']} steps, {summary['tokens_seen']} tokens"
             + (f", {summary['skipped_steps']} skipped" if summary["skipped_steps"] else ""),
             throughput.format_throughput(summary["throughput"])]
    if "eval_loss" in before and "eval_loss" in after:
        lines.append(f"eval loss {before['eval_loss']:.4f} -> {after['eval_loss']:.4f} "
                     f"(perplexity {before['eval_ppl']:.2f} -> {after['eval_ppl']:.2f})")
    elif "eval_loss" in after:
        lines.append(f"eval loss {after['eval_loss']:.4f} (perplexity {after['eval_ppl']:.2f})")
    if "gen_exact_match" in before and "gen_exact_match" in after:
        lines.append(f"generation exact match {before['gen_exact_match']:.1%} -> {after['gen_exact_match']:.1%}")
    show = config.generation_eval.show if config.generation_eval else 0
    gen_before, gen_after = extras.get("generation_before"), extras.get("generation_after")
    if gen_before and gen_after:
        for (prompt, ref, out_before), (_, _, out_after) in list(zip(gen_before.examples, gen_after.examples))[:show]:
            lines += ["", f"prompt:    {prompt}", f"expected:  {ref}", f"before:    {out_before}", f"after:     {out_after}"]
    if config.train.export_final:
        lines.append(f"\nmodel written to {Path(config.train.output_dir) / 'final'}")
    return "\n".join(lines)
