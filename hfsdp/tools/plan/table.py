"""What ``hfsdp plan`` prints: the header, the table of estimates, JSON and the PNG."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable

from hfsdp.config.schema import HfsdpConfig
from hfsdp.rules import quantization
from hfsdp.tools.plan.estimate import LONGEST_ROW_LIMIT, Estimate
from hfsdp.tools.plan.facts import FrozenFacts, Images, ModelFacts
from hfsdp.units import GIB, MIB

if TYPE_CHECKING:
    from hfsdp.tools.plan.trace import MicroBatchShape


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def table_unit(rows: list[Estimate]) -> tuple[str, int]:
    """GiB when some row peaks above 1 GiB, MiB otherwise."""
    return ("GiB", GIB) if max((e.device_peak for e in rows), default=0) >= GIB else ("MiB", MIB)


def _columns(unit: int, frozen: bool = False, generation: bool = False, sequence: bool = False,
             experts: int = 0) -> list[tuple[str, Callable[[Estimate], str]]]:
    """The table's columns; ``frozen``: a column for the frozen models an objective runs (a teacher);
    ``generation``: one for what an objective's sampling holds (GRPO); ``sequence``: sequence parallelism's
    all-to-all bytes, the ring's bytes (context parallelism) and the longest row that fits (``hfsdp plan --sp``,
    ``--cp``); ``experts`` (a mixture of experts' routed
    experts per layer, where a row splits them: ``hfsdp plan --ep``): a rank's experts per layer and expert
    parallelism's all-to-all bytes."""
    def size(n: int) -> str:
        return f"{n / unit:.2f}"

    return [
        ("ranks", lambda e: f"{e.setup.world}" + (f" ({e.setup.nodes}x{e.setup.nproc_per_node})"
                                                    if e.setup.nodes > 1 else "")
                            + (f" tp{e.setup.dims.tp}" if e.setup.dims.tp > 1 else "")
                            + (f" cp{e.setup.dims.cp}" if e.setup.dims.cp > 1 else "")
                            + (f" sp{e.setup.dims.sp}" if e.setup.dims.sp > 1 else "")
                            + (f" ep{e.setup.dims.ep}" if e.setup.dims.ep > 1 else "")),
        ("strategy", lambda e: e.setup.strategy + ("" if e.setup.runs_as == "FSDP" else f" ({e.setup.runs_as})")
                               + (f" (replicate {e.setup.dims.dp_replicate} x shard {e.setup.dims.dp_shard})"
                                  if e.setup.dims.hybrid else "")),
        ("params", lambda e: size(e.params)),
        ("grads", lambda e: size(e.grads)),
        ("optim", lambda e: size(e.optimizer)),
        ("gathered", lambda e: size(e.gathered)),
        ("activ.", lambda e: size(e.activations + e.loss_transient)),
        *([("frozen", lambda e: size(e.frozen))] if frozen else []),
        *([("sampling", lambda e: size(e.generation))] if generation else []),
        ("peak/rank", lambda e: size(e.device_peak)),
        ("host/rank", lambda e: size(e.host_per_rank)),
        ("load RAM/node", lambda e: size(e.host_load_per_node)),
        ("comm GiB/step fsdp+tp", lambda e: f"{e.fsdp_comm / GIB:.1f}+{e.tp_comm / GIB:.1f}"),
        *([("all-to-all GiB/step", lambda e: f"{e.sp_comm / GIB:.2f}"),
           ("ring GiB/step", lambda e: f"{e.cp_comm / GIB:.2f}"),
           ("longest row", _longest_row)] if sequence else []),
        *([("experts/rank", lambda e: f"{experts // e.setup.dims.ep}"),
           ("ep all-to-all GiB/step", lambda e: f"{e.ep_comm / GIB:.2f}")] if experts else []),
        ("fits", lambda e: "-" if e.problem else ("yes" if e.fits else "NO")),
        ("cheapest change that fits", lambda e: e.problem or e.suggestion or ("-" if e.fits else "none of the listed")),
    ]


def _longest_row(e: Estimate) -> str:
    if e.longest_row is None:
        return "-"
    return f">= {e.longest_row:,}" if e.longest_row >= LONGEST_ROW_LIMIT else f"{e.longest_row:,}"


