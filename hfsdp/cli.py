"""The ``hfsdp`` command line. The only module that reads argv and the environment.

Heavy libraries (torch, transformers, accelerate) are imported inside the commands that need them, so ``--help``,
``validate`` and ``plugins`` answer quickly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from hfsdp import __version__, quiet
from hfsdp.errors import PluginError, Stopped, UserError
from hfsdp.export.gguf_file import QUANTS as GGUF_QUANTS
from hfsdp.parallel import launcher

def cache_dir() -> Path:
    """Where built-in models and the preprocessing cache live: ``HFSDP_CACHE_DIR``, default ``~/.cache/hfsdp`` (the
    CLI reads the environment; benchmarks and scripts ask here)."""
    return Path(os.environ.get("HFSDP_CACHE_DIR", Path.home() / ".cache" / "hfsdp")).expanduser()


def _fail(err: BaseException) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    code = 128 + err.signum if isinstance(err, Stopped) else getattr(err, "exit_code", 1)
    if isinstance(err, Stopped) and launcher.another_rank_said(os.environ):
        pass  # torchrun stopped this rank because another said its error
    elif code == UserError.exit_code:  # the user's error: said once on a node's ranks (torchrun), not by each
        if launcher.first_to_say(os.environ, f"hfsdp: error: {err}"):
            click.echo(f"{prefix}hfsdp: error: {err}", err=True)
    elif isinstance(err, UserError):
        click.echo(f"{prefix}hfsdp: error: {err}", err=True)
    else:
        click.echo(f"{prefix}hfsdp: {err}", err=True)
        if isinstance(err, PluginError) and os.environ.get("HFSDP_DEBUG"):
            import traceback

            traceback.print_exception(err.cause)
    sys.exit(code)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (UserError, PluginError, Stopped) as err:
            _fail(err)


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT raise :class:`hfsdp.errors.Stopped` (the training loop asks for a checkpoint instead)."""
    import signal

    def stop(signum, frame):
        raise Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="hfsdp")
@click.option("-v", "--verbose", is_flag=True,
              help="Also show library warnings hidden by default (as does HFSDP_DEBUG=1).")
def cli(verbose: bool) -> None:
    """Fine-tune Hugging Face causal LMs with PyTorch FSDP through Accelerate, from one YAML file.

    \b
    Quick start (no GPU, no hub: a real SmolLM2-135M on a bundled task):
      hfsdp train
    On GPUs:   accelerate launch -m hfsdp train my.yaml
    On CPUs:   torchrun --nproc-per-node 2 -m hfsdp train my.yaml   (FSDP rehearsal on gloo)
    """
    if not (verbose or os.environ.get("HFSDP_DEBUG")):
        quiet.hide_library_warnings()


@cli.command()
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. --set train.max_steps=10 (repeatable).")
@click.option("--resume", "resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Continue from the latest complete checkpoint in train.output_dir, or from PATH.")
@click.option("--overwrite", is_flag=True, help="Replace an earlier run in train.output_dir.")
def train(config: str | None, overrides: tuple[str, ...], resume: str | None, overwrite: bool) -> None:
    """Train from CONFIG (a YAML file or a preset name; default: the `default` preset)."""
    from hfsdp.config.files import resolve_config_path, validated_config

    _stop_on_signals()  # a signal before the first step puts back the earlier run --overwrite or --resume set aside

    source = str(resolve_config_path(config))
    cfg, host, found = validated_config(config, overrides)
    launcher.check_rank_variables(os.environ)
    import torch

    from hfsdp.model import loading
    from hfsdp.rules.table import PHASES, Facts, enforce
    from hfsdp.setup.decide import decide

    # the config against what it runs on (its data, the world, a trial of its values, the model), then the run; the
    # model's phase imports transformers, which reads no ACCELERATE_* or FSDP_* variable before an Accelerator exists
    world = launcher.launched_world(os.environ, on_cpu=not torch.cuda.is_available())
    enforce(cfg, Facts(host, world, **loading.model_facts(cfg.model, cache_dir())), PHASES, source=source,
            resume=resume, found=found, overrides=overrides)
    setup = decide(cfg, world, resume)
    launcher.apply_wrapper(os.environ, setup)
    notes = launcher.take_launcher_settings(os.environ, setup.config, world.on_cpu)
    from hfsdp.parallel.world import runtime_env

    for key, value in runtime_env(setup.config, world).items():
        os.environ.setdefault(key, value)  # a value the user chose stays (set before CUDA starts)
    if world.rank == 0:
        for note in notes:
            click.echo(f"hfsdp: {note}", err=True)
    from hfsdp.run.state import Options
    from hfsdp.run.loop import Preempted, train as run_training

    try:
        from hfsdp.run.heap import malloc_set_by_environment

        run_training(setup, host, Options(cache_dir=cache_dir(), overwrite=overwrite,
                                          malloc_set=malloc_set_by_environment(os.environ)))
    except Preempted as stop:
        # A complete checkpoint exists; exit like a process killed by the signal would (143 SIGTERM, 130 SIGINT),
        # so schedulers see a preemption, not a failure of the job's own making.
        if world.rank == 0:
            click.echo(f"hfsdp: {stop}; continue with: hfsdp train {config or ''} --resume".replace("  ", " "),
                       err=True)
        sys.exit(128 + stop.signum)


