"""The machinery every online objective shares (GRPO's, and the next ones beside it): a round of completions sampled
for the plan's prompts (``num_generations`` per prompt, each token drawn by the completion's own generator, seeded
by (objective, seed, round, prompt position, generation index), never by rank or batch composition; each rank
samples the prompts of its own micro-batches, a prompt's whole group on one rank, and the completions are gathered,
so 1 process and N ranks sample the same completions, N ranks each a 1/N share), scored by the reward functions
(TRL's calling convention) on the ranks that train on them and gathered, the log-probs when sampled and of the
reference kept where the objective needs them, the round kept for ``num_iterations`` optimizer steps in a
checkpointed buffer (:class:`RoundBuffer`), the reward eval, the completions log and the per-token metrics. A
subclass of :class:`OnlineObjective` says how rewards become advantages (:meth:`OnlineObjective.advantages`), what
its loss sums over (:meth:`OnlineObjective.units`) and the loss itself (``loss``): GRPO's is
:class:`hfsdp.builtin.grpo.loss.GRPO`, RLOO's :class:`hfsdp.builtin.rloo.loss.RLOO`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.chat import TOOLS_FIELD, parse_completion, tools_of
from hfsdp.builtin.online.rewards import RewardCaller, reward_timeout_s
from hfsdp.builtin.prompt import ROW_COLUMN
from hfsdp.data.batches import BatchPlan, MicroBatch, reshard
from hfsdp.errors import UserError
from hfsdp.objective import Objective, Sampling, adapters_disabled, means_of, means_over_ranks, target_logps

if TYPE_CHECKING:
    from hfsdp.builtin.online.schema import OnlineSection

# The round number in the eval's sampling seeds (training rounds count from 0).
EVAL_ROUND = -1


class GroupPlan(BatchPlan):
    """The plan of prompts: ``per_device_batch`` prompts per micro-batch, each plan step (a generation round)
    trained ``iterations`` optimizer steps."""

    def __init__(self, *args, iterations: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.iterations = iterations

    def rows(self, step: int, micro_step: int, rank: int) -> list[int]:
        return super().rows(step // self.iterations, micro_step, rank)

    def steps_for_epochs(self, epochs: float) -> int:
        return super().steps_for_epochs(epochs) * self.iterations

    def epoch_of(self, step: int) -> float:
        return super().epoch_of(step // self.iterations)

    def source_counts(self, steps: int) -> list[int]:
        return super().source_counts(-(-steps // self.iterations))


def sample_seed(tag: str, seed: int, round_: int, prompt: int, generation: int) -> int:
    """The seed of one completion's sampling generator (``tag``: the objective's plugin name)."""
    digest = hashlib.sha256(f"{tag}:{seed}:{round_}:{prompt}:{generation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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


def nanstd(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the values that are not NaN, with Bessel's correction (TRL's ``nanstd``)."""
    kept = ~torch.isnan(tensor)
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    count = kept.sum(dim=dim, keepdim=True) if dim is not None else kept.sum()
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, math.nan))
    return (variance.squeeze(dim) if dim is not None else variance.reshape(())).sqrt()


@dataclass
class GroupBatch(MicroBatch):
    """A micro-batch of completions (rows: prompt + completion, only the completion labelled) with each
    completion's advantage and the kept per-token log-probs (``[completions, tokens]`` at the labelled targets)."""

    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    entropy_threshold: float | None = None  # set by an objective that trains on the high-entropy tokens only


class RoundBuffer:
    """The generation round in use (every micro-batch of the global batch), checkpointed with the run so that a
    resume inside a round trains on the same completions: ``state_dict`` holds plain lists, the same on every
    rank."""

    def __init__(self):
        self.round = -1
        self.entries: list[dict[str, Any]] = []  # per global micro-batch: rows, prompts, completions, values
        self.stats: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "entries": self.entries, "stats": self.stats}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.entries, self.stats = int(state["round"]), state["entries"], state["stats"]


