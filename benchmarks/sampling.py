"""The inline sampler (``hfsdp.builtin.online.sampling.sample``) against the path it replaced (issue 70): transformers'
``generate`` on the prompts repeated ``num_generations`` times, each token drawn by the row's own seeded generator
through a logits processor (:func:`generate_sample`, kept here as the reference: tests/test_sampling.py compares
the two too). The inline sampler prefills each distinct prompt once and copies its KV cache to its group.

The config's (default the ``grpo`` preset: the real SmolLM2-135M-Instruct, 8 completions a device batch, 4 per
prompt, 40 new tokens) first ``--rounds`` rounds as one process samples them (the plan's prompts, left-padded to
the round's longest, the seeds of each completion), after a warm-up round, each round ``--repeats`` times by each
path in turn, each path's fastest time counting (the machine may be shared: another process's burst only slows
some repeats). Checks that the two sampled the same completions token for token (exits 1 otherwise) and prints each
round's seconds and each path's generation tokens/s (the completions' tokens, up to and including the EOS, over the
seconds sampling them) and their ratio.

``--continuous-batching``: transformers' continuous batching (``generate_batch``, paged attention) beside the inline
sampler on the same rounds, both greedy (continuous batching draws from one generator of its own, so it cannot give
each completion its own seeded draws: only greedy tokens compare); prints both tokens/s and whether the tokens agree.

    python benchmarks/sampling.py [CONFIG] [--rounds 4] [--repeats 3] [--continuous-batching] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time


def generate_sample(unwrapped, prompts: list[list[int]], seeds: list[int], pad_id: int, width: int, section,
                    eos: list[int], max_new_tokens: int | None = None) -> list[list[int]]:
    """The completions as hfsdp sampled them before the inline sampler (one process): ``generate`` on the prompts
    as given (a group's prompt once per completion), left-padded to ``width``, greedy over a logits processor that
    draws each row's token with that row's generator and leaves only it possible."""
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    from hfsdp.builtin.online.sampling import completion_mask, filtered_logits

    generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    class SeededSampler(LogitsProcessor):
        def __call__(self, input_ids, scores):
            probs = filtered_logits(scores, section.temperature, section.top_k, section.top_p).softmax(-1).cpu()
            drawn = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
            out = torch.full_like(scores, -math.inf)
            out[torch.arange(len(drawn)), drawn.to(scores.device)] = 0.0
            return out

    device = next(unwrapped.parameters()).device
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    most = section.max_new_tokens if max_new_tokens is None else max(max_new_tokens, 1)
    config = GenerationConfig(max_new_tokens=most, do_sample=False, pad_token_id=pad_id, eos_token_id=eos,
                              use_cache=True)
    with torch.no_grad():
        out = unwrapped.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                                 logits_processor=LogitsProcessorList([SeededSampler()]))
    generated = out[:, width:]
    mask = completion_mask(generated, eos)
    return [row[m].tolist() for row, m in zip(generated.cpu(), mask.cpu())]


def rounds_of(cfg, dataset, count: int) -> list[tuple[list[list[int]], list[int], int]]:
    """The first ``count`` rounds as one process samples them: (a prompt per completion, their seeds, the width)."""
    from hfsdp.builtin.online.groups import GroupPlan, round_share

    section, name = cfg.section(cfg.plugins[0]), cfg.plugins[0]
    group = section.num_generations
    plan = GroupPlan(len(dataset), cfg.train.per_device_batch_size // group, 1, cfg.train.gradient_accumulation_steps,
                     cfg.train.seed, iterations=section.num_iterations)
    out = []
    for round_ in range(count):
        step = round_ * section.num_iterations
        share = round_share(plan, step, round_, 0, group, name, cfg.train.seed)
        prompts = [list(dataset[i]["input_ids"]) for part in share.rows for i in part]
        out.append(([prompts[p] for p in share.positions for _ in range(group)], share.seeds.first_turn(),
                    max(map(len, prompts))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="grpo")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--continuous-batching", action="store_true")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import torch

    from hfsdp.builtin.online.sampling import eos_ids, sample
    from hfsdp.cli import cache_dir
    from hfsdp.config.files import load_config
    from hfsdp.data.prepare import prepare_datasets
    from hfsdp.model import loading

    cfg, host = load_config(args.config, args.overrides)
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    dataset = prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    model = loading.load_model(path, cfg.model).eval()
    section = cfg.section(cfg.plugins[0])
    eos, pad_id = eos_ids(model, tokenizer), tokenizer.pad_token_id
    rounds = rounds_of(cfg, dataset, args.rounds + 1)
    print(f"{cfg.model.name_or_path}, {len(rounds[0][0])} completions a round ({section.num_generations} per prompt), "
          f"max_new_tokens {section.max_new_tokens}, {torch.get_num_threads()} threads; round 0 warms up")

    def inline(prompts, seeds, width, drawn=section):
        return sample(model, model, prompts, seeds, pad_id, width, drawn, eos, gather=False, synced=False)

    def generate(prompts, seeds, width):
        return generate_sample(model, prompts, seeds, pad_id, width, section, eos)

    sides = {"generate": generate, "inline": inline}
    seconds, tokens, same = dict.fromkeys(sides, 0.0), 0, True
    for index, (prompts, seeds, width) in enumerate(rounds):
        results = fastest({name: lambda side=side: side(prompts, seeds, width) for name, side in sides.items()},
                          args.repeats if index else 1)
        agree = results["generate"][0] == results["inline"][0]
        same &= agree
        count = sum(map(len, results["inline"][0]))
        print(f"round {index}: width {width}, {count} tokens, generate {results['generate'][1]:.2f} s, "
              f"inline {results['inline'][1]:.2f} s, {'same' if agree else 'DIFFERENT'} completions", flush=True)
        if index:
            tokens += count
            for name in sides:
                seconds[name] += results[name][1]
    rate = {name: tokens / seconds[name] for name in sides}
    print(f"generation tokens/s over rounds 1-{args.rounds} ({tokens} tokens, the fastest of {args.repeats}): "
          f"generate {rate['generate']:.1f}, inline {rate['inline']:.1f}: {rate['inline'] / rate['generate']:.2f}x")
    if args.continuous_batching:
        compare_continuous_batching(model, rounds, section, eos, pad_id, inline, args.repeats)
    if not same:
        sys.exit("the inline sampler's completions differ from generate's")


def fastest(sides: dict, repeats: int) -> dict[str, tuple]:
    """Each side's (output, fastest seconds) of ``repeats`` calls, the sides called in turn."""
    best = {}
    for _ in range(repeats):
        for name, side in sides.items():
            started = time.perf_counter()
            out = side()
            seconds = time.perf_counter() - started
            best[name] = (out, min(seconds, best.get(name, (None, math.inf))[1]))
    return best


def compare_continuous_batching(model, rounds, section, eos: list[int], pad_id: int, inline, repeats: int) -> None:
    """Greedy tokens/s of transformers' ``generate_batch`` and of the inline sampler (top_k 1) on the rounds
    (round 0 warms up; the fastest of ``repeats``), and whether their tokens agree."""
    from transformers import GenerationConfig

    greedy = section.model_copy(update={"top_k": 1})
    config = GenerationConfig(max_new_tokens=section.max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=pad_id)
    seconds, tokens, agree = {"continuous batching": 0.0, "inline": 0.0}, 0, True
    for index, (prompts, seeds, width) in enumerate(rounds):
        results = fastest({
            "continuous batching": lambda: sorted(output.generated_tokens for output in model.generate_batch(
                inputs=prompts, generation_config=config, progress_bar=False).values()),
            "inline": lambda: sorted(inline(prompts, seeds, width, greedy))}, repeats if index else 1)
        agree &= results["continuous batching"][0] == results["inline"][0]
        if index:
            tokens += sum(map(len, results["inline"][0]))
            for name in seconds:
                seconds[name] += results[name][1]
    print("greedy tokens/s: " + ", ".join(f"{name} {tokens / s:.1f}" for name, s in seconds.items())
          + f"; {'the same' if agree else 'DIFFERENT'} tokens")


if __name__ == "__main__":
    main()
