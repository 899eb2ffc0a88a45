"""hfsdp's GRPO against TRL's ``GRPOTrainer`` (issue 35), and its RLOO against TRL's ``RLOOTrainer`` (issue 52,
the same comparison: benchmarks/trl_rloo.py), step by step, on the same completions. The objective is the config's:
``grpo`` or ``rloo`` in its plugins (below, ``grpo`` stands for either; TRL's trainer and config are the matching
ones).

hfsdp trains first and writes every completion it sampled (``completions.jsonl`` with ``grpo.log_completions``
large). TRL then trains the same model folder on the same prompts in the same order (hfsdp's plan, read
sequentially by TRL), with its generation step replaced by one that returns hfsdp's completions of that round (the
prompt tokens TRL made are checked equal to hfsdp's), the same reward functions, loss type, clipping,
``num_iterations``, reward scaling, temperature, AdamW hyper-parameters, LR schedule and gradient clipping (by the
float64 norm of its gradients, as hfsdp's: torch's float32 norm, which TRL clips by, is about 3e-5 off on the real
model; TRL's logged norm is printed beside it): fp32, one process, no gradient accumulation (TRL shuffles a
generation batch before it splits it into micro-batches). Prints both columns of per-step loss and gradient norm
and their largest relative differences (target 1e-5), and both median step times.

What is trained: with ``plugins: [grpo]`` the full model, ``beta: 0`` only (hfsdp's KL reference is LoRA's base, so
hfsdp refuses beta > 0 without lora). With ``plugins: [grpo, lora]`` LoRA's adapters, ``beta`` 0 or more: TRL gets
the ``LoraConfig`` hfsdp's ``lora`` plugin builds (``hfsdp.builtin.lora.peft_config``, the same target modules, as
benchmarks/trl_sft.py) as ``GRPOTrainer(peft_config=...)``, and with beta > 0 both take the base model with the
adapters disabled as the KL reference. LoRA's A is random: this module, enabled as one more plugin of hfsdp's run
(hook ``hfsdp_on_train_start``), saves hfsdp's adapters before step 1, and TRL's are overwritten with them before
it trains (the output says whether TRL's own seeding had given the same weights; it does on the tiny model, both
seed with ``train.seed`` before peft draws A). With beta > 0 each step's mean KL of both sides is printed too
(TRL's is after the bias correction, so with ``use_bias_correction_kl`` and ``num_iterations`` > 1 only a round's
first step, whose ratio is 1, compares; RLOO's is the mean per-token log-ratio to the reference when sampled, logged
at a round's first step). Every loss, advantage and masking key of the ``grpo`` section (``use_bias_correction_kl``
included; RLOO's ``epsilon``, ``normalize_advantages``, ``reward_clip_range``...) goes to ``GRPOConfig`` (or
``RLOOConfig``) under the same name (``trl_loss_keys``); RLOO's ``beta`` is the one the run uses (TRL's 0.05 by
default with lora).

``--speed``: each side generates its own completions (TRL's ``transformers.generate`` path, ``use_vllm=False``;
hfsdp's seeded sampling), on the same model, prompts in the same order, group size and completion length, ``--rounds``
times interleaved; prints each side's mean step time over steps 2.., split into generation (sampling and scoring)
and training, with the mean completion length (the two sample different completions of the same distribution, so
their lengths differ by chance), and hfsdp's speed as a ratio of TRL's (per step and per completion token).

``--agent tools`` / ``--agent environment`` (issue 69): multi-turn rollouts that call tools, as TRL's
``GRPOTrainer(tools=..., environment_factory=...)`` makes them. hfsdp trains GRPO on the bundled tool prompts
(contacts_tools_prompts_train.jsonl, template chatml_tools, 128 new tokens, at most 2 rounds of calls) with
``grpo.tools: [contacts:lookup_contact]`` (tests/agent_tools/contacts.py), or ``grpo.environment:
contacts:QuietContacts`` (the contacts environment without its reset text, its ``get_reward`` a reward column named after the
class); TRL then gets the same function (``tools=[lookup_contact]``) or class (``environment_factory=QuietContacts``) and
runs its own ``_tool_call_loop``, while its ``_generate_single_turn`` replays hfsdp's sampled turns (the completion
split by its ``tool_mask``: a round's first call returns every rollout's first turn, each call of TRL's loop the next
turn of the rollouts it continues, after checking that it continues hfsdp's and that its input, prompt, earlier
turns and its own tool results' tokens, is hfsdp's). TRL's completion ids, ``tool_mask``, conversations and rewards
are then compared with hfsdp's, with the losses and gradient norms as above (:class:`AgentReplay`). The model:
``--model PATH``, else the tiny SmolLM2 taught to call the tool, made first (:func:`make_caller`, a minute or two).

    python benchmarks/trl_grpo.py [CONFIG] --steps 4 [--set KEY=VALUE ...]
    python benchmarks/trl_grpo.py [CONFIG] --speed --steps 6 --rounds 3 [--set KEY=VALUE ...]
    python benchmarks/trl_grpo.py --agent tools|environment [--model PATH] --steps 4 [--set KEY=VALUE ...]

CONFIG defaults to the ``grpo`` preset (the real SmolLM2-135M-Instruct); ``--set model.name_or_path=smollm2-tiny``
runs it in seconds; ``--set "plugins=[grpo, lora]" --set grpo.beta=0.04`` compares LoRA with the KL term. Needs
TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import subprocesses

from hfsdp import hookimpl

# A loss difference this small (absolute) is float32 rounding of a sum of terms of about 1, not a relative error.
ABS_FLOOR = 1e-7
# RLOO's kl, a mean of first-order log-ratios to the reference, each the difference of two float32 log-probs of about
# -2 to -10 that TRL (through transformers' fused head) and hfsdp round otherwise: a difference this small
# (absolute) is that rounding (measured on the rloo preset with LoRA: 2e-7 to 6e-7 on kls of 1e-4 to 2e-3).
RLOO_KL_FLOOR = 1e-6
# What this module, enabled as a plugin of hfsdp's run (with lora), writes into the run's output_dir: the trainable
# parameters (LoRA's adapters) as they are before step 1.
INITIAL_WEIGHTS = "initial_trainable.pt"
# ``--agent``: the test tools and environment (tests/agent_tools/contacts.py) and the bundled tool data.
REPO = Path(__file__).resolve().parents[1]
AGENT_TOOLS = REPO / "tests" / "agent_tools"
PRESET_DATA = REPO / "hfsdp" / "config" / "presets" / "data"
AGENTS = {  # what each --agent mode sets on the grpo section: the tool function, or the environment owning the reward
    "tools": ["grpo.tools=[contacts:lookup_contact]",
              "grpo.rewards=[{name: tool_call}, {name: 'contacts:answered'}, {name: 'contacts:looked_up'}]"],
    "environment": ["grpo.tools=[]", "grpo.environment=contacts:QuietContacts", "grpo.rewards=[{name: 'contacts:looked_up'}]"],
}


@hookimpl
def hfsdp_on_train_start(run):
    """This module as a plugin of hfsdp's run (``plugins: [grpo, lora, trl_grpo]``): the trainable parameters before
    step 1, by their peft names (one process, unwrapped), so that TRL's adapters start from the same random A."""
    import torch

    model = run.accelerator.unwrap_model(run.model)
    torch.save({name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad},
               Path(run.config.train.output_dir) / INITIAL_WEIGHTS)