def text_table(rows: list[Estimate], experts: int = 0) -> str:
    """The rows as a table; ``experts``: the routed experts of each MoE layer (:attr:`ModelFacts.experts`)."""
    columns = _columns(table_unit(rows)[1], any(e.frozen for e in rows), any(e.generation for e in rows),
                       any(e.setup.dims.token_split > 1 or e.longest_row is not None for e in rows),
                       experts if any(e.setup.dims.ep > 1 for e in rows) else 0)
    cells = [[h for h, _ in columns]] + [[f(e) for _, f in columns] for e in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    left = (1, len(columns) - 1)
    return "\n".join("  ".join(c[i].ljust(widths[i]) if i in left else c[i].rjust(widths[i])
                               for i in range(len(columns))).rstrip() for c in cells)


def header(facts: ModelFacts, config: HfsdpConfig, budget: int, rows: list[Estimate], objective=None,
           frozen: tuple[FrozenFacts, ...] = (), shape: MicroBatchShape | None = None, images: Images | None = None,
           image_tokens: int | None = None) -> str:
    fsdp = config.fsdp
    adapted = facts.trainable_params < facts.total_params
    sampling = objective.sampling() if objective is not None else None
    if objective is not None:
        n = objective.sequences_per_row
        loss = f"{type(objective).__name__} ({n} sequence{'s' if n != 1 else ''} a row, full logits)"
    else:
        loss = "chunked" if config.train.chunked_loss else "plain (full logits)"
    tokens = config.data.max_seq_len + (sampling.new_tokens if sampling else 0)
    return (f"{facts.name}: {_count(facts.total_params)} parameters"
            + (f" ({', '.join(said)})" if (said := [
                *([f"{_count(facts.active_params)} active a token"] if facts.active_params is not None else []),
                *([f"{_count(facts.trainable_params)} trainable"] if adapted else [])]) else "")
            + f", {facts.num_layers} layers in {len(facts.units)} FSDP units; weights {config.model.dtype}, "
            f"mixed precision {fsdp.precision_name}, FSDP{fsdp.version}, activation checkpointing "
            f"{'on' if fsdp.activation_checkpointing else 'off'}, cpu offload {'on' if fsdp.cpu_offload else 'off'}\n"
            + (f"micro-batch {shape.rows} x {shape.width} tokens ({shape.packing}), " if shape and shape.packing else
               f"micro-batch {config.train.per_device_batch_size} x {tokens} tokens, ")
            + f"attention {config.model.attn_implementation}, loss {loss}; device budget {budget / GIB:.1f} GiB per rank; "
            f"sizes in {table_unit(rows)[0]} per rank" + quantized_line(facts, config)
            + "".join(f"\nfrozen beside it: {m.name} ({_count(m.numel)} parameters, {m.itemsize} bytes each"
                      + (", sharded by FSDP2 over the ranks of a run that has several, else whole on each"
                         if m.sharded_by_fsdp2 else ", whole on each rank")
                      + (", and its logits over the micro-batch" if m.keeps_logits else "") + "; column frozen)"
                      for m in frozen)
            + (f"\nsampling at each step's start: completions of up to {sampling.new_tokens} tokens after prompts of "
               f"up to {config.data.max_seq_len}, "
               + ("every rank the global batch's" if sampling.whole_global_batch else "each rank its own")
               + ", with the KV cache (column sampling: gathered parameters, cache and transients)"
               if sampling else "")
            + generation_processes_line(facts, config, objective) + images_line(images, image_tokens, config))


def images_line(images: Images | None, image_tokens: int | None, config: HfsdpConfig) -> str:
    """What the plan counted of a vision-language model's images (:class:`Images`; ``image_tokens``: a row's, None
    for a text-only model: no line)."""
    if image_tokens is None:
        return ""
    if images is None:
        return "\nimages: none (--image-tokens 0): the vision tower does not run"
    given = "--image-tokens" if image_tokens != config.data.max_seq_len else "data.max_seq_len; fewer: --image-tokens"
    kept = ("what it keeps for the backward is in column activ." if images.saved else
            "frozen with nothing before it trained, it keeps nothing for the backward")
    return (f"\nimages: the vision tower runs on {images.count} image{'s' if images.count != 1 else ''} a micro-batch "
            f"of {images.tokens} image tokens each, for {image_tokens} image tokens a row ({given}); {kept}")


def generation_processes_line(facts: ModelFacts, config: HfsdpConfig, objective) -> str:
    """The workers engine (``<objective>.generation.engine: workers``): what its generation processes hold beside
    the ranks, in host memory on the first rank's host: the shared weights (the frozen parameters once, the
    trainable ones in ``max_staleness + 1`` slots, in the sampling dtype) and each process's KV cache of its share
    of a round, per completion at full length."""
    generation = getattr(getattr(objective, "section", None), "generation", None)
    if generation is None or generation.engine != "workers":
        return ""
    import torch

    def itemsize(param) -> int:
        return getattr(torch, generation.dtype).itemsize if generation.dtype else param.itemsize

    frozen = sum(p.numel * itemsize(p) for p in facts.params if not p.trainable)
    slot = sum(p.numel * itemsize(p) for p in facts.params if p.trainable)
    shared = frozen + (generation.max_staleness + 1) * slot
    width = config.data.max_seq_len + objective.sampling().new_tokens
    kv = facts.kv_per_token * width * (getattr(torch, generation.dtype).itemsize if generation.dtype
                                       else facts.params[0].itemsize)
    return (f"\ngeneration processes (workers engine, on the CPU of the first rank's host, not in the columns): "
            f"{generation.processes} beside the ranks; shared weights {size_gib(shared)} (frozen {size_gib(frozen)} "
            f"once, trainable {size_gib(slot)} x {generation.max_staleness + 1} slots); each process's KV cache "
            f"{size_gib(kv)} per completion it samples at once (its share of a round); column sampling is the "
            f"inline engine's, an upper bound here (the ranks only gather the parameters to publish them)")


def size_gib(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / MIB:.2f} MiB" if n < GIB else f"{n / GIB:.2f} GiB"


def quantized_line(facts: ModelFacts, config: HfsdpConfig) -> str:
    """QLoRA: what the 4-bit base costs beside what it would in the compute dtype."""
    quant = quantization.settings(config)
    packed = [p for p in facts.params if p.weights]
    if not packed:
        return ""
    state = facts.quant_state_bytes
    packed_bytes = sum(p.numel * p.itemsize for p in packed)
    weights = sum(p.weights for p in packed)
    where = "whole on every rank (uint8 storage)" if quant.quant_storage == "uint8" else "sharded by FSDP2"
    return (f"\n4-bit base ({quant.quant_type}{', double quant' if quant.double_quant else ''}, stored "
            f"{quant.quant_storage}): {_count(weights)} weights in {packed_bytes / GIB:.2f} GiB packed, {where}, "
            f"+ {state / GIB:.2f} GiB quant state on every rank; in bf16 they would be {2 * weights / GIB:.2f} GiB "
            f"({(packed_bytes + state) / (2 * weights):.2f} of it)")


def to_json(rows: list[Estimate], facts: ModelFacts, budget: int, shape: MicroBatchShape | None = None,
            images: Images | None = None, image_tokens: int | None = None) -> dict[str, Any]:
    out = []
    for e in rows:
        d = {k: v for k, v in asdict(e).items() if k != "setup"}
        d.update(strategy=e.setup.strategy, nproc_per_node=e.setup.nproc_per_node, nodes=e.setup.nodes,
                 world=e.setup.world, shard_group=e.setup.dims.shard_group, runs_as_ddp=e.setup.fsdp.runs_as_ddp,
                 tp_size=e.setup.dims.tp, cp_size=e.setup.dims.cp, sp_size=e.setup.dims.sp, ep_size=e.setup.dims.ep,
                 **({"experts_per_rank": facts.experts // e.setup.dims.ep} if facts.experts else {}),
                 runs_as=e.setup.runs_as,
                 plugins=list(e.setup.plugins), fsdp=e.setup.fsdp.model_dump(mode="json"), state=e.state)
        out.append(d)
    return {"model": facts.name, "parameters": facts.total_params, "trainable_parameters": facts.trainable_params,
            **({"active_parameters": facts.active_params} if facts.active_params is not None else {}),
            "fsdp_units": len(facts.units), "fsdp_unit_names": list(facts.units), "device_budget_bytes": budget,
            **({"micro_batch": {"rows": shape.rows, "tokens_per_row": shape.width, "tokens": shape.tokens,
                                "logits_positions_per_row": shape.positions, "packing": shape.packing,
                                **({"image_tokens_per_row": image_tokens, "images": images.count if images else 0,
                                    "image_tokens_per_image": images.tokens if images else 0,
                                    "vision_tower_saved_bytes": images.saved if images else 0}
                                   if image_tokens is not None else {})}}
               if shape is not None else {}),
            "rows": out}


def plot(rows: list[Estimate], budget: int, path, title: str) -> None:
    from hfsdp.run.plots import pyplot

    plt = pyplot(str(path))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in dict.fromkeys(e.setup.strategy for e in rows):
        points = [(e.setup.world, e.device_peak / GIB) for e in rows if e.setup.strategy == strategy and not e.problem]
        if points:
            ax.plot(*zip(*points), marker="o", label=strategy)
    ax.axhline(budget / GIB, color="red", linestyle="--", label=f"budget {budget / GIB:.0f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted peak GiB per rank")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
