"""Plugin ``distill``: knowledge distillation from a frozen teacher (a causal LM with the student's tokenizer) on any
token-labelled data (``text``, ``instruction``, ``chat``). Enable with ``plugins: [distill]``. Config section
``distill:``: :class:`DistillSection` (``hfsdp config-reference distill``, docs/configuration.md). The teacher, the
loss and its metrics: :mod:`hfsdp.builtin.distill.loss` (imported when a run trains, so that ``hfsdp validate`` and
``hfsdp plugins`` need no torch).

Each labelled token's loss is ``(1 - alpha) * cross_entropy + alpha * divergence(teacher, student)`` (torchtune's
``kd_ratio`` convention: ``alpha`` weights the distillation term; ``alpha: 1`` is TRL's GKD loss alone), the
divergence being TRL 1.16's ``generalized_jsd_loss`` on both models' logits divided by ``temperature``: forward KL
``KL(teacher || student)`` (TRL's ``beta`` 0), reverse KL ``KL(student || teacher)`` (``beta`` 1), or the generalized
JSD with ``beta``. The teacher is loaded once, frozen (no gradients, no optimizer state, never checkpointed), on
every rank, and sharded with FSDP2 across the ranks when the run has several.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.config.schema import Section
from hfsdp.rules.table import Rule

TOKEN_FORMATS = ("text", "instruction", "chat")


class DistillSection(Section):
    teacher: str = Field(..., description="the teacher: a Hugging Face folder or a built-in model name, with the "
                                          "student's tokenizer and vocabulary (loaded frozen, in model.dtype)")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="forward_kl: KL(teacher || student) (TRL beta 0); reverse_kl: KL(student || teacher) "
                                  "(TRL beta 1); jsd: TRL's generalized Jensen-Shannon divergence with beta")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="weight of the distillation term: each token's loss is "
                                                          "(1 - alpha) * cross entropy + alpha * divergence "
                                                          "(torchtune's kd_ratio; 1: distillation alone, as TRL GKD)")
    temperature: float = Field(1.0, gt=0.0, description="both models' logits are divided by it before the divergence "
                                                        "(as TRL; no temperature^2 factor)")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="jsd only: the mixture's teacher weight (TRL's beta)")


@hookimpl
def hfsdp_config_section():
    return "distill", DistillSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("distill", "data.format", "plugins"), config_problems)]


def config_problems(config, facts):
    section: DistillSection = config.section("distill")
    problems = []
    formats = {s.format or config.data.format for s in config.data.datasets or []} or {config.data.format}
    for fmt in sorted(formats - set(TOKEN_FORMATS)):
        problems.append(("data.format", f"distill trains on labelled tokens: use one of {', '.join(TOKEN_FORMATS)}, "
                                        f"not {fmt}"))
    if "beta" in section.model_fields_set and section.loss != "jsd":
        problems.append(("distill.beta", f"applies to loss jsd only, not {section.loss}"))
    return problems + teacher_problems(config, "distill")


def teacher_problems(config, plugin: str) -> list[tuple[str, str]]:
    """What a run with a frozen teacher (``distill``, ``distill_online``) cannot combine with."""
    if "lora" in config.plugins:
        return [("plugins", f"{plugin} is not combined with lora yet (the teacher would be sharded beside a peft "
                            "model): remove lora from plugins")]
    return []


@hookimpl
def hfsdp_objective(config, tokenizer, cache_dir):
    from hfsdp.builtin.distill.loss import Distill

    return Distill(config.section("distill"), config, tokenizer, cache_dir)
