"""Plugin ``distill_online``: on-policy distillation as TRL 1.16's ``DistillationTrainer`` (the student samples
completions of ``prompt`` rows and a frozen teacher scores every token of them; the loss is the generalized
Jensen-Shannon divergence between the two next-token distributions at the sampled positions, ``beta`` 0 forward KL,
1 reverse KL), with GKD's ``lmbda``: the share of rounds the student samples, the others training on the rows' own
completions. Enable with ``plugins: [distill_online]`` and ``data.format: prompt``. Config section
``distill_online:``: :class:`DistillOnlineSection` (``hfsdp config-reference distill_online``). Sampling, rounds and
the completions log are the online objectives' (:mod:`hfsdp.builtin.online.objective`: the same completions on
any world size and after a resume); the teacher is ``distill``'s (:mod:`hfsdp.builtin.distill.teacher`: frozen, sharded
over the ranks); the loss: :mod:`hfsdp.builtin.distill_online.loss`. Reward functions are optional: named, they
score the completions for the metrics and ``eval_reward``, not the loss. ``distill`` is the off-policy one (GKD at
``lmbda`` 0, on labelled tokens).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from hfsdp import hookimpl
from hfsdp.builtin.distill import teacher_problems
from hfsdp.builtin.agent.checks import template_problems
from hfsdp.builtin.online.rewards import BUILTIN_REWARDS, online_problems, reward_functions
from hfsdp.builtin.online.schema import OnlineSection, RewardSpec
from hfsdp.rules.table import Rule


class DistillOnlineSection(OnlineSection):
    teacher: str = Field(..., description="the teacher: a Hugging Face folder or a built-in model name, with the "
                                          "student's tokenizer and vocabulary (loaded frozen, in model.dtype)")
    beta: float = Field(1.0, ge=0.0, le=1.0, description="TRL's: the divergence, 0 forward KL(teacher || student), 1 "
                                                         "reverse KL(student || teacher), between: the generalized "
                                                         "JSD of that teacher weight (not a KL to a reference)")
    num_generations: int = Field(1, ge=1, description="completions sampled per prompt (TRL's: 1); divides "
                                                      "train.per_device_batch_size")
    num_iterations: int = Field(1, ge=1, description="optimizer steps on each round's completions (TRL's: 1)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature, and both models' logits are divided by "
                                                      "it before the divergence (TRL's one key)")
    lmbda: float = Field(1.0, ge=0.0, le=1.0, description="the share of rounds whose completions the student "
                                                          "samples (GKD's lmbda, drawn per round from the seed; 1: "
                                                          "every round, as TRL's DistillationTrainer); the other "
                                                          "rounds train on the rows' own completion_column")
    completion_column: str = Field("completion", description="with lmbda < 1: the prompt rows' column holding their "
                                                             "own completion (a text: the assistant's reply)")
    rewards: list[RewardSpec] = Field(default_factory=list, description="optional: reward functions that score the "
                                                                        "completions for the metrics and eval_reward "
                                                                        "(not part of the loss)")

    @model_validator(mode="after")
    def _has_rewards(self):  # (OnlineSection's check, replaced: rewards are optional here)
        return self


@hookimpl
def hfsdp_config_section():
    return "distill_online", DistillOnlineSection


@hookimpl
def hfsdp_reward_functions():
    return dict(BUILTIN_REWARDS)


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("distill_online", "data.format", "plugins"), config_problems),
            Rule("model", ("distill_online.tools", "distill_online.environment", "data.chat_template"),
                 lambda c, f: template_problems(c, f, "distill_online"))]


def config_problems(config, facts):
    return online_problems(config, "distill_online", kl_reference=False) + teacher_problems(config, "distill_online")


@hookimpl
def hfsdp_trains_on():
    return "prompt"


@hookimpl
def hfsdp_objective(config, tokenizer, cache_dir):
    from hfsdp.builtin.distill_online.loss import DistillOnline

    return DistillOnline(config.section("distill_online"), reward_functions(config, "distill_online"), config,
                         tokenizer, cache_dir)