def run_hfsdp(config: str, overrides: list[str], out: Path, plugins: list[str], rows: dict | None = None,
              pythonpath: tuple[str, ...] = ()) -> tuple[list[dict], dict[int, list[list[int]]], dict | None]:
    """hfsdp's per-step metrics (``generation_s``: the step's sampling and scoring), the completions (token ids,
    in batch order) sampled at each round's step, and with ``lora`` in ``plugins`` its initial adapters (this module
    enabled as a plugin too, which reads them and changes nothing; else None). ``rows``: filled with each round's
    whole completions.jsonl rows (an agent's tool masks, messages, rewards); ``pythonpath``: folders the run
    imports from (an agent's tools)."""
    lora = "lora" in plugins
    cmd = [sys.executable, "-m", "hfsdp", "train", config, "--overwrite", "--set", f"train.output_dir={out}",
           *[a for o in overrides for a in ("--set", o)]]
    env = dict(os.environ)
    extra = list(pythonpath)
    if lora:
        cmd += ["--set", f"plugins=[{', '.join([*plugins, 'trl_grpo'])}]"]
        extra.append(str(Path(__file__).resolve().parent))
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([*extra, *filter(None, [env.get("PYTHONPATH")])])
    subprocesses.run(cmd, check=True, env=env)
    metrics = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    rounds: dict[int, list[list[int]]] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        rounds.setdefault(row["step"], []).append(row["completion_ids"])
        if rows is not None:
            rows.setdefault(row["step"], []).append(row)
    initial = None
    if lora:
        import torch

        initial = torch.load(out / INITIAL_WEIGHTS)
    return metrics, rounds, initial


def objective_of(cfg) -> str:
    """The online objective the config trains (its plugin's name)."""
    return next((name for name in ("rloo", "distill_online") if name in cfg.plugins), "grpo")


def run_section(cfg):
    """The objective's section as the run uses it (RLOO's ``beta`` resolved)."""
    objective = objective_of(cfg)
    section = cfg.section(objective)
    if objective == "rloo":
        from hfsdp.builtin.rloo.schema import resolved_beta

        section = section.model_copy(update={"beta": resolved_beta(section, cfg.plugins)})
    return section


def trl_loss_keys(section) -> dict:
    """The GRPOConfig (RLOOConfig) values of the section's loss, advantage and masking keys (named as TRL's)."""
    from hfsdp.builtin.online.schema import OnlineSection

    names = [*(type(section).model_fields.keys() - OnlineSection.model_fields.keys()), "mask_truncated_completions"]
    return {name: getattr(section, name) for name in names}