@torch.no_grad()  # a metric: no graph through more logits-sized tensors
def entropies(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's distribution (``logits``: float32, already over the temperature)."""
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def token_logps(model, batch: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies (of the logits over the temperature) at the batch's targets, 0 elsewhere,
    one completion per row (``batch.sequence_targets``' layout)."""
    logits = model(**batch.inputs).logits.float() / temperature
    entropy = entropies(logits)
    logps, entropy = target_logps(logits, batch.targets), entropy * (batch.targets != IGNORE_INDEX)
    return batch.per_sequence(logps), batch.per_sequence(entropy)


def prompt_completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device,
                            select_logits: bool, labelled: list[bool] | None = None) -> MicroBatch:
    """Rows of a prompt and its completion as TRL lays them out: the prompts left-padded and the completions
    right-padded, so every completion starts at the same position and the model computes logits at the longest
    completion's positions only (``select_logits``; a model without ``logits_to_keep``: at every position, the
    targets there unlabelled). ``position_ids`` count from each row's first real token (what ``generate`` gave the
    prompt), the attention mask hides the padding. ``labelled``: which rows' completions are targets (default
    all; the others are in the rows, unlabelled)."""
    width, longest = max(map(len, prompts)), max(map(len, completions))
    rows = len(prompts)
    input_ids = torch.full((rows, width + longest), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, width - len(p):width + len(c)] = torch.tensor(p + c)
        attention[i, width - len(p):width + len(c)] = 1
        if labelled is None or labelled[i]:  # position t predicts t + 1
            targets[i, width - 1:width - 1 + len(c)] = torch.tensor(c, dtype=torch.long)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions, "use_cache": False}
    if select_logits:
        keep = torch.arange(width - 1, width - 1 + longest)
        inputs["logits_to_keep"], targets = keep, targets[:, keep]
    labelled = targets != IGNORE_INDEX
    return MicroBatch(inputs={k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
                      targets=targets.to(device), lengths=[len(p) + len(c) for p, c in zip(prompts, completions)],
                      num_targets=int(labelled.sum()),
                      label_positions=labelled.reshape(-1).nonzero().flatten().to(device))


def _spread(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-completion token lists placed at the mask's positions (row-major: each row's tokens in order)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask.cpu()] = torch.tensor([v for row in values for v in row], dtype=torch.float32)
    return out.to(mask.device)


def _per_row(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m].tolist() for row, m in zip(tensor.detach().float().cpu(), mask.cpu())]


