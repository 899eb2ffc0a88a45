"""The end of a completed run: the final export, ``summary.json``, the last hook, the printed summary and the loss
plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hfsdp.config.schema import HfsdpConfig
from hfsdp.export.card import Trained
from hfsdp.export.pipeline import write_export
from hfsdp.model import quantized
from hfsdp.run import generation, optimizers, plots, throughput
from hfsdp.run.metrics import MetricsWriter
from hfsdp.run.state import Run


def export_model(run: Run, out_dir: Path) -> None:
    """The trained model into ``out_dir`` (replacing an earlier export there). Collective: every rank calls it."""
    accelerator = run.accelerator
    # schedule-free: the averaged weights it evaluates with, held while they are written (one process's state dict
    # holds the parameters themselves)
    with optimizers.evaluation_weights(run.optimizer):
        state_dict = accelerator.get_state_dict(run.model)  # collective: full tensors land on the main process
        unwrapped = accelerator.unwrap_model(run.model)
        weights = quantized.exported_weights(state_dict, run.config,
                                             lambda: dict(quantized.quantized_linears(unwrapped)), check_bytes=False)
        if accelerator.is_main_process:
            write_export(run.plugins, out_dir, weights, config=run.config, model_config=run.model_config,
                         tokenizer=run.tokenizer, generation_config=run.generation_config,
                         model_files=run.model_files, overwrite=True,
                         trained=Trained(run.state.step, run.accelerator.num_processes, run.state.tokens_seen))
    accelerator.wait_for_everyone()


def finish(run: Run, summary: dict[str, Any], metrics: MetricsWriter,
           generations: dict[str, generation.GenerationResult]) -> None:
    """The end of a completed run: ``summary.json``, ``hfsdp_on_train_end``, the summary and the loss plot."""
    import json

    if run.is_main_process:
        (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    run.plugins.call("hfsdp_on_train_end", run=run, metrics=summary["after"])
    metrics.close()
    run.accelerator.print(format_summary(summary, generations, run.config))
    if run.is_main_process and run.config.train.loss_plot:
        run.accelerator.print(plots.run_plot(run.output_dir))


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
    gen_before, gen_after = generations.get("before"), generations.get("after")
    if "gen_exact_match" in before and "gen_exact_match" in after:
        what = gen_after.compared if gen_after else None  # rows scored their own way: what they compare
        lines.append(f"generation exact match {before['gen_exact_match']:.1%} -> {after['gen_exact_match']:.1%}"
                     + (f" (compared: {what})" if what else ""))
    show = config.generation_eval.show if config.generation_eval else 0
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
