"""One optimizer step (:func:`train_step`, like torchtitan's ``train_step``), what a non-finite loss does, and how
a step is logged."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hfsdp.config.schema import HfsdpConfig
from hfsdp.data import batches
from hfsdp.errors import UserError
from hfsdp.parallel.world import StartedSum, clip_grad_norm
from hfsdp.run import throughput
from hfsdp.run.metrics import MetricsWriter
from hfsdp.run.state import Run


# A step's phases, each labelled in torch.profiler traces as "hfsdp.<phase>" (``hfsdp bench --profile`` splits a
# step by them; a label costs about a microsecond when no profiler runs).
PHASES = ("forward", "backward", "clip", "optimizer")


def phase(name: str):
    return torch.profiler.record_function(f"hfsdp.{name}")


class NonFiniteLoss(UserError):
    exit_code = 3


@dataclass
class StepResult:
    loss: float  # the global batch's mean token loss
    grad_norm: float
    tokens: float  # in the global batch (rows' lengths), and the sum of their squares (attention FLOPs)
    sq_lengths: float
    positions: float  # the input positions the model computed (tokens and padding) over the global batch
    stepped: bool  # False: a non-finite loss or gradient norm skipped the step (train.on_nonfinite: skip)
    metrics: dict[str, float]  # the objective's, over all ranks


def train_step(run: Run, micro: list[batches.MicroBatch], scaler, scheduler) -> StepResult:
    """One optimizer step on this rank's micro-batches of the global batch: forward and backward (the loss normalised
    as the module docstring says), gradient clipping, then the optimizer step, or, on a non-finite loss or gradient
    norm, ``train.on_nonfinite``; then the LR schedule and ``run.state`` advance. Collective: every rank calls it for
    every step."""
    accelerator, model, optimizer, config = run.accelerator, run.model, run.optimizer, run.config
    local_tokens, local_sq_lengths = throughput.tokens_and_square_lengths(micro)
    # The ranks of a tensor-parallel group compute the same loss on the same rows: the sums over all ranks count
    # each labelled position and the loss tp times. A sequence-parallel group's ranks each hold part of every row's
    # positions (their labels and loss once), and each row's full length (its tokens: row_copies times).
    dims = run.world.dims
    tp = dims.tp
    # the global batch's counts, summed while the first forward runs (the loss is divided by them)
    local_positions = sum(b.inputs["input_ids"].numel() for b in micro)
    counts = StartedSum(accelerator, [sum(b.num_targets for b in micro), local_tokens, local_sq_lengths,
                                      local_positions])
    run.objective.start_step(accelerator, micro)
    router = run.router
    if router is not None:
        router.start_step()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in micro:  # no host sync in here: the loss is summed on the device
        if batch.skip:  # every rank skips this micro-step: its gradient is 0
            continue
        with phase("forward"):
            part = run.objective(model, batch)
            global_labels = counts.result()[0] / tp
            loss = part * dims.gradient_ranks / max(global_labels, 1)
            balancing = router.take_loss(len(micro)) if router is not None else None
            if balancing is not None:  # a mixture of experts' load-balancing loss (hfsdp.model.experts)
                loss = loss + balancing
        with phase("backward"):
            accelerator.backward(scaler.scale(loss) if scaler else loss)
        loss_sum += part.detach().double()
    with phase("clip"):
        if scaler:
            scaler.unscale_(optimizer)
        # Listed every step: FSDP2 swaps a module's parameters between sharded and unsharded ones.
        trainable = [p for p in model.parameters() if p.requires_grad]
        if all(batch.skip for batch in micro):  # the gradient of a step without a backward is 0, not absent (the
            for p in trainable:  # optimizer steps as it would have: its step count, moments and weight decay)
                p.grad = torch.zeros_like(p)
        # the objective's metric sums, where it gives them, ride the same all-reduce (no collective of their own)
        sums = run.objective.step_sums()
        names = sorted(sums or {})
        routed = router.sums() if router is not None else []  # the router's counts too
        summed = torch.cat([torch.stack([loss_sum / tp, *(torch.as_tensor(sums[k], dtype=torch.float64)
                                                          .to(loss_sum.device) for k in names)]),
                            torch.tensor(routed, dtype=torch.float64, device=loss_sum.device)])
        norm, (total_loss, *totals) = clip_grad_norm(accelerator, trainable, config.train.max_grad_norm, run.world,
                                                     summed_with=summed)  # one all-reduce for all
        grad_norm = float(norm)
        totals, routed = totals[:len(names)], totals[len(names):]
    metrics = (run.objective.metrics_of(dict(zip(names, totals))) if sums is not None
               else run.objective.take_metrics(accelerator))
    if router is not None:
        metrics = {**metrics, **router.metrics_of(routed)}
    global_labels, global_tokens, global_sq_lengths, global_positions = (
        total / copies for total, copies in zip(counts.result(), (tp, dims.row_copies, dims.row_copies, tp)))
    step_loss = total_loss / max(global_labels, 1)
    finite = math.isfinite(step_loss) and math.isfinite(grad_norm)
    if scaler and not math.isfinite(grad_norm):
        finite = True  # fp16 overflow: the scaler skips the step and lowers its scale
    if finite:
        run.state.consecutive_skips = 0
        with phase("optimizer"):
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
    return StepResult(step_loss, grad_norm, global_tokens, global_sq_lengths, global_positions, finite, metrics)


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
        shown = [name for name in run.objective.progress_metrics if name in step_metrics]  # (KTO: a step's rows
        # may all be desirable, without rewards/margins)
        progress.set_postfix(loss=f"{step_metrics['loss']:.4f}", lr=f"{step_metrics['lr']:.2e}",
                             **{name.rsplit("/", 1)[-1]: f"{step_metrics[name]:.3f}" for name in shown},
                             **meter.postfix(step_metrics))
    if step % run.config.train.log_every == 0 or step == max_steps or step == 1:
        metrics.write(step, step_metrics)
    run.plugins.call("hfsdp_on_step_end", run=run, step=step, metrics=step_metrics)