@cli.command()
@click.argument("config")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key.")
@click.option("--no-rows", is_flag=True,
              help="Check the config only: no tokenizer, no rows, no trial step of the optimizer with "
                   "train.optimizer_args' values (and no torch import: a fraction of a second).")
def validate(config: str, overrides: tuple[str, ...], no_rows: bool) -> None:
    """Validate CONFIG and print it resolved (defaults filled in). Exit 2 listing every problem.

    Also runs a sample of the local data files' rows through the format's tokenization (with the model's
    tokenizer, no weights), so that a row the format cannot read is reported with its number and the fix here,
    not at train time, and tries train.optimizer_args' values on a small layer; a summary line goes to stderr.
    --no-rows skips both."""
    import yaml

    from hfsdp.config.files import resolve_config_path, validated_config
    from hfsdp.rules.table import Facts, enforce

    cfg, host, found = validated_config(config, overrides)
    enforce(cfg, Facts(host), ("config", "data") if no_rows else ("config", "data", "trial"),
            source=str(resolve_config_path(config)), found=found, overrides=overrides)
    if not no_rows:
        from hfsdp.data import prepare
        from hfsdp.model import chat_template, loading  # torch and transformers

        tokenizer = loading.tokenizer_of(cfg.model, cache_dir())
        if tokenizer is None:
            click.echo(f"data: rows not checked: the tokenizer of {cfg.model.name_or_path} is not available "
                       "offline", err=True)
        else:
            chat_template.use(tokenizer, cfg.data.chat_template)
            click.echo(prepare.check_rows(cfg, host, tokenizer), err=True)
    click.echo(yaml.safe_dump(cfg.to_yaml_dict(), sort_keys=False), nl=False)


@cli.command(name="export")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a key of the checkpoint's config (e.g. --set lora.merge=true).")
@click.option("--merge-lora", is_flag=True,
              help="Runs that trained adapters (LoRA): write full weights with the adapters merged in instead of "
                   "the adapters alone (same as --set lora.merge=true).")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Largest safetensors file, e.g. 200MB or 1GiB (default 2GiB). Export streams one tensor at a "
                   "time into the files, so its memory does not depend on this.")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "gguf"]), default="safetensors", show_default=True,
              help="gguf: also write the model as a GGUF file (llama.cpp, Ollama, LM Studio) and an Ollama Modelfile "
                   "beside the Hugging Face folder, LoRA adapters merged.")
@click.option("--quant", type=click.Choice(GGUF_QUANTS), default=None,
              help="With --format gguf: the matrices' tensor type [default: q8_0].")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT_DIR if it holds an earlier hfsdp export (anything else in it is never removed).")
