"""The training loop: :func:`train` builds the run (:func:`hfsdp.run.build.build`), trains it step by step from
top to bottom (:func:`train_loop`, each step :func:`hfsdp.run.step.train_step`), then finishes it (the final eval,
the export, the summary).

Loss normalisation: every micro-batch's summed token loss is divided by the number of labelled tokens in the whole
global batch (all micro-batches on all ranks), and multiplied by the data-parallel ranks (the world size, unless
``parallel.tp_size`` groups ranks that share their rows) because FSDP/DDP average gradients over them. A step on N
ranks therefore computes exactly the gradient of a single-process step on the same global batch, whatever the
padding or the split. A plugin's objective (``hfsdp_objective``, :mod:`hfsdp.objective`) is
normalised the same way, by its own units (``MicroBatch.num_targets``: e.g. the preference pairs of DPO).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hfsdp.checkpoint import resume, store
from hfsdp.data import prepare
from hfsdp.hooks.host import PluginHost
from hfsdp.parallel.world import per_rank
from hfsdp.run import heap, optimizers, throughput
from hfsdp.run.build import Built, build
from hfsdp.run.startup import report_optimizer_state
from hfsdp.run.state import Options, Run
from hfsdp.run.step import StepResult, compile_metrics, log_step, train_step
from hfsdp.run.summary import export_model, finish
from hfsdp.setup.decide import RunSetup
from hfsdp.setup.record import Record


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
    """The run decided by :func:`hfsdp.setup.decide.decide`, built, trained and finished; its summary. What it holds
    (the run lock, a borrowed checkpoint's hold, the accelerator) is released at the end, however it ends."""
    with contextlib.ExitStack() as held:
        return _train(build(setup, host, opts, held), opts.malloc_set)  # (nothing here keeps the built run)


def _train(built: Built, malloc_set: bool) -> dict[str, Any]:
    """The eval before training, the loop, the finish."""
    before = built.evaluator.before_training()
    built.run.plugins.call("hfsdp_on_train_start", run=built.run)
    last_eval, loop_s = train_loop(built, malloc_set)
    return finish_run(built, before, last_eval, loop_s)


def train_loop(built: Built, malloc_set: bool) -> tuple[dict[str, Any], float]:
    """Train from the run's step to its last: each step's batches, :func:`train_step`, its metrics, an eval and a
    checkpoint when due; a stop signal ends it with a checkpoint (:class:`Preempted`). The last eval's metrics and
    the loop's seconds, once the last checkpoint is complete."""
    run, saver, metrics, max_steps = built.run, built.saver, built.metrics, built.max_steps
    config, accelerator, state, world = run.config, run.accelerator, run.state, run.world
    preemption = PreemptionFlag()
    preemption.install()
    progress = _progress(run.is_main_process, state.step, max_steps)
    run.model.train()
    last_eval: dict[str, Any] = {}
    loop_started = time.perf_counter()
    # CPU: no page faults for what each step reallocates (unless the environment sets malloc itself); what an
    # eval or a save frees goes back after it
    kept = not malloc_set and heap.keep_freed_memory(accelerator.device)
    try:
        while state.step < max_steps:
            t0 = time.perf_counter()
            resume.seed_step(config.train.seed, state.step, world.dp_rank)  # a tp group: the same dropout
            micro = run.objective.step_batches(run.model, built.train_set, built.plan, state.step, world.dp_rank,
                                               run.tokenizer.pad_token_id, accelerator.device, built.select_logits)
            result = train_step(run, micro, built.scaler, built.scheduler)
            if built.lock is not None:  # the earlier run set aside is not needed any more (hfsdp.disk.aside)
                built.lock.first_step_done()
            if result.stepped:
                report_optimizer_state(built.startup, run.optimizer, run.output_dir, world.rank)
            step_metrics = _step_metrics(built, result, time.perf_counter() - t0)
            log_step(run, step_metrics, metrics, progress, built.meter, max_steps)
            if config.train.eval_every and state.step % config.train.eval_every == 0 and state.step < max_steps:
                last_eval = built.evaluator(state.step, f"step{state.step}")
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
                run.plugins.call("hfsdp_on_train_end", run=run, metrics=last_eval)
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
    if built.lock is not None:  # (a resume with no step left to train)
        built.lock.first_step_done()
    return last_eval, time.perf_counter() - loop_started


def _step_metrics(built: Built, result: StepResult, elapsed: float) -> dict[str, Any]:
    """A step's metrics: its loss, LR, gradient norm, tokens, padding, time and rates, epoch, the objective's."""
    state = built.run.state
    return {
        "loss": result.loss, "lr": built.scheduler.get_last_lr()[0], "grad_norm": result.grad_norm,
        "tokens": int(result.tokens), "padding": 1 - result.tokens / max(result.positions, 1),
        "step_time_s": elapsed,
        **built.meter.step(result.tokens, result.sq_lengths, elapsed),
        "epoch": built.plan.epoch_of(state.step), "skipped_steps": state.skipped_steps,
        **compile_metrics(built.run.config),
        **result.metrics,
    }


def finish_run(built: Built, before: dict[str, Any], last_eval: dict[str, Any], loop_s: float) -> dict[str, Any]:
    """The end of a completed run: the final eval (else the last one), the export, ``summary.json`` and the printed
    summary (:func:`hfsdp.run.summary.finish`); the summary."""
    run, setup, state = built.run, built.setup, built.run.state
    speed = built.meter.summary(per_rank(run.accelerator, throughput.peak_memory_gib(run.accelerator.device)))
    after = built.evaluator(state.step, "after") if built.evaluator.enabled else last_eval
    if run.config.train.export_final:
        export_model(run, run.output_dir / "final")
    sources = prepare.with_realised_shares(built.data_report["sources"], built.plan, state.step)
    summary = {"steps": state.step, "tokens_seen": state.tokens_seen, "skipped_steps": state.skipped_steps,
               "before": before, "after": after, "startup": built.startup,
               "resumed_from": str(setup.resume.path if setup.resume else ""),
               "data": {**built.data_report, "sources": sources},
               "throughput": speed,
               "last_checkpoint": str(store.latest(run.output_dir / "checkpoints") or ""),
               "saves": built.saver.summary(), "train_loop_s": loop_s,
               **({"eval_reward": {"before": before.get("eval_reward"), "after": after["eval_reward"]}}
                  if "eval_reward" in after else {})}
    finish(run, summary, built.metrics, built.evaluator.generations)
    return summary


def save_checkpoint(run: Run, saver: store.Saver) -> None:
    """Save the current step (``train.async_save``: start writing it; :func:`hfsdp.run.build.checkpoint_complete`
    follows once it is complete)."""
    accelerator = run.accelerator
    kept = optimizers.keeps_training_weights(run.optimizer)
    record = Record.of_run(run.config, run.state.step, run.world.dims, run.plugins, run.resume_identity,
                           resume.optimizer_digest(accelerator, run.optimizer, run.config, run.world),
                           training_weights=kept or None).to_json()
    # staged before save returns, also when asynchronous (schedule-free's training weights too)
    with optimizers.evaluation_weights(run.optimizer):
        saver.save(store.Pending(accelerator, run.output_dir / "checkpoints", run.state.step, record,
                                 run.model_files, yaml.safe_dump(run.config.to_yaml_dict(), sort_keys=False)))


def _progress(is_main: bool, start: int, total: int):
    if not is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="training", dynamic_ncols=True)


