"""Would fusing a decoder layer's projections pay on this machine? Issue 40 point 4, measured before it is built.

For a Llama-family layer of the given model (default: the built-in SmolLM2-135M's shapes), at ``--tokens`` positions,
each timed alone (forward, the input's gradient and the weights' gradients, through autograd), alternating, the
fastest of ``--repeats``:

* ``qkv``: three Linears (q, k, v) against one Linear over their weights concatenated in the forward (what a
  load-time fusion that keeps the model's own parameters, for checkpoints, export and LoRA targets, would run; the
  concatenation's copy and its gradient's split count);
* ``gate_up``: the MLP's gate and up projections, the same way.

Prints each pair's times, the fused ÷ separate ratio and what the model's layers would save per micro-batch.

    python benchmarks/fused_projections.py [--tokens 448] [--repeats 20] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import best_of  # noqa: E402


def pair(tokens: int, fan_in: int, outs: list[int], repeats: int) -> tuple[float, float]:
    """(separate, fused) seconds of forward and backward of Linears ``fan_in -> outs`` at ``tokens`` positions."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=g, requires_grad=True)
    weights = [torch.randn(o, fan_in, generator=g, requires_grad=True) for o in outs]
    grads = [torch.randn(tokens, o, generator=g) for o in outs]

    def separate():
        ys = [torch.nn.functional.linear(x, w) for w in weights]
        torch.autograd.grad(ys, [x, *weights], grads)

    def fused():
        y = torch.nn.functional.linear(x, torch.cat(weights))
        torch.autograd.grad(y.split(outs, dim=-1), [x, *weights], grads)

    times = {"separate": [], "fused": []}
    for _ in range(3):  # alternate, so that a slow spell of a shared machine hits both
        times["separate"].append(best_of(separate, repeats))
        times["fused"].append(best_of(fused, repeats))
    return min(times["separate"]), min(times["fused"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=448, help="positions of a micro-batch (the peer work: 4 rows "
                                                                "padded to about 112)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()

    from hfsdp.cli import cache_dir
    from hfsdp.model import loading
    from hfsdp.config.schema import ModelConfig

    cfg = ModelConfig(name_or_path=args.model)
    c = loading.load_model_config(loading.resolve_model_path(cfg.name_or_path, cache_dir()), cfg)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim
    layers = c.num_hidden_layers
    print(f"{args.model}: {layers} layers, hidden {c.hidden_size}, q {c.num_attention_heads * head_dim}, k/v {kv}, "
          f"intermediate {c.intermediate_size}; {args.tokens} positions, fastest of {args.repeats} x 3 alternations")
    total_sep = total_fused = 0.0
    for name, outs in (("qkv", [c.num_attention_heads * head_dim, kv, kv]),
                       ("gate_up", [c.intermediate_size, c.intermediate_size])):
        sep, fused = pair(args.tokens, c.hidden_size, outs, args.repeats)
        total_sep, total_fused = total_sep + sep, total_fused + fused
        print(f"{name}: separate {sep * 1e3:.2f} ms, fused {fused * 1e3:.2f} ms, fused / separate {fused / sep:.3f}")
    print(f"all {layers} layers, per micro-batch: separate {total_sep * layers:.3f} s, fused {total_fused * layers:.3f} "
          f"s, saving {(total_sep - total_fused) * layers:+.3f} s")


if __name__ == "__main__":
    main()