def make_caller(folder: Path) -> Path:
    """A model that calls ``lookup_contact``: the shrunk SmolLM2 (``smollm2-tiny``) fine-tuned by hfsdp on the bundled
    tool conversations (contacts_tools_train.jsonl, template chatml_tools, 240 steps, as tests/test_agents.py's
    ``caller``); about a minute or two on CPU. Returns its final folder."""
    config = {
        "model": {"name_or_path": "smollm2-tiny"},
        "data": {"format": "chat", "chat_template": "chatml_tools", "max_seq_len": 384,
                 "path": str(PRESET_DATA / "contacts_tools_train.jsonl")},
        "train": {"output_dir": str(folder / "run"), "max_steps": 240, "per_device_batch_size": 8,
                  "learning_rate": 3e-3, "lr_scheduler": "constant", "log_every": 40, "seed": 7, "report_to": "none",
                  "loss_plot": False, "save_every": None},
        "fsdp": {"version": 2},
    }
    path = folder / "caller.yaml"
    path.write_text(json.dumps(config))  # YAML reads JSON
    subprocesses.run([sys.executable, "-m", "hfsdp", "train", str(path), "--overwrite"], check=True)
    return folder / "run" / "final"


def agent_overrides(kind: str, model: str) -> list[str]:
    """``--agent KIND``: GRPO of ``model`` on the bundled tool prompts (template chatml_tools, 128 new tokens, at most
    2 rounds of calls) with the tool function (``tools``) or the environment that owns the reward
    (``environment``)."""
    return [f"model.name_or_path={model}", "data.format=prompt", "data.chat_template=chatml_tools",
            f"data.path={PRESET_DATA / 'contacts_tools_prompts_train.jsonl'}", "data.max_seq_len=384",
            "grpo.max_new_tokens=128", "grpo.max_tool_calling_iterations=2", "train.learning_rate=1e-4",
            *AGENTS[kind]]


def _imported(name: str, builtins: dict[str, str]):
    """The object a section's ``tools`` entry or ``environment`` value names (``module:attr`` or a built-in's)."""
    import importlib

    module, _, attr = builtins.get(name, name).partition(":")
    return getattr(importlib.import_module(module), attr)


def trl_agent(s) -> dict:
    """``GRPOTrainer``'s ``tools`` and ``environment_factory`` for the section's ``tools`` and ``environment`` (the
    same function and class objects hfsdp's tool processes import)."""
    from hfsdp.builtin.agent.runtime import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS

    env = s.environment
    return {"tools": [_imported(name, BUILTIN_TOOLS) for name in s.tools] or None,
            "environment_factory": None if env is None else _imported(env, BUILTIN_ENVIRONMENTS) if isinstance(
                env, str) else {k: _imported(v, BUILTIN_ENVIRONMENTS) for k, v in env.items()}}


