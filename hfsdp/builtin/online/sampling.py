"""Sampling the online objectives' completions (:func:`sample`): all at once with the KV cache (``generate``), each
token drawn by its completion's own seeded generator (:func:`seeded_sampler`) from the logits over the temperature,
cut to the top k and the top-p nucleus as transformers' warpers cut them (:func:`filtered_logits`), up to and
including the first EOS (:func:`completion_mask`). A completion's tokens depend on its prompt and generator alone,
whatever else is sampled beside it, on whichever rank."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hfsdp.builtin.online.schema import OnlineSection


def filtered_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Logits divided by the temperature, then cut to the top k and the top-p nucleus (as transformers' warpers)."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        ordered, index = torch.sort(logits, descending=False, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1] = False  # keep at least the likeliest token
        logits = logits.masked_fill(remove.scatter(-1, index, remove), -math.inf)
    return logits


def seeded_sampler(generators: list[torch.Generator], temperature: float, top_k: int, top_p: float):
    """A transformers logits processor that draws each row's next token with that row's generator and leaves only
    it possible, so that greedy decoding emits it: a row's tokens depend on its generator and its logits alone."""
    from transformers import LogitsProcessor

    class SeededSampler(LogitsProcessor):
        def __call__(self, input_ids, scores):
            probs = filtered_logits(scores, temperature, top_k, top_p).softmax(-1).cpu()
            drawn = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
            out = torch.full_like(scores, -math.inf)
            out[torch.arange(len(drawn)), drawn.to(scores.device)] = 0.0
            return out

    return SeededSampler()


def completion_mask(completions: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """TRL's mask of the generated tokens: up to and including the first EOS."""
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device))
    eos_at = torch.full((completions.size(0),), completions.size(1), dtype=torch.long, device=completions.device)
    has = is_eos.any(1)
    eos_at[has] = is_eos.int().argmax(1)[has]
    return torch.arange(completions.size(1), device=completions.device)[None] <= eos_at[:, None]


def eos_ids(unwrapped, tokenizer) -> list[int]:
    """The token ids that end a completion: the model's generation config's, else the tokenizer's EOS."""
    eos = unwrapped.generation_config.eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def sample(model, unwrapped, prompts: list[list[int]], seeds: list[int], pad_id: int, width: int,
           section: OnlineSection, eos: list[int], gather: bool, synced: bool,
           max_new_tokens: int | None = None) -> list[list[int]]:
    """Completions (token ids up to and including the first EOS) of the prompts, one seeded generator each, of at
    most ``max_new_tokens`` (default ``section.max_new_tokens``) tokens drawn as the section's ``temperature``,
    ``top_k`` and ``top_p`` say (``model``: the wrapped model, ``unwrapped`` its module; ``gather``:
    ``fsdp.gather_for_generation``).

    A row's tokens depend on its prompt and generator alone: the prompts are left-padded to ``width`` (the longest
    prompt of everything sampled together on any rank, not of this rank's share), and a row's logits do not depend
    on the other rows of the batch (the rows of a matrix product and of attention are computed apart). With several
    ranks (``synced``: transformers' ``synced_gpus``) every rank takes as many decode steps as the rank that stops
    last, its finished rows stepping on padding, as FSDP needs every rank in each forward; a rank without prompts
    (an eval of fewer prompts than ranks) samples one padding row in step with them and returns none."""
    from transformers import GenerationConfig, LogitsProcessorList

    from hfsdp.run.generation import generating

    wanted = len(prompts)
    if not wanted:
        prompts, seeds = [[pad_id]], [0]
    device = next(unwrapped.parameters()).device
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    most = section.max_new_tokens if max_new_tokens is None else max(max_new_tokens, 1)
    config = GenerationConfig(max_new_tokens=most, do_sample=False, pad_token_id=pad_id,
                              eos_token_id=eos, use_cache=True)
    sampler = seeded_sampler([torch.Generator().manual_seed(seed) for seed in seeds], section.temperature,
                             section.top_k, section.top_p)
    with generating(model, gather):
        out = unwrapped.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                                 logits_processor=LogitsProcessorList([sampler]), synced_gpus=synced)
    generated = out[:, width:]
    mask = completion_mask(generated, eos)
    return [row[m].tolist() for row, m in zip(generated.cpu(), mask.cpu())][:wanted]
