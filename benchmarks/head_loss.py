"""The output head and its loss alone, forward and backward, three ways, side by side in one invocation:

* ``plain``: the full logits of the labelled positions, then the cross entropy (``train.chunked_loss: false``);
* ``chunked``: ``hfsdp.model.token_loss.chunked_cross_entropy`` as training runs it (each chunk's gradients made in the forward,
  scaled in backward: one head projection per chunk);
* ``recompute``: each chunk under ``torch.utils.checkpoint`` (the chunked loss before issue 40: its projection made
  again in backward).

    python benchmarks/head_loss.py [--vocab 49152] [--hidden 576] [--positions 130 512] [--repeats 5]

SmolLM2-135M's head by default (tied, 49,152 x 576, float32); ``--positions`` are labelled positions of a micro-batch
(the peer benchmark's work has about 130). Prints the fastest of ``--repeats`` for each, after a warm-up, in rounds
that alternate the three, and the largest difference of their losses and gradients.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--positions", type=int, nargs="+", default=[130, 512])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    from hfsdp.model.token_loss import LOSS_CHUNK_ELEMENTS, chunked_cross_entropy

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(a.vocab, a.hidden) * 0.02)
    chunk = max(1, LOSS_CHUNK_ELEMENTS // a.vocab)

    def head(x):
        return F.linear(x, weight)

    def loss_of(x, t):
        return F.cross_entropy(head(x).float(), t, reduction="sum")

    ways = {
        "plain": lambda h, t: loss_of(h, t),
        "chunked": lambda h, t: chunked_cross_entropy(head, h, t, chunk, (weight,)),
        "recompute": lambda h, t: sum(torch.utils.checkpoint.checkpoint(loss_of, h[i:i + chunk], t[i:i + chunk],
                                                                        use_reentrant=False)
                                      for i in range(0, h.size(0), chunk)),
    }
    for n in a.positions:
        hidden = torch.randn(n, a.hidden)
        targets = torch.randint(0, a.vocab, (n,))
        best, results = {}, {}
        for round_ in range(a.repeats + 1):  # round 0 warms up
            for name, way in ways.items():
                weight.grad = None
                h = hidden.clone().requires_grad_()
                start = time.perf_counter()
                loss = way(h, targets)
                loss.backward()
                took = time.perf_counter() - start
                if round_:
                    best[name] = min(best.get(name, took), took)
                results[name] = (loss.detach(), h.grad, weight.grad)
        ref = results["plain"]
        diff = max(float((x - y).abs().max() / y.abs().max()) for r in results.values() for x, y in zip(r, ref))
        print(f"{n} positions: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in best.items())
              + f"; chunked ÷ plain {best['chunked'] / best['plain']:.2f}, recompute ÷ plain "
              f"{best['recompute'] / best['plain']:.2f} (time); largest difference {diff:.1e} (relative to the "
              "largest value)")


if __name__ == "__main__":
    main()