class OnlineObjective(Objective):
    """An objective that trains on completions it samples, scores and keeps for ``num_iterations`` steps (see the
    module docstring); ``name`` is its plugin's, whose section is an :class:`OnlineSection`."""

    progress_metrics = ("reward",)
    name = "online"
    packs_micro_batches = True  # the per-token values through token_logps, one completion per row

    def __init__(self, section: OnlineSection, rewards: list, config, tokenizer):
        self.section, self.rewards, self.config, self.tokenizer = section, rewards, config, tokenizer
        self.buffer = RoundBuffer()
        self.unwrapped = None
        self._sums: dict[str, torch.Tensor] = {}
        self._generation_s = 0.0  # this step's seconds of sampling, scoring and kept log-probs (0: a reused round)
        self._skipped = 0  # this step's micro-steps without signal, skipped (:meth:`without_signal`)

    # ---- the plan and the rounds

    def sampling(self) -> Sampling:
        return Sampling(self.section.max_new_tokens, whole_global_batch=False)  # each rank its own micro-batches

    def batch_plan(self, dataset, train_config, world_size, mixture) -> GroupPlan:
        return GroupPlan(len(dataset), train_config.per_device_batch_size // self.section.num_generations,
                         world_size, train_config.gradient_accumulation_steps, train_config.seed, mixture=mixture,
                         iterations=self.section.num_iterations)

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        self.unwrapped, self.accelerator = accelerator.unwrap_model(model), accelerator
        self.caller = RewardCaller(self.name, self.rewards,
                                   reward_timeout_s(self.section, self.config.train.collective_timeout_s),
                                   accelerator.process_index)
        accelerator.register_for_checkpointing(self.buffer)
        return splits

    def step_batches(self, model, dataset, plan, step, rank, pad_id, device, select_logits) -> list[GroupBatch]:
        round_ = step // self.section.num_iterations
        if self.buffer.round != round_:
            started = time.perf_counter()
            self._generate(model, dataset, plan, step, round_, pad_id, device, select_logits, rank)
            self._generation_s = time.perf_counter() - started
        world, entries = plan.world_size, self.buffer.entries
        micro = []
        for m in range(plan.accumulation):
            batch = self._batch(entries[m * world + rank], pad_id, device, select_logits)
            batch.skip = self.without_signal([entries[m * world + r] for r in range(world)])
            micro.append(batch)
        self._skipped = sum(batch.skip for batch in micro)
        return micro

    def without_signal(self, slots: list[dict[str, Any]]) -> bool:
        """Whether a micro-step (``slots``: its entry on each rank) has a zero gradient, so that every rank skips
        its forward and backward: every completion's advantage is 0 and there is no KL term in the loss (``beta``
        0), the loss then being 0 whatever the log-probs."""
        return not self.section.beta and all(a == 0 for slot in slots for a in slot["advantages"])

    def keeps_old_logps(self) -> bool:
        """Whether the round keeps each completion's per-token log-probs when sampled (``old_logps``): for the
        ratio of a round's later steps (``num_iterations`` > 1)."""
        return self.section.num_iterations > 1

    def samples_round(self, round_: int) -> bool:
        """Whether round ``round_``'s completions are sampled (else :meth:`given_completions`); the same on every
        rank, a function of the seed and the round."""
        return True

    def given_completions(self, dataset, row: int, group: int) -> list[list[int]]:
        """The ``group`` completions of dataset row ``row`` in a round that does not sample."""
        raise NotImplementedError

    def keeps_ref_logps(self) -> bool:
        """Whether the round keeps the reference's per-token log-probs (``ref_logps``: the base, LoRA's adapters
        disabled): for the KL to it (``beta`` > 0)."""
        return bool(self.section.beta)

    def units(self, batch: MicroBatch, completions: int) -> int:
        """What the loss of a micro-batch of ``completions`` sums over (hfsdp divides by the global batch's):
        completions; a loss summed over tokens returns ``batch.num_targets``."""
        return completions

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int,
                   entries: list[dict[str, Any]]) -> torch.Tensor:
        """Each completion's advantage from the round's rewards ``[completions, functions]`` (NaN: no reward), the
        functions' ``weights`` and the ``group`` of completions per prompt (consecutive); ``entries``: the round's
        micro-batches in order, with the kept per-token log-probs (``old_logps``, ``ref_logps``) where kept."""
        raise NotImplementedError

    def _batch(self, entry: dict[str, Any], pad_id: int, device, select_logits: bool) -> GroupBatch:
        """The entry's micro-batch; with ``mask_truncated_completions``, a completion that ends in neither EOS nor
        the pad token (TRL's test: cut at ``max_new_tokens``) is unlabelled, so neither its loss nor its units
        count."""
        labelled = None
        if self.section.mask_truncated_completions:
            ends = {*self._eos_ids(), pad_id}
            labelled = [c[-1] in ends for c in entry["completion_ids"]]
        prompts, completions = entry["prompt_ids"], entry["completion_ids"]
        if self.pack_len is None:
            batch = prompt_completion_batch(prompts, completions, pad_id, device, select_logits, labelled)
        else:  # each prompt + completion whole, laid end to end
            sequences = [{"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + (c if labelled is None or labelled[i]
                                                                                  else [IGNORE_INDEX] * len(c))}
                         for i, (p, c) in enumerate(zip(prompts, completions))]
            batch = self.collate(sequences, [[i] for i in range(len(sequences))], pad_id, device, select_logits)
        mask = batch.sequence_targets != IGNORE_INDEX
        units = self.units(batch, len(entry["completion_ids"]))
        return GroupBatch(**vars(batch) | {"num_targets": units},
                          advantages=(torch.tensor(entry["advantages"], dtype=torch.float32, device=device)
                                      if "advantages" in entry else None),
                          old_logps=_spread(entry["old_logps"], mask) if entry.get("old_logps") else None,
                          ref_logps=_spread(entry["ref_logps"], mask) if entry.get("ref_logps") else None)

    def _generate(self, model, dataset, plan, step, round_, pad_id, device, select_logits, rank) -> None:
        """Sample this rank's share of the round (the prompts of its own micro-batches), gather every rank's
        completions, score and prepare the round's global batch (collective)."""
        from hfsdp.parallel.world import gather_objects

        s, accelerator = self.section, self.accelerator
        world, group = plan.world_size, s.num_generations
        slots = [(m, r) for m in range(plan.accumulation) for r in range(world)]  # global micro-batch k = m*world+r
        rows = [plan.rows(step, m, r) for m, r in slots]
        per_slot = len(rows[0])  # prompts in a micro-batch
        prompts = [list(dataset[i]["input_ids"]) for part in rows for i in part]  # the round's, in slot order
        mine = [k for k, (m, r) in enumerate(slots) if r == rank]
        positions = [k * per_slot + q for k in mine for q in range(per_slot)]  # my prompts' places in the round
        seeds = [sample_seed(self.name, self.config.train.seed, round_, p, j) for p in positions for j in range(group)]
        if self.samples_round(round_):
            sampled = self._sample([prompts[p] for p in positions for _ in range(group)], seeds, pad_id,
                                   width=max(map(len, prompts)), model=model)
        else:  # the rows' own completions (the same decision on every rank: none samples)
            sampled = [c for k in mine for i in rows[k] for c in self.given_completions(dataset, i, group)]
        per_micro = per_slot * group
        completions_of = {k: v for part in gather_objects(accelerator, {
            k: sampled[i * per_micro:(i + 1) * per_micro] for i, k in enumerate(mine)}) for k, v in part.items()}
        entries = [{"rows": part, "prompt_ids": [prompts[k * per_slot + q] for q in range(per_slot) for _ in range(group)],
                    "completion_ids": completions_of[k]} for k, part in enumerate(rows)]
        probe = ({"rows": entries[0]["rows"][:1], "completion_ids": entries[0]["completion_ids"][:1]}
                 if self.section.check_reward_determinism else None)
        rewards_of = (self._gathered_scores(dataset, {k: entries[k] for k in mine}, group, probe=probe) if self.rewards
                      else {k: [[]] * len(e["completion_ids"]) for k, e in enumerate(entries)})  # none to gather
        self._keep_logps(model, entries, mine, pad_id, device, select_logits)
        rewards = torch.tensor([r for k in range(len(entries)) for r in rewards_of[k]], dtype=torch.float32)
        weights = torch.tensor([w for *_, w in self.rewards], dtype=torch.float32)
        advantages = self.advantages(rewards, weights, group, entries)
        for k, entry in enumerate(entries):
            entry["rewards"] = rewards_of[k]
            entry["advantages"] = advantages[k * per_micro:(k + 1) * per_micro].tolist()
        self.buffer.round, self.buffer.entries = round_, entries
        self.buffer.stats = self._round_stats(rewards, entries)
        self._log_completions(step, dataset, entries)

    def _keep_logps(self, model, entries: list[dict[str, Any]], mine: list[int], pad_id: int, device,
                    select_logits: bool) -> None:
        """The per-token log-probs when sampled (:meth:`keeps_old_logps`) and of the reference
        (:meth:`keeps_ref_logps`) of this rank's entries (``mine``), gathered into every rank's ``entries``
        (collective)."""
        from hfsdp.parallel.world import gather_objects

        s, accelerator = self.section, self.accelerator
        kept = {}
        if self.keeps_old_logps() or self.keeps_ref_logps():
            was_training = model.training
            model.eval()
            with torch.no_grad():
                for k in mine:
                    batch = self._batch(entries[k], pad_id, device, select_logits)
                    mask = batch.sequence_targets != IGNORE_INDEX
                    kept[k] = {}
                    if self.keeps_old_logps():
                        kept[k]["old_logps"] = _per_row(token_logps(model, batch, s.temperature)[0], mask)
                    if self.keeps_ref_logps():
                        with adapters_disabled(self.unwrapped):
                            kept[k]["ref_logps"] = _per_row(token_logps(model, batch, s.temperature)[0], mask)
            model.train(was_training)
            reshard(model)
            for part in gather_objects(accelerator, kept):
                for k, values in part.items():
                    entries[k].update(values)

    def _eos_ids(self) -> list[int]:
        """The token ids that end a completion: the model's generation config's, else the tokenizer's EOS."""
        eos = self.unwrapped.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos)

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], seeds: list[int], pad_id: int, width: int, model) -> list[list[int]]:
        """Completions (token ids up to and including the first EOS) of the prompts, one seeded generator each.

        A row's tokens depend on its prompt and generator alone: the prompts are left-padded to ``width`` (the
        longest prompt of everything sampled together on any rank, not of this rank's share), and a row's logits
        do not depend on the other rows of the batch (the rows of a matrix product and of attention are computed
        apart). With several ranks (``synced_gpus``) every rank takes as many decode steps as the rank that stops
        last, its finished rows stepping on padding, as FSDP needs every rank in each forward; a rank without
        prompts (an eval of fewer prompts than ranks) samples one padding row in step with them and returns none."""
        from transformers import GenerationConfig, LogitsProcessorList

        from hfsdp.run.generation import generating

        wanted = len(prompts)
        if not wanted:
            prompts, seeds = [[pad_id]], [0]
        s, unwrapped = self.section, self.unwrapped
        device = next(unwrapped.parameters()).device
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        eos_ids = self._eos_ids()
        config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False, pad_token_id=pad_id,
                                  eos_token_id=eos_ids, use_cache=True)
        sampler = seeded_sampler([torch.Generator().manual_seed(seed) for seed in seeds], s.temperature, s.top_k,
                                 s.top_p)
        with generating(model, self.config.fsdp.gather_for_generation):
            out = unwrapped.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                                     logits_processor=LogitsProcessorList([sampler]),
                                     synced_gpus=self.accelerator.num_processes > 1)
        generated = out[:, width:]
        mask = completion_mask(generated, eos_ids)
        return [row[m].tolist() for row, m in zip(generated.cpu(), mask.cpu())][:wanted]

    # ---- rewards

    def _reward_inputs(self, dataset, entry: dict[str, Any], group: int) -> dict[str, list]:
        raw = [json.loads(dataset[i][ROW_COLUMN]) for i in entry["rows"] for _ in range(group)]
        if isinstance(raw[0]["prompt"], list):  # conversational: each completion the message it is (tool calls...)
            prompts = [dataset[i]["input_ids"] for i in entry["rows"] for _ in range(group)]
            completions = [[parse_completion(self.tokenizer, ids, prompt, tools_of(r.get(TOOLS_FIELD)))]
                           for ids, prompt, r in zip(entry["completion_ids"], prompts, raw)]
        else:
            completions = self.tokenizer.batch_decode(entry["completion_ids"], skip_special_tokens=True)
        columns = {c: [r.get(c) for r in raw] for c in raw[0] if c != "prompt"}
        return {"prompts": [r["prompt"] for r in raw], "completions": completions,
                "completion_ids": entry["completion_ids"], **columns}

    def _score(self, dataset, entry: dict[str, Any], group: int, split: str) -> list[list[float]] | str:
        """``[completion][function]`` rewards (NaN: None) of ``group`` completions per row, or the message of what
        went wrong (:class:`~hfsdp.builtin.online.rewards.RewardCaller`)."""
        return self.caller.score(self._reward_inputs(dataset, entry, group), entry["rows"], group, split)

    def _gathered_scores(self, dataset, mine: dict[int, dict[str, Any]], group: int, split: str = "training",
                         probe: dict[str, Any] | None = None) -> dict[int, list]:
        """Every rank's scores of its entries (key -> rewards), on every rank; a failure on any rank raises on all.
        ``probe``: the first completion of entry 0, which every rank scores again alone (in the same gather) and
        which must get the value entry 0's owner gave it in its micro-batch (:meth:`_check_determinism`)."""
        from hfsdp.parallel.world import gather_objects

        mine_scored = {k: self._score(dataset, e, group, split) for k, e in mine.items()}
        again = self._score(dataset, probe, 1, split) if probe is not None else None
        everyone = gather_objects(self.accelerator, (mine_scored, again))
        failure = next((v for part, probed in everyone for v in [*part.values(), probed] if isinstance(v, str)), None)
        if failure is not None:
            raise UserError(failure)
        scores = {k: v for part, _ in everyone for k, v in part.items()}
        if probe is not None:
            self._check_determinism(scores[0][0], [probed[0] for _, probed in everyone], probe["rows"][0], split)
        return scores

    def _check_determinism(self, owner: list[float], again: list[list[float]], row: int, split: str) -> None:
        """Each function's value of one completion scored in its micro-batch (``owner``) against every rank's score
        of it alone (``again``, in rank order); the first that differs stops the run, on every rank alike."""
        for f, (name, source, fn, _) in enumerate(self.rewards):
            for rank, values in enumerate(again):
                a, b = owner[f], values[f]
                if a != b and not (math.isnan(a) and math.isnan(b)):
                    raise UserError(
                        f"{self.caller.where(name, source, fn)} is not a function of its inputs: the first completion "
                        f"of {split} row {row} got {a!r} in its micro-batch and {b!r} scored again alone on rank "
                        f"{rank}. One process and N ranks (and a resume) would train on other rewards; make it "
                        "deterministic (seed what it samples, do not read the rank or the batch around it), or set "
                        f"{self.name}.check_reward_determinism: false for a reward that samples on purpose")

    def evaluate(self, model, dataset, accelerator, pad_id, select_logits) -> dict[str, float]:
        """As TRL's eval: the mean weighted reward (``eval_reward``) and each function's mean over
        ``num_generations_eval`` completions of every eval prompt, sampled as training samples them, each by a
        generator seeded by (objective, seed, prompt, generation index) alone, the same at every eval: an eval of
        unchanged weights gives the same completions, on any number of ranks (another objective, e.g. rloo beside
        grpo, draws others from the same weights: :func:`sample_seed`'s tag). Each rank samples and scores its share of the
        prompts (every ``world``-th)."""
        return self._eval_rewards(dataset, *self._eval_samples(model, dataset, accelerator, pad_id))

    def _eval_samples(self, model, dataset, accelerator, pad_id) -> tuple[list[list[int]], list[int], int,
                                                                         list[list[int]]]:
        """(every eval prompt's ids, this rank's prompts, completions per prompt, this rank's completions in
        order) of the eval's sampling (see :meth:`evaluate`; collective: every rank samples in lock-step)."""
        world, rank = accelerator.num_processes, accelerator.process_index
        group = self.section.num_generations_eval or self.section.num_generations
        prompts = [list(dataset[i]["input_ids"]) for i in range(len(dataset))]
        mine = list(range(rank, len(dataset), world))
        seeds = [sample_seed(self.name, self.config.train.seed, EVAL_ROUND, p, j) for p in mine for j in range(group)]
        sampled = self._sample([prompts[p] for p in mine for _ in range(group)], seeds, pad_id,
                               width=max(map(len, prompts)), model=model)
        return prompts, mine, group, sampled

    def _eval_rewards(self, dataset, prompts, mine: list[int], group: int, sampled) -> dict[str, float]:
        """``eval_reward`` and each function's ``eval_rewards/<name>/mean`` of the eval's completions (none without
        reward functions; collective otherwise)."""
        if not self.rewards:
            return {}
        scores = self._gathered_scores(dataset, {i: {"rows": [i], "completion_ids": sampled[n * group:(n + 1) * group]}
                                                 for n, i in enumerate(mine)}, group, "eval")
        rewards = torch.tensor([r for i in range(len(dataset)) for r in scores[i]], dtype=torch.float32)
        stats = self._reward_stats(rewards)
        return {f"eval_{k}": v for k, v in stats.items() if not k.endswith("std")}

    def _reward_stats(self, rewards: torch.Tensor) -> dict[str, float]:
        if not self.rewards:
            return {}
        weights = torch.tensor([w for *_, w in self.rewards], dtype=torch.float32)
        total = (rewards * weights[None]).nansum(1)
        total[torch.isnan(rewards).all(1)] = math.nan
        stats = {"reward": float(torch.nanmean(total)), "reward_std": float(nanstd(total))}
        for i, (name, *_) in enumerate(self.rewards):
            stats[f"rewards/{name}/mean"] = float(torch.nanmean(rewards[:, i]))
            stats[f"rewards/{name}/std"] = float(nanstd(rewards[:, i]))
        return stats

    def _round_stats(self, rewards: torch.Tensor, entries: list[dict[str, Any]]) -> dict[str, float]:
        lengths = torch.tensor([len(c) for e in entries for c in e["completion_ids"]], dtype=torch.float32)
        return {**self._reward_stats(rewards), "completion_length": float(lengths.mean())}

    def _log_completions(self, step: int, dataset, entries: list[dict[str, Any]]) -> None:
        n = self.section.log_completions
        if not (n and self.accelerator.is_main_process):
            return
        out = Path(self.config.train.output_dir) / "completions.jsonl"
        group = self.section.num_generations
        lines = []
        for entry in entries:
            texts = self.tokenizer.batch_decode(entry["completion_ids"], skip_special_tokens=True)
            for j, text in enumerate(texts):
                if len(lines) == n:
                    break
                prompt = json.loads(dataset[entry["rows"][j // group]][ROW_COLUMN])["prompt"]
                lines.append(json.dumps({"step": step + 1, "row": entry["rows"][j // group], "prompt": prompt,
                                         "completion": text, "completion_ids": entry["completion_ids"][j],
                                         "advantage": entry["advantages"][j],
                                         "rewards": {name: (None if math.isnan(v) else v) for (name, *_), v
                                                     in zip(self.rewards, entry["rewards"][j])}}))
        with open(out, "a") as f:
            f.write("".join(line + "\n" for line in lines))

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._sums[name] = self._sums.get(name, 0) + value.detach().double()

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        means, self._sums = means_over_ranks(accelerator, self._sums, "tokens", prefix), {}
        return {**self._own_metrics(prefix), **means}

    def step_sums(self) -> dict[str, Any]:
        sums, self._sums = self._sums, {}
        return sums

    def metrics_of(self, totals: dict[str, float]) -> dict[str, float]:
        return {**self._own_metrics(), **means_of(totals, "tokens")}

    def _own_metrics(self, prefix: str = "") -> dict[str, float]:
        """The round's statistics (the same on every rank), the time spent sampling and the skipped micro-steps."""
        generation_s, self._generation_s = self._generation_s, 0.0
        skipped, self._skipped = self._skipped, 0
        return {**{f"{prefix}{k}": v for k, v in self.buffer.stats.items()}, f"{prefix}generation_s": generation_s,
                f"{prefix}skipped_zero_advantage": skipped}