def export_cmd(source: Path, out_dir: Path, overrides: tuple[str, ...], merge_lora: bool,
               max_shard_size: str | None, fmt: str, quant: str | None, overwrite: bool) -> None:
    """Export SOURCE into a Hugging Face safetensors folder (LoRA runs: the adapter): a checkpoint (FULL or SHARDED:
    consolidated), a finished run's final/, or a run folder (its final/, else its last checkpoint).

    OUT_DIR must be new or empty (or an earlier export, with --overwrite); it is written next to its final place
    and renamed when complete, so a failed export leaves nothing behind.
    """
    from hfsdp.export.hf_folder import parse_size
    from hfsdp.export.pipeline import export_checkpoint, export_source, gguf_overrides

    overrides = list(overrides)
    if quant is not None and fmt != "gguf":
        raise UserError("--quant is the GGUF file's tensor type: add --format gguf")
    max_shard_bytes = parse_size(max_shard_size) if max_shard_size else None
    exported = export_source(source)
    if fmt == "gguf":
        overrides += gguf_overrides(exported, quant)
        merge_lora = True
    written = export_checkpoint(exported, out_dir, overrides, max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                                cache_dir=cache_dir(), merge_adapters=merge_lora)
    click.echo(f"exported {exported.weights} -> {written}")


@cli.command(name="config-reference")
@click.argument("section", required=False)
@click.option("--enable", "enable", multiple=True, metavar="NAME",
              help="Also load this plugin (name or dotted path) to print its section.")
def config_reference(section: str | None, enable: tuple[str, ...]) -> None:
    """Print the configuration reference (Markdown): every core section and the section of every installed plugin,
    or only SECTION. Keys, types, defaults and meanings come from the schemas that validate the config."""
    from hfsdp.hooks.host import PluginHost, installed_sections
    from hfsdp.config.reference import core_reference, core_sections, plugin_reference

    sections = installed_sections()
    if enable:
        sections.update(PluginHost(list(enable)).config_sections())
    known = [*core_sections(), *sorted(sections)]
    if section is not None and section not in known:
        raise UserError(f"config-reference: no section '{section}' in the core or an installed plugin; sections: "
                        f"{', '.join(known)} (a plugin loaded by dotted path needs --enable PATH)")
    click.echo("\n".join(core_reference(section) + plugin_reference(sections, section)).rstrip())


@cli.command()
def presets() -> None:
    """List the bundled presets (usable as `hfsdp train NAME`)."""
    import yaml

    from hfsdp.config.files import list_presets

    presets = list_presets()
    width = max(map(len, presets))  # the names in one column, the longest included
    for name, path in presets.items():
        first = yaml.safe_load(path.read_text()) or {}
        click.echo(f"{name:{width}s}  model {first.get('model', {}).get('name_or_path', '?')}, "
                   f"data {Path(str(first.get('data', {}).get('path', '?'))).name} — {path}")


@cli.command()
@click.option("--enable", "enable", multiple=True, metavar="NAME", help="Also load this plugin (name or dotted path).")
def plugins(enable: tuple[str, ...]) -> None:
    """List discovered plugins: name, version, source, hooks, and whether they are always on."""
    from hfsdp.hooks.host import PluginHost, discover

    found: dict = {}
    broken: dict[str, str] = {}
    for name in ["", *discover(), *enable]:  # one at a time, so that one broken plugin does not hide the others
        try:
            host = PluginHost([name] if name else [])
        except UserError as err:
            broken[name] = "; ".join(message for _, message in getattr(err, "problems", [])) or str(err)
            continue
        for info in host.plugins:
            found.setdefault(info.name, info)
    for info in found.values():
        state = "always on" if info.always_on else "enable in `plugins:`"
        click.echo(f"{info.name:20s} {info.version:10s} {info.source:28s} {state}")
        click.echo(f"{'':20s} hooks: {', '.join(info.hooks) or '-'}")
    for name, why in broken.items():
        click.echo(f"{name:20s} {'?':10s} {'BROKEN':28s} {why}")
    if broken:
        sys.exit(2)


def _positive_ints(option: str, text: str, what: str) -> list[int]:
    """The comma-separated positive integers of ``option``'s ``text``, else a UserError: give ``what``."""
    from hfsdp.tools.bench import parse_list

    try:
        values = parse_list(text, int)
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{option} '{text}': give {what}")
    return values


@cli.command()
@click.argument("config", required=False)
@click.option("--strategies", default="FULL_SHARD,SHARD_GRAD_OP,NO_SHARD", show_default=True,
              help="Comma-separated sharding strategies to compare.")
