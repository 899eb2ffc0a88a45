"""Sampling the online objectives' completions (:func:`sample`): each distinct prompt prefilled once, its KV cache
copied to each of its completions, which then decode together a token a forward (:func:`decode`), each token drawn by
its completion's own seeded generator from the logits over the temperature, cut to the top k and the top-p nucleus
as transformers' warpers cut them (:func:`draw`, :func:`filtered_logits`), up to and including the first EOS
(:func:`completion_mask`). A completion's tokens depend on its prompt and generator alone, whatever else is sampled
beside it, on whichever rank: they are those ``generate`` drew on the prompts repeated once per completion
(benchmarks/sampling.py compares the two)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hfsdp.data.batches import left_padded

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
           section: OnlineSection, eos: list[int], gather: bool, synced: bool, max_new_tokens: int | None = None,
           logps: bool = False, visual: list[dict] | None = None,
           pixels=None) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
    """Completions (token ids up to and including the first EOS) of the prompts, one seeded generator each, of at
    most ``max_new_tokens`` (default ``section.max_new_tokens``) tokens drawn as the section's ``temperature``,
    ``top_k`` and ``top_p`` say (``model``: the wrapped model, ``unwrapped`` its module; ``gather``:
    ``fsdp.gather_for_generation``); with ``logps``, (completions, each token's log-prob under the sampler: of the
    logits over the temperature, before top-k and top-p, as :func:`~hfsdp.builtin.online.rounds.token_logps`).

    Each distinct prompt is prefilled once and its KV cache copied to each of its completions (a group's prompt is
    repeated ``num_generations`` times), which then decode together (:func:`decode`). A row's tokens depend on its
    prompt and generator alone: the prompts are left-padded to ``width`` (the longest prompt of everything sampled
    together on any rank, not of this rank's share), and a row's logits do not depend on the other rows of the
    batch (the rows of a matrix product and of attention are computed apart), so they are those of ``generate`` on
    the repeated prompts (bit for bit on a CPU; a GPU's matrix-product kernel may change with the number of rows,
    and with it the last bits of a logit). With several ranks (``synced``) every rank takes as many decode steps as the
    rank that stops last, its finished rows stepping on padding, as FSDP needs every rank in each forward; a rank
    without prompts (an eval of fewer prompts than ranks) samples one padding row in step with them and returns
    none. A vision-language model's prompts (``visual``: each prompt's dataset row, with its images and the
    processor's per-token inputs; ``pixels``: what makes their pixel inputs) are sampled by
    :func:`sample_with_images`."""
    from hfsdp.run.generation import generating

    if visual is not None:
        with generating(model, gather):
            completions, drawn = sample_with_images(unwrapped, prompts, visual, pixels, seeds, pad_id, width, section,
                                                    eos, synced, max_new_tokens)
        return (completions, drawn) if logps else completions
    wanted = len(prompts)
    if not wanted:
        prompts, seeds = [[pad_id]], [0]
    distinct = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prompts)))}
    device = next(unwrapped.parameters()).device
    padded = left_padded([(list(p), {}) for p in distinct], pad_id, width)
    input_ids, attention = padded["input_ids"].to(device), padded["attention_mask"].to(device)
    most = section.max_new_tokens if max_new_tokens is None else max(max_new_tokens, 1)
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    with generating(model, gather):
        tokens, drawn_logps = decode(unwrapped, input_ids, attention, [distinct[tuple(p)] for p in prompts],
                                     generators, section, eos, pad_id, most, synced)
    mask = completion_mask(tokens, eos)
    completions = [row[m].tolist() for row, m in zip(tokens, mask)][:wanted]
    if not logps:
        return completions
    return completions, [row[m].tolist() for row, m in zip(drawn_logps, mask)][:wanted]


def decode(unwrapped, input_ids: torch.Tensor, attention: torch.Tensor, rows: list[int],
           generators: list[torch.Generator], section: OnlineSection, eos: list[int], pad_id: int, most: int,
           synced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens ``[rows, steps]`` (after a row's EOS, padding) and their log-probs under the sampler, on the CPU,
    of the completions of ``rows`` (each an index into the left-padded prompts ``input_ids``), row ``i``'s tokens
    drawn by ``generators[i]`` (:func:`draw`): the prompts are prefilled once, their KV cache copied to their rows,
    then one forward a token, as ``generate`` steps, until every row has ended (an EOS) or ``most`` tokens; with
    ``synced`` (transformers' ``synced_gpus``) until every rank's have, one all-reduce a step."""
    import torch.distributed as dist

    device = input_ids.device
    index = torch.tensor(rows, device=device)
    named = cache_argument(unwrapped)
    out = unwrapped(input_ids=input_ids, attention_mask=attention, use_cache=True)
    cache, logits = getattr(out, named), out.logits[:, -1].float()[index]
    cache.reorder_cache(index)  # each prompt's keys and values to each of its completions
    attention = attention[index]
    open_ = torch.ones(len(rows), dtype=torch.bool)
    tokens, logps = [], []
    for step in range(most):
        token, logp = draw(logits, generators, open_, section)
        token[~open_] = pad_id  # a finished row steps on padding
        tokens.append(token)
        logps.append(logp)
        open_ &= ~torch.isin(token, torch.tensor(eos))
        if step + 1 == most:
            break
        left = open_.any().float().to(device)
        if synced:
            dist.all_reduce(left)
        if not left.item():
            break
        attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
        logits = unwrapped(input_ids=token[:, None].to(device), attention_mask=attention, **{named: cache},
                           use_cache=True).logits[:, -1].float()
    return torch.stack(tokens, 1), torch.stack(logps, 1).cpu()


def cache_argument(unwrapped) -> str:
    """The name the causal LM's forward gives the KV cache, in and out: ``cache`` (transformers 5) or
    ``past_key_values`` (4.x, which would take ``cache`` into its ``**kwargs`` and decode without it); a LoRA model
    is asked about its base model."""
    import inspect

    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def draw(logits: torch.Tensor, generators: list[torch.Generator], open_: torch.Tensor,
         section: OnlineSection) -> tuple[torch.Tensor, torch.Tensor]:
    """Each open row's next token, drawn by its own generator from the logits over the temperature cut to the top k
    and the top-p nucleus (:func:`filtered_logits`), on the CPU, and its log-prob under the logits over the
    temperature (:func:`hfsdp.objective.target_logps`, as the trainer's), on their device; a closed row draws nothing
    (its token 0)."""
    from hfsdp.objective import target_logps

    probs = filtered_logits(logits, section.temperature, section.top_k, section.top_p).softmax(-1).cpu()
    token = torch.zeros(len(generators), dtype=torch.long)
    for i in open_.nonzero().flatten().tolist():
        token[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return token, target_logps(logits / section.temperature, token.to(logits.device))


def sample_with_images(unwrapped, prompts: list[list[int]], visual: list[dict], pixels, seeds: list[int], pad_id: int,
                       width: int, section: OnlineSection, eos: list[int], synced: bool,
                       max_new_tokens: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Completions of a vision-language model's prompts, and each token's log-prob under the sampler (as
    :func:`sample` gives them), each token drawn as :func:`draw` draws it by the
    completion's own generator, through transformers' ``generate`` (which lays out each family's image positions:
    Qwen's 3-D rope, Gemma 3's image attention): the prompts left-padded to ``width`` with their per-token inputs,
    their images' pixel inputs, and a logits processor that draws each open row's token and leaves ``generate``
    only that one to pick (greedy, no other processor: the model's own generation config is not read). Each prompt
    is prefilled with its completion (no KV cache shared between a group's completions). A rank without prompts
    samples one padding row in step with the others (``synced``: transformers' ``synced_gpus``)."""
    from transformers import GenerationConfig, LogitsProcessorList

    from accelerate.utils import send_to_device

    from hfsdp.data.images import IMAGES_COLUMN, TOWER_PLACEHOLDER
    from hfsdp.model.vision import touch_of

    wanted = len(prompts)
    if not wanted:
        prompts, visual, seeds = [[pad_id]], [{}], [0]
    device = next(unwrapped.parameters()).device
    inputs = left_padded([(list(p), v) for p, v in zip(prompts, visual)], pad_id, width)
    inputs.update(pixels([{IMAGES_COLUMN: v.get(IMAGES_COLUMN) or []} for v in visual]))
    # prompts without images (a rank's padding row): the placeholder runs the tower where the other ranks' images
    # do, once (generate would hand an input on to every decode step)
    placeholder = inputs.pop(TOWER_PLACEHOLDER, None)
    if placeholder is not None:
        touch_of(unwrapped).before_generate(send_to_device(placeholder, device))
    most = section.max_new_tokens if max_new_tokens is None else max(max_new_tokens, 1)
    config = GenerationConfig(do_sample=False, max_new_tokens=most, eos_token_id=eos, pad_token_id=pad_id,
                              temperature=None, top_p=None, top_k=None)
    drawer = _Drawer([torch.Generator().manual_seed(seed) for seed in seeds], section, eos, pad_id)
    out = unwrapped.generate(**{k: v.to(device) for k, v in inputs.items()}, generation_config=config,
                             logits_processor=LogitsProcessorList([drawer]), synced_gpus=synced)
    tokens = out[:, inputs["input_ids"].shape[1]:].cpu()
    mask = completion_mask(tokens, eos)
    drawn = torch.stack(drawer.logps, 1)
    return ([row[m].tolist() for row, m in zip(tokens, mask)][:wanted],
            [row[m].tolist() for row, m in zip(drawn, mask)][:wanted])


class _Drawer:
    """A logits processor for ``generate`` that draws each open row's next token by its own generator
    (:func:`draw`) and returns scores where only that token is finite: ``generate``'s greedy pick is the draw."""

    def __init__(self, generators: list[torch.Generator], section: OnlineSection, eos: list[int], pad_id: int):
        self.generators, self.section, self.eos, self.pad_id = generators, section, eos, pad_id
        self.open = torch.ones(len(generators), dtype=torch.bool)
        self.logps: list[torch.Tensor] = []  # each step's drawn tokens' log-probs

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token, logp = draw(scores, self.generators, self.open, self.section)
        self.logps.append(logp.float().cpu())
        token[~self.open] = self.pad_id  # a finished row steps on padding (generate pads it too)
        self.open &= ~torch.isin(token, torch.tensor(self.eos))
        picked = torch.full_like(scores, -math.inf)
        picked[torch.arange(len(token)), token.to(scores.device)] = 0.0
        return picked