def split_turns(completion: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """A multi-turn completion as its turns: ``(tokens of tool results before it, the tokens the model sampled)``,
    the first turn's results 0, a trailing run of results (the budget spent) a turn with nothing sampled."""
    turns, i = [], 0
    while i < len(completion):
        tool = i
        while i < len(completion) and not mask[i]:
            i += 1
        start = i
        while i < len(completion) and mask[i]:
            i += 1
        turns.append((start - tool, list(completion[start:i])))
    return turns or [(0, [])]


class AgentReplay:
    """hfsdp's multi-turn rollouts replayed into TRL's ``_tool_call_loop``: each round's first
    ``_generate_single_turn`` returns every rollout's first turn (what hfsdp's model sampled before a call), each
    later one (TRL's loop, after running the calls and appending their results with its suffix) the next turn of
    each rollout it continues, after checking that TRL continues exactly the rollouts hfsdp did and that its input
    (prompt, turns, its own tool results' tokens) is hfsdp's token for token. After the round, TRL's completion ids,
    ``tool_mask``, conversations and rewards are compared with hfsdp's (``checks``)."""

    def __init__(self, rows: dict[int, list[dict]], prompts: list[list[list[int]]]):
        self.rows = [rows[step] for step in sorted(rows)]
        self.prompts = prompts  # hfsdp's prompt ids of each round's completions (with the tools' schemas)
        self.round = -1
        self.checks = {"completions": 0, "acted": 0, "turns": 0, "tool_tokens": 0, "sampled_tokens": 0,
                       "mismatches": [], "rewards": {}}

    def first_turn(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        self.round += 1
        rows, expected = self.rows[self.round], self.prompts[self.round]
        assert [list(p) for p in prompt_ids] == expected, "TRL rendered the prompts otherwise than hfsdp"
        self.turns = [split_turns(r["completion_ids"], r["tool_mask"]) for r in rows]
        self.next = [1] * len(rows)  # each rollout's next turn
        self.trl_prompts = [list(p) for p in prompt_ids]
        return [turns[0][1] for turns in self.turns]

    def next_turn(self, sequences: list[list[int]]) -> list[list[int]]:
        rows = self.rows[self.round]
        pending = [k for k, turns in enumerate(self.turns) if self.next[k] < len(turns)]
        if len(sequences) != len(pending):
            raise AssertionError(f"round {self.round + 1}: TRL's loop continues {len(sequences)} rollouts, hfsdp "
                                 f"continued {len(pending)} ({pending})")
        out = []
        for k, sequence in zip(pending, sequences):
            done = sum(n + len(ids) for n, ids in self.turns[k][:self.next[k]])
            results, ids = self.turns[k][self.next[k]]
            want = self.trl_prompts[k] + rows[k]["completion_ids"][:done + results]
            if list(sequence) != want:
                raise AssertionError(f"round {self.round + 1}, rollout {k}: TRL's input to turn {self.next[k] + 1} "
                                     f"differs from hfsdp's at token {_first_difference(sequence, want)} "
                                     f"(TRL {len(sequence)} tokens, hfsdp {len(want)})")
            self.next[k] += 1
            out.append(ids)
        return out

    def finished(self, prompt_ids, completion_ids, tool_mask, completions) -> None:
        """TRL's round (``_generate``'s output) against hfsdp's rows."""
        rows, checks = self.rows[self.round], self.checks
        for k, row in enumerate(rows):
            where = f"round {self.round + 1}, rollout {k}"
            if self.next[k] != len(self.turns[k]):
                checks["mismatches"].append(f"{where}: TRL took {self.next[k]} turns, hfsdp {len(self.turns[k])}")
            mask = tool_mask[k] if tool_mask is not None else [1] * len(completion_ids[k])
            if list(completion_ids[k]) != row["completion_ids"]:
                checks["mismatches"].append(f"{where}: completion ids differ at "
                                            f"{_first_difference(completion_ids[k], row['completion_ids'])}")
            if list(mask) != row["tool_mask"]:
                checks["mismatches"].append(f"{where}: tool_mask differs at "
                                            f"{_first_difference(mask, row['tool_mask'])}")
            theirs = json.loads(json.dumps(completions[k], default=str))
            if theirs != row["messages"]:
                checks["mismatches"].append(f"{where}: messages differ: TRL {theirs} hfsdp {row['messages']}")
            checks["completions"] += 1
            checks["acted"] += any(m.get("role") == "tool" for m in row["messages"])
            checks["turns"] += len(self.turns[k])
            checks["tool_tokens"] += len(mask) - sum(mask)
            checks["sampled_tokens"] += sum(mask)

    def rewards(self, names: list[str], rewards) -> None:
        """TRL's rewards of the round (``[completions, functions]``, NaN: none) against hfsdp's, column by column
        (hfsdp's order is TRL's: the reward functions, then each environment class's ``get_reward``)."""
        import math

        rows = self.rows[self.round]
        ours = list(rows[0]["rewards"])
        if len(ours) != len(names):
            self.checks["mismatches"].append(f"round {self.round + 1}: reward columns TRL {names} hfsdp {ours}")
            return
        for j, (name, mine) in enumerate(zip(names, ours)):
            key = f"{mine} (TRL's {name})" if name != mine else name
            worst = self.checks["rewards"].get(key, 0.0)
            for k, row in enumerate(rows):
                a, b = row["rewards"][mine], float(rewards[k, j])
                if (a is None) != math.isnan(b):
                    self.checks["mismatches"].append(f"round {self.round + 1}, rollout {k}: reward {key} hfsdp {a} "
                                                    f"TRL {b}")
                elif a is not None:
                    worst = max(worst, abs(a - b))
            self.checks["rewards"][key] = worst


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agent_prompts(cfg, s, objective: str, tokenizer, raw, rows: dict[int, list[dict]], order: list[int],
                  group: int) -> list[list[list[int]]]:
    """hfsdp's prompt ids of each round's rollouts, as :class:`hfsdp.builtin.agent.rollouts.Agent` renders them:
    the row's prompt, its environment's ``reset`` text (the completions log's ``observation``) after the last
    message, the tools' schemas (described by hfsdp's tool process) and the generation prompt. Checks that the
    rounds are the plan's rows in order."""
    from hfsdp.builtin.agent.rollouts import ENVIRONMENT_COLUMN, limits_of
    from hfsdp.builtin.agent.runtime import describe
    from hfsdp.builtin.chat import chat_ids, conversation

    toolset = describe(s.tools, s.environment, limits_of(s), objective)
    flat = [row for step in sorted(rows) for row in rows[step]]
    assert [row["row"] for row in flat] == [i for i in order for _ in range(group)], \
        "hfsdp's completions are not of the plan's rows in order"
    out = []
    for step in sorted(rows):
        prompts = []
        for row in rows[step]:
            raw_row = raw[row["row"]]
            env = raw_row[ENVIRONMENT_COLUMN] if isinstance(s.environment, dict) else None
            messages = conversation(raw_row["prompt"], cfg.data)
            if row.get("observation") is not None:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + row["observation"]}
            prompts.append(chat_ids(messages, tokenizer, toolset.schemas[env] or None, add_generation_prompt=True))
        out.append(prompts)
    return out


def run_trl(cfg, host, steps: int, rounds: dict[int, list[list[int]]] | None,
            initial: dict | None = None, agent_rows: dict[int, list[dict]] | None = None) -> dict[str, list[float]]:
    """TRL's per-step ``losses``, ``grad_norms`` (what it logs), with hfsdp's completions ``float64_norms`` (of its
    gradients, summed as hfsdp sums its norm; TRL clips by them) and ``torch_norms`` (torch's float32 norm of the
    same gradients, which stock TRL clips by), ``step_times``, and per round its ``generation_s`` and mean
    completion ``lengths``; ``rounds``: hfsdp's completions, returned by TRL's generation step instead of its own
    (None: TRL generates), with ``beta`` its logged ``kl`` per step. With ``lora`` in the config's plugins, TRL +
    peft trains the adapters hfsdp's ``lora`` plugin does (``GRPOTrainer(peft_config=...)``, the same
    ``LoraConfig``), copied from ``initial`` (hfsdp's adapters before step 1) before it trains; ``initial_as_trls``
    then says whether TRL's own initialisation had given the same weights. ``agent_rows`` (hfsdp's completions.jsonl
    rows of each round, of a section that acts): TRL gets the section's tool functions and environment classes
    (``tools=``, ``environment_factory=``), its loop runs the calls while its generation replays hfsdp's turns
    (:class:`AgentReplay`), and ``agent`` holds the comparison of its rollouts with hfsdp's."""
    import time

    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from hfsdp.data import prepare as data
    from hfsdp.model import loading
    from hfsdp.builtin.online.rewards import reward_functions
    from hfsdp.builtin.online.objective import OnlineObjective
    from hfsdp.builtin.prompt import prompt_ids
    from hfsdp.cli import cache_dir
    from trl_sft import float64_norms, step_times, training_args  # benchmarks/, next to this file

    t, s, objective = cfg.train, run_section(cfg), objective_of(cfg)
    Trainer, Config = (RLOOTrainer, RLOOConfig) if objective == "rloo" else (GRPOTrainer, GRPOConfig)
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    if agent_rows is not None:  # the template's, hfsdp's reading of a completion: TRL's own for the Hermes family
        from hfsdp.model import chat_template

        chat_template.use(tokenizer, cfg.data.chat_template)
        tokenizer.response_template = chat_template.response_template(tokenizer)
    raw, _ = data.load_raw(cfg.data, t.seed, host.data_readers(cfg))
    train_set = data.prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    assert len(train_set) == len(raw), "rows dropped in tokenization: the plans would differ"
    rewards = reward_functions(cfg, objective)
    plan = OnlineObjective(s, rewards, cfg, tokenizer).batch_plan(train_set, t, 1, None)
    order = [i for step in range(0, steps, s.num_iterations) for i in plan.rows(step, 0, 0)]
    ordered = datasets.Dataset.from_list([raw[i] for i in order])
    expected_prompts = [prompt_ids(raw[i]["prompt"], tokenizer, cfg.data) for i in order]
    given = iter([rounds[step] for step in sorted(rounds)]) if rounds is not None else None
    agent = None
    if agent_rows is not None:
        agent = AgentReplay(agent_rows, agent_prompts(cfg, s, objective, tokenizer, raw, agent_rows, order,
                                                      s.num_generations))
    per_round = t.per_device_batch_size // s.num_generations
    logged: dict = {k: [] for k in ("losses", "grad_norms", "float64_norms", "torch_norms", "step_times",
                                     "generation_s", "lengths", "kl")}
    losses, grad_norms, times = logged["losses"], logged["grad_norms"], logged["step_times"]

    class InPlanOrder(Trainer):  # shuffle_dataset=False: TRL's sampler reads the prompts in hfsdp's order
        rounds = 0

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
            # GRPO's takes num_generations and returns (completions, logprobs); RLOO's returns the completions
            if agent is not None:  # TRL's loop passes num_generations=1 by name; a round's first turn positionally
                turns = agent.next_turn(prompt_ids) if "num_generations" in kwargs else agent.first_turn(prompt_ids)
                return turns, None
            first = self.rounds * per_round
            assert [list(p) for p in prompt_ids[::s.num_generations]] == \
                expected_prompts[first:first + per_round], "TRL tokenized the prompts otherwise than hfsdp"
            self.rounds += 1
            if given is not None:
                return next(given) if objective == "rloo" else (next(given), None)
            started = time.perf_counter()
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
            completion_ids = out if objective == "rloo" else out[0]
            logged["generation_s"].append(time.perf_counter() - started)
            logged["lengths"].append(statistics.mean(len(c) for c in completion_ids))
            return out

        def _generate(self, prompts):
            out = super()._generate(prompts)
            if agent is not None:
                agent.finished(*out[:4])
            return out

        def _calculate_rewards(self, *args, **kwargs):  # scoring is part of hfsdp's generation_s too
            started = time.perf_counter()
            rewards = super()._calculate_rewards(*args, **kwargs)
            if agent is not None:
                agent.rewards(self.reward_func_names, rewards)
            if given is None:
                logged["generation_s"][-1] += time.perf_counter() - started
            return rewards

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(loss.detach()))
            return loss

    class GradNorms(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                grad_norms.append(float(logs["grad_norm"]))
                if "kl" in logs:  # RLOO's: at a round's first step only (None at the others)
                    logged["kl"].append(float(logs["kl"]))
                elif objective == "rloo":
                    logged["kl"].append(None)

    torch.manual_seed(t.seed)
    model = loading.load_model(path, cfg.model)
    peft = None
    if "lora" in cfg.plugins:  # as benchmarks/trl_sft.py builds it: hfsdp's LoraConfig, the same target modules
        from hfsdp.builtin import lora

        section = cfg.section("lora")
        peft = lora.peft_config(section, lora.resolved_targets(model, cfg, section))
    with tempfile.TemporaryDirectory() as out:
        args = Config(
            **training_args(t, out, steps), num_generations=s.num_generations,
            max_completion_length=s.max_new_tokens, temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k, beta=s.beta, num_iterations=s.num_iterations,
            shuffle_dataset=False, log_completions=False, reward_weights=[w for *_, w in rewards] or None,
            **trl_loss_keys(s), **({} if agent is None else {"max_tool_calling_iterations":
                                                              s.max_tool_calling_iterations}),
        )
        trainer = InPlanOrder(model=model, reward_funcs=[fn for _, _, fn, _ in rewards], args=args,
                                  train_dataset=ordered, processing_class=tokenizer,
                                  callbacks=[step_times(times), GradNorms()], peft_config=peft,
                                  **({} if agent is None else trl_agent(s)))
        if peft is not None:  # TRL's get_peft_model drew A from its own RNG state: hfsdp's initial adapters instead
            trainable = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
            assert initial is not None and trainable.keys() == initial.keys(), \
                "TRL's peft model trains other parameters than hfsdp's lora plugin"
            logged["initial_as_trls"] = all(torch.equal(p.detach(), initial[name]) for name, p in trainable.items())
            with torch.no_grad():
                for name, p in trainable.items():
                    p.copy_(initial[name])
        if given is not None:  # the exactness run: TRL clips by the float64 norm too (the speed run: stock TRL)
            float64_norms(trainer, logged["float64_norms"], logged["torch_norms"], clip_by_them=True)
        trainer.train()
    if agent is not None:
        logged["agent"] = agent.checks
    return logged


def trained(cfg) -> str:
    """What both sides train: the full model, or LoRA's adapters (rank, alpha, targets; the reference of the KL the
    base model, the adapters disabled)."""
    if "lora" not in cfg.plugins:
        return "full fine-tuning"
    section = cfg.section("lora")
    return (f"LoRA r {section.r} alpha {section.alpha:g} dropout {section.dropout:g} on "
            f"{', '.join(section.target_modules or ['every Linear of the decoder blocks'])}")


def compare(cfg, s, ours: list[dict], trl: dict[str, list[float]], steps_asked: int) -> None:
    """Both columns of per-step loss and gradient norm on the same completions, and their largest differences."""
    print(f"\n{objective_of(cfg).upper()} on {cfg.model.name_or_path}: {cfg.train.per_device_batch_size} completions per step "
          f"({s.num_generations} per prompt, at most {s.max_new_tokens} tokens), num_iterations {s.num_iterations}, "
          f"lr {cfg.train.learning_rate}, fp32, one process, the same completions, beta {s.beta}, "
          + (trained(cfg) + "; ") + ", ".join(f"{k} {v}" for k, v in sorted(trl_loss_keys(s).items())))
    if "initial_as_trls" in trl:
        print("TRL's adapters copied from hfsdp's before step 1 (TRL's own initialisation "
              f"{'gave the same weights' if trl['initial_as_trls'] else 'differed'})")
    print("grad norms: hfsdp's (float64 sums), TRL's gradients' in float64 (which TRL clips by here), and the float32 "
          "one TRL logs (torch's clip_grad_norm_); the difference is taken against the float64 one")
    print(f"{'step':>4} {'hfsdp loss':>13} {'TRL loss':>13} {'abs diff':>9} {'rel diff':>9} {'hfsdp grad':>11} "
          f"{'TRL f64':>11} {'rel diff':>9} {'TRL logged':>11}")
    worst_loss = worst_norm = 0.0
    exact = trl["float64_norms"] or trl["grad_norms"]  # (no clip: TRL logs torch's norm only)
    for step, (m, loss, norm, logged) in enumerate(zip(ours, trl["losses"], exact, trl["torch_norms"] or
                                                       trl["grad_norms"]), start=1):
        diff = abs(m["loss"] - loss)
        rel = diff / max(abs(loss), 1e-12)
        rel_norm = abs(m["grad_norm"] - norm) / max(abs(norm), 1e-12)
        # The first step of a round has ratio 1: its loss is minus the token mean of advantages that sum to 0 in
        # each group, a cancellation whose float32 noise (1e-7 of the terms) is large relative to the result.
        worst_loss, worst_norm = max(worst_loss, rel if diff > ABS_FLOOR else 0.0), max(worst_norm, rel_norm)
        print(f"{step:>4} {m['loss']:>13.8f} {loss:>13.8f} {diff:>9.1e} {rel:>9.2e} {m['grad_norm']:>11.6f} "
              f"{norm:>11.6f} {rel_norm:>9.2e} {logged:>11.6f}")
    steps = min(len(ours), len(trl["losses"]), len(exact))
    worst_kl = compare_kl(s, ours, trl["kl"], RLOO_KL_FLOOR if objective_of(cfg) == "rloo" else ABS_FLOOR) \
        if s.beta else 0.0
    met = worst_loss <= 1e-5 and worst_norm <= 1e-5 and worst_kl <= 1e-5 and steps == steps_asked
    if "agent" in trl:
        met = compare_agent(s, trl["agent"]) and met
    print(f"largest differences over {steps} steps: loss {worst_loss:.2e} relative (where over {ABS_FLOOR:.0e} "
          f"absolute), grad norm {worst_norm:.2e} relative"
          + (f", kl {worst_kl:.2e} relative (where compared and over "
             f"{RLOO_KL_FLOOR if objective_of(cfg) == 'rloo' else ABS_FLOOR:.0e} absolute)" if s.beta else "")
          + f" (target 1e-5): {'MET' if met else 'NOT MET'}")


def compare_agent(s, checks: dict) -> bool:
    """The rollouts' comparison (:class:`AgentReplay`): whether TRL's loop, running the calls itself on hfsdp's
    turns, made hfsdp's completions, tool masks and conversations, and its rewards' largest differences."""
    where = f"tools {s.tools}" if s.tools else ""
    where += f"{', ' if where else ''}environment {s.environment}" if s.environment else ""
    print(f"rollouts ({where}, at most {s.max_tool_calling_iterations} rounds of calls): {checks['completions']} "
          f"completions, {checks['acted']} with tool results, {checks['turns']} turns, "
          f"{checks['sampled_tokens']} sampled tokens and {checks['tool_tokens']} tool-result tokens; TRL's "
          f"completion ids, tool_mask and messages equal to hfsdp's: "
          + ("all" if not checks["mismatches"] else f"{len(checks['mismatches'])} differences"))
    for line in checks["mismatches"][:10]:
        print(f"  {line}")
    print("rewards, largest absolute difference per function: "
          + ", ".join(f"{name} {diff:.1e}" for name, diff in checks["rewards"].items()))
    return not checks["mismatches"] and checks["completions"] > 0 and checks["acted"] > 0 \
        and all(diff <= 1e-6 for diff in checks["rewards"].values())


def compare_kl(s, ours: list[dict], theirs: list[float], floor: float = ABS_FLOOR) -> float:
    """Each step's mean KL to the reference (the base model, the adapters disabled on both sides): the KL term's own
    comparison, which at beta 0.04 is too small to show in the loss (about beta x 1e-4 here) or its gradient. TRL's
    metric is of its per-token KL after the bias correction (times the ratio, ``use_bias_correction_kl``), hfsdp's
    before it: with the correction they are compared on the steps whose ratio is 1 (a round's first), else on all.
    Each token's KL, ``exp(d) - d - 1`` for a log-ratio ``d`` of about 1e-2 here, is a difference of terms of about 1:
    its float32 rounding is about 1e-7 absolute, over 1e-3 of a KL of 1e-4, so as for the loss, differences under
    ABS_FLOOR absolute are printed but not counted. The largest relative difference where compared."""
    print(f"{'step':>4} {'hfsdp kl':>13} {'TRL kl':>13} {'abs diff':>9} {'rel diff':>9}")
    worst = 0.0
    for step, (m, kl) in enumerate(zip(ours, theirs), start=1):
        if kl is None:  # RLOO's: logged at a round's first step only
            continue
        compared = not (getattr(s, "use_bias_correction_kl", False) and s.num_iterations > 1) \
            or (step - 1) % s.num_iterations == 0
        diff = abs(m["kl"] - kl)
        rel = diff / max(abs(kl), 1e-12)
        worst = max(worst, rel) if compared and diff > floor else worst
        print(f"{step:>4} {m['kl']:>13.6e} {kl:>13.6e} {diff:>9.1e} {rel:>9.2e}"
              + ("" if compared else " (TRL's times the ratio: not compared)"))
    if len(theirs) < len(ours):
        worst = float("inf")  # TRL logged no KL
    return worst


def speed(cfg, s, rounds: list[tuple[list[dict], dict[str, list[float]]]]) -> None:
    """Each side's mean step time over steps 2.. of each round (generation and training), medians over rounds."""
    rows = {"hfsdp": [], "TRL": []}
    for ours, trl in rounds:
        timed = ours[1:]  # generation_s is 0 on the steps that reuse a round (num_iterations > 1)
        rows["hfsdp"].append((statistics.mean(m["step_time_s"] for m in timed),
                              statistics.mean(m["generation_s"] for m in timed),
                              statistics.mean(m["completion_length"] for m in timed)))
        rows["TRL"].append((statistics.mean(trl["step_times"][1:]),
                            sum(trl["generation_s"][1:]) / len(trl["step_times"][1:]),
                            statistics.mean(trl["lengths"][1:])))
    print(f"\n{objective_of(cfg).upper()} speed on {cfg.model.name_or_path}: {cfg.train.per_device_batch_size} "
          "completions per step "
          f"({s.num_generations} per prompt, at most {s.max_new_tokens} tokens, temperature {s.temperature}), "
          f"num_iterations {s.num_iterations}, fp32, one process, each side its own generation; mean over steps "
          f"2.. of each of {len(rounds)} interleaved round(s), then the median")
    print(f"{'':>6} {'step s':>8} {'generation s':>13} {'training s':>11} {'completion tokens':>18} "
          f"{'s per completion token':>23}")
    medians = {}
    for name, values in rows.items():
        step, gen, length = (statistics.median(v[i] for v in values) for i in range(3))
        per_token = statistics.median(v[0] / v[2] for v in values)
        medians[name] = (step, per_token)
        print(f"{name:>6} {step:>8.3f} {gen:>13.3f} {step - gen:>11.3f} {length:>18.1f} {per_token:>23.4f}")
    print(f"hfsdp speed / TRL's: {medians['TRL'][0] / medians['hfsdp'][0]:.2f}x per step, "
          f"{medians['TRL'][1] / medians['hfsdp'][1]:.2f}x per completion token")


def arguments(default_config: str, sampling: str, agents: bool = False) -> argparse.Namespace:
    """The command line of this script and of those built on it (trl_rloo.py, trl_distill_online.py); ``agents``:
    with ``--agent`` and ``--model`` (this script's GRPO)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default=default_config)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--speed", action="store_true", help=f"each side its own {sampling}: compare step times")
    parser.add_argument("--rounds", type=int, default=1, help="with --speed: interleaved rounds (median)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    if agents:
        parser.add_argument("--agent", choices=sorted(AGENTS), help="multi-turn rollouts that call a tool function "
                            "(tools) or an environment's methods, the environment owning the reward (environment)")
        parser.add_argument("--model", help="with --agent: the model (default: the tiny SmolLM2 taught to call the "
                            "tool, made first: make_caller)")
    return parser.parse_args()


def fixed_overrides(steps: int) -> list[str]:
    """What the side-by-side runs fix: ``steps`` steps, every one logged, no eval, no export."""
    return [f"train.max_steps={steps}", "train.eval_at_start=false", "train.eval_every=null", "data.eval_path=null",
            "train.log_every=1", "train.export_final=false"]


def main(default_config: str = "grpo") -> None:
    script = Path(sys.argv[0]).name
    args = arguments(default_config, "generation", agents=default_config == "grpo")

    from hfsdp.config.files import load_config
    from hfsdp.errors import ConfigError

    fixed = fixed_overrides(args.steps)
    agent = getattr(args, "agent", None)
    if agent is not None:
        if args.speed:
            raise SystemExit(f"{script}: --agent compares on the same rollouts; --speed is single-turn")
        sys.path.insert(0, str(AGENT_TOOLS))  # TRL's side imports the same tools in this process
        keep = tempfile.TemporaryDirectory()
        model = args.model or str(make_caller(Path(keep.name)))
        fixed = [*fixed, *agent_overrides(agent, model)]
    try:
        objective = objective_of(load_config(args.config, [*fixed, *args.overrides])[0])
        overrides = [*fixed, f"{objective}.log_completions=100000", *args.overrides]
        cfg, host = load_config(args.config, overrides)
    except ConfigError as err:  # e.g. beta > 0 without lora: hfsdp refuses it too
        raise SystemExit(f"{script}: {err}") from None
    s = run_section(cfg)
    if (cfg.train.gradient_accumulation_steps != 1 or cfg.fsdp.mixed_precision != "no"
            or sorted(cfg.plugins) not in ([objective], sorted([objective, "lora"]))):
        raise SystemExit(f"{script} compares one process, fp32, plugins [{objective}] (full fine-tuning) or "
                         f"[{objective}, lora] (LoRA), without accumulation")
    if s.beta and "lora" not in cfg.plugins:
        raise SystemExit(f"{script}: beta > 0 needs lora in plugins (hfsdp's KL reference is the base model with "
                         "LoRA's adapters disabled, as TRL's with a peft_config): "
                         f"--set \"plugins=[{objective}, lora]\"")
    if args.speed and args.steps < 2:
        raise SystemExit("--speed times steps 2..: give --steps 2 or more")
    if agent is not None and objective != "grpo":
        raise SystemExit(f"{script}: --agent compares GRPO (TRL's RLOOTrainer takes no tools)")
    results = []
    for _ in range(args.rounds if args.speed else 1):
        rows = {} if agent is not None else None
        with tempfile.TemporaryDirectory() as out:
            ours, completions, initial = run_hfsdp(args.config, overrides, Path(out) / "run", cfg.plugins, rows,
                                                   (str(AGENT_TOOLS), str(Path(__file__).resolve().parent))
                                                   if agent is not None else ())
        results.append((ours, run_trl(cfg, host, args.steps, None if args.speed else completions, initial, rows)))
    if args.speed:
        speed(cfg, s, results)
        return
    ours, trl = results[0]
    compare(cfg, s, ours, trl, args.steps)
    if len(ours) > 1:
        print(f"median step time (hfsdp with its generation, TRL with the generation replaced): hfsdp "
              f"{statistics.median(m['step_time_s'] for m in ours[1:]):.3f} s, TRL "
              f"{statistics.median(trl['step_times'][1:]):.3f} s")


if __name__ == "__main__":
    main()