@click.option("--nproc", "nprocs", default="1,2", show_default=True, help="Comma-separated process counts.")
@click.option("--steps", default=6, show_default=True, type=click.IntRange(2), help="Steps per run.")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0),
              help="First steps left out of the timing.")
@click.option("--out", "out_dir", default="bench", show_default=True, type=click.Path(path_type=Path),
              help="Folder for bench.md/.csv/.json/.png and the runs.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--wide", is_flag=True, help="Print and write every column (bench.csv/json always have them all).")
@click.option("--profile", is_flag=True,
              help="Also split each rank's step (torch.profiler; CPU): forward, backward, FSDP hooks, clipping, "
                   "optimizer, the rest, and collectives in flight; the profiled steps run slower.")
@click.option("--seq-lens", default=None, metavar="LIST",
              help="Sweep: run every combination at each of these data.max_seq_len values, e.g. 256,1024,4096.")
@click.option("--micro-batches", default=None, metavar="LIST",
              help="Sweep: and at each of these train.per_device_batch_size values, e.g. 1,4,16; with --seq-lens, "
                   "every pair. A sweep's table and bench.png put hfsdp plan's predicted peak beside the measured.")
def bench(config: str | None, strategies: str, nprocs: str, steps: int, warmup: int, out_dir: Path,
          overrides: tuple[str, ...], wide: bool, profile: bool, seq_lens: str | None,
          micro_batches: str | None) -> None:
    """Compare sharding strategies and process counts on CONFIG (default: the `bench` preset).

    Each combination is a real `torchrun -m hfsdp train` job (gloo on CPU, NCCL on GPUs). Writes a table of
    per-rank parameter/gradient/optimizer bytes, peak memory per rank, step time and tokens/s, with ratios
    against NO_SHARD and against one process, as Markdown, CSV, JSON and a PNG chart.
    """
    from hfsdp.tools.bench import BenchOptions, bench as run_bench, parse_list

    if warmup >= steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {steps}")
    sweep = {}
    if seq_lens is not None:
        sweep["seq_lens"] = _positive_ints("--seq-lens", seq_lens, "positive integers, e.g. 256,1024")
    if micro_batches is not None:
        sweep["micro_batches"] = _positive_ints("--micro-batches", micro_batches, "positive integers, e.g. 1,4")
    try:
        run_bench(BenchOptions(config=config or "bench", strategies=parse_list(strategies),
                               nprocs=parse_list(nprocs, int), steps=steps, warmup=warmup, out=out_dir,
                               overrides=list(overrides), wide=wide, profile=profile, cache_dir=cache_dir(),
                               **sweep), echo=click.echo)
    except (ValueError, RuntimeError) as err:
        raise UserError(str(err)) from None


@cli.command()
@click.argument("config", required=False)
@click.option("--nproc", "nprocs", default="1,2,8", show_default=True, help="Comma-separated processes per node.")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(1), help="Nodes (ranks = nproc x nodes).")
@click.option("--device-memory", default="80GiB", show_default=True, metavar="SIZE",
              help="Memory budget per device, e.g. 80GiB, 24GB.")
@click.option("--strategies", default=None, metavar="LIST",
              help="Comma-separated sharding strategies (default: all four with --nodes > 1, else all but HYBRID_SHARD).")
@click.option("--tp", "tps", default=None, metavar="LIST",
              help="Comma-separated tensor-parallel sizes to plan (parallel.tp_size), e.g. 1,8 [default: the config's].")
@click.option("--sp", "sps", default=None, metavar="LIST",
              help="Comma-separated sequence-parallel sizes to plan (parallel.sp_size), e.g. 1,2,4; each row then "
                   "also says the longest row that fits [default: the config's].")
@click.option("--cp", "cps", default=None, metavar="LIST",
              help="Comma-separated context-parallel sizes to plan (parallel.cp_size: ring attention), e.g. 1,2,4; "
                   "each row then also says the ring's bytes and the longest row that fits [default: the "
                   "config's].")
@click.option("--ep", "eps", default=None, metavar="LIST",
              help="Comma-separated expert-parallel sizes to plan (parallel.ep_size, a mixture of experts), e.g. "
                   "1,2,8; each row then says a rank's experts per layer and its all-to-all bytes [default: the "
                   "config's].")
@click.option("--image-tokens", default=None, type=click.IntRange(0), metavar="N",
              help="A vision-language model's image tokens a row (the vision tower runs on the images they come "
                   "from); 0 for rows without images [default: data.max_seq_len, as many as a row holds].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the estimates as JSON instead of a table.")
@click.option("--png", "png", default=None, type=click.Path(path_type=Path), help="Also plot peak memory per rank.")
def plan(config: str | None, nprocs: str, nodes: int, device_memory: str, strategies: str | None,
         tps: str | None, sps: str | None, cps: str | None, eps: str | None, image_tokens: int | None,
         overrides: tuple[str, ...],
         as_json: bool, png: Path | None) -> None:
    """Predict memory per rank for CONFIG under each strategy and world size, without loading weights.

    The model is built on the meta device from its config (a built-in model, a local folder, or a hub id whose
    architecture config ships with hfsdp); nothing is downloaded or launched. Rows that do not fit the device
    budget name the cheapest change that would, checked by the same estimate.
    """
    import json

    from hfsdp.tools.bench import parse_list
    from hfsdp.export.hf_folder import parse_size
    from hfsdp.model.loading import architecture_config
    from hfsdp.rules.table import load_checked
    from hfsdp.config.schema import STRATEGIES
    from hfsdp.tools.plan.planner import Planner, plan as run_plan
    from hfsdp.tools.plan.table import header, plot, text_table, to_json

    cfg, _ = load_checked(config, overrides)
    names = parse_list(strategies) if strategies else [s for s in STRATEGIES if nodes > 1 or s != "HYBRID_SHARD"]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise UserError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    sizes = _positive_ints("--nproc", nprocs, "positive process counts per node, e.g. 1,2,8")
    tp_sizes = _positive_ints("--tp", tps, "positive tensor-parallel sizes, e.g. 1,8") if tps else None
    sp_sizes = _positive_ints("--sp", sps, "positive sequence-parallel sizes, e.g. 1,2,4") if sps else None
    cp_sizes = _positive_ints("--cp", cps, "positive context-parallel sizes, e.g. 1,2,4") if cps else None
    ep_sizes = _positive_ints("--ep", eps, "positive expert-parallel sizes, e.g. 1,2,8") if eps else None
    budget = parse_size(device_memory)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model_config = architecture_config(cfg.model.name_or_path, cfg.model, cache_dir())
    if image_tokens is not None:
        from hfsdp.rules.vision import is_vision_language

        if not is_vision_language(model_config):
            raise UserError(f"--image-tokens: {cfg.model.name_or_path} is a text-only model, which reads no image; "
                            "leave --image-tokens out")
        if image_tokens > cfg.data.max_seq_len:
            raise UserError(f"--image-tokens {image_tokens}: more than a row holds (data.max_seq_len: "
                            f"{cfg.data.max_seq_len}); give at most {cfg.data.max_seq_len}")
    planner = Planner(model_config, cfg, budget, cache_dir(), image_tokens)
    rows = run_plan(planner, names, sizes, nodes, tp_sizes, sp_sizes, ep_sizes, cp_sizes)
    facts, shape = planner.facts(tuple(cfg.plugins)), planner.shape(tuple(cfg.plugins))
    images = planner.activations(rows[0].setup).images
    if as_json:
        click.echo(json.dumps(to_json(rows, facts, budget, shape, images, planner.image_tokens_per_row()), indent=2))
    else:
        click.echo(header(facts, cfg, budget, rows, planner.objective(tuple(cfg.plugins)),
                          planner.frozen(tuple(cfg.plugins)), shape, images, planner.image_tokens_per_row()))
        click.echo(text_table(rows, facts.experts))
    if png is not None:
        plot(rows, budget, png, f"{facts.name}: predicted peak memory per rank")
        if not as_json:
            click.echo(f"plan: wrote {png}")


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", default="loss.png", show_default=True, type=click.Path(path_type=Path),
              help="The PNG to write.")
def plot(run_dirs: tuple[Path, ...], out: Path) -> None:
    """Plot train loss, eval loss and learning rate against step for one or more runs (their train.output_dir),
    overlaid, from each run's metrics.jsonl. Needs matplotlib."""
    from hfsdp.run.plots import plot_runs

    click.echo(f"wrote {plot_runs(list(run_dirs), out)}")


@cli.command(name="eval")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--tasks", required=True, metavar="NAMES",
              help="lm-eval tasks, groups or tags, comma-separated (bundled: contacts_mc).")
@click.option("--include-path", "include_paths", multiple=True, type=click.Path(path_type=Path), metavar="FOLDER",
              help="A folder of lm-eval task YAML files of your own (repeatable), as lm-eval's --include_path.")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="Examples in each prompt.")
@click.option("--limit", type=click.FloatRange(min=0, min_open=True), default=None,
              help="At most this many documents a task (or this share of them, below 1).")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests a forward, on each rank.")
def eval_cmd(model_dir: Path, tasks: str, include_paths: tuple[Path, ...], num_fewshot: int | None,
             limit: float | None, batch_size: int) -> None:
    """Score MODEL_DIR (what `hfsdp export` wrote, or a run folder: its final/) on lm-evaluation-harness tasks.

    Launched on several ranks (torchrun), the model is sharded over them as in training and the requests split
    between them. Writes eval_results.json into the model folder and, for a run's final/, `lm_eval` into the run's
    summary.json."""
    from hfsdp.tools import harness

    names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not names:
        raise UserError("--tasks: name at least one lm-eval task (bundled: contacts_mc)")
    folder = harness.model_folder(model_dir)
    launcher.check_rank_variables(os.environ)
    import torch

    world = launcher.launched_world(os.environ, on_cpu=not torch.cuda.is_available())
    manager = harness.task_manager(list(include_paths))
    harness.check_tasks(manager, names)
    harness.check_task_data(manager, names)
    harness.join(world)
    try:
        results = harness.evaluate(folder, names, manager, world, batch_size=batch_size, num_fewshot=num_fewshot,
                                   limit=limit)
        if world.rank == 0:
            from lm_eval.utils import make_table

            click.echo(make_table(results))
            try:
                written = harness.record(folder, results, names, world)
            except OSError as err:
                raise UserError(f"the scores are above, but they could not be written into {folder} ({err}); "
                                "evaluate a copy of the folder where you can write") from err
            click.echo("wrote " + ", ".join(map(str, written)))
    finally:
        harness.leave(world)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                "help_option_names": []})
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED, metavar="[TORCHRUN OPTIONS] COMMAND [ARGS]")
@click.pass_context
def launch(ctx: click.Context, args: tuple[str, ...]) -> None:
    """torchrun for hfsdp's commands, reporting a failed job in hfsdp's words: `hfsdp launch --nproc-per-node 2
    train my.yaml` starts the processes `torchrun --nproc-per-node 2 -m hfsdp train my.yaml` starts (the same
    options: multi-node, elastic restarts), and where a rank fails the job ends with that rank's exit code (2 for
    your error, said once), without torchrun's traceback and failure report (its exit code is 1 whatever the
    ranks said)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    split = next((i for i, arg in enumerate(args) if arg in cli.commands), None)
    if split is None and {"-h", "--help"} & set(args):
        click.echo(ctx.get_help())
        return
    if split is None:
        raise UserError(f"hfsdp launch: name the hfsdp command the ranks run after torchrun's options, e.g. `hfsdp "
                        f"launch --nproc-per-node 2 train my.yaml` (commands: {', '.join(sorted(cli.commands))})")
    try:
        parsed = get_args_parser().parse_args([*args[:split], "--module", "hfsdp", *args[split:]])
    except SystemExit as usage:  # argparse said what is wrong with torchrun's options
        sys.exit(2 if usage.code else 0)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the ranks say what went wrong
    try:
        run(parsed)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -N: killed by signal N
        if code != UserError.exit_code:  # (the user's error was said by the ranks)
            killed = f" (killed by {failure.signal_name()})" if failure.exitcode < 0 else ""
            click.echo(f"hfsdp: launch: rank {rank} exited {failure.exitcode}{killed} first; the job stopped",
                       err=True)
        sys.exit(code)
    except SignalException as stopped:  # the launcher itself was signalled: its ranks were stopped first
        sys.exit(128 + stopped.sigval)


def main() -> None:
    cli(prog_name="hfsdp")


if __name__ == "__main__":
    main()
