"""Plugin ``reward_model``: a reward model (TRL 1.16's ``RewardTrainer``) trained on ``preference`` rows. Enable with
``plugins: [reward_model]`` and ``data.format: preference``. Config section ``reward_model:``:
:class:`RewardModelSection` (``hfsdp config-reference reward_model``, docs/configuration.md). The head and the export:
:mod:`hfsdp.builtin.reward_model.model`; the loss and its metrics: :mod:`hfsdp.builtin.reward_model.loss` (imported
when a run trains or exports, so that ``hfsdp validate`` and ``hfsdp plugins`` need no torch).

The causal LM becomes its architecture's ``*ForSequenceClassification`` model over the same base weights, with a
one-output ``score`` head (``hfsdp_modify_model``); each sequence's reward is the head's output at its last token
that is not padding (transformers' pooling, which the exported model uses too). The loss is the pairwise
Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected [- margin])`` plus, with ``center_rewards_coefficient``, that
times ``(r_chosen + r_rejected)^2``, averaged over the pairs. The export (``hfsdp_export``) is a Hugging Face folder
that ``AutoModelForSequenceClassification.from_pretrained`` loads (``num_labels`` 1, ``pad_token_id`` set).
"""

from __future__ import annotations

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.builtin.preference import format_problems
from hfsdp.config.schema import Section
from hfsdp.rules.table import Rule


class RewardModelSection(Section):
    margin: bool = Field(False, description="subtract each row's margin column (a number: how much the chosen "
                                            "completion is preferred) from the reward difference inside the loss, as "
                                            "TRL does when its rows have one; the rows must then all have it")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="add this times the mean of (r_chosen + r_rejected)^2 to the loss, which keeps the "
                                "rewards centred on 0 (TRL's center_rewards_coefficient; the paper's 0.01); null: off")


@hookimpl
def hfsdp_config_section():
    return "reward_model", RewardModelSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("reward_model", "data.format", "plugins"), config_problems)]


def config_problems(config, facts):
    problems = format_problems(config, "reward_model")
    if "lora" in config.plugins:
        problems.append(("plugins", "reward_model trains the whole model and its score head; with lora the adapters "
                                    "would not carry the new head yet: remove lora from plugins"))
    return problems


@hookimpl(tryfirst=True)  # before any plugin that changes the model it returns
def hfsdp_modify_model(model, config, tokenizer):
    from hfsdp.builtin.reward_model.model import sequence_classifier

    pad_id = tokenizer.pad_token_id if tokenizer is not None else None
    return sequence_classifier(model, pad_id, seed=config.train.seed)


@hookimpl
def hfsdp_trains_on():
    return "preference"


@hookimpl
def hfsdp_objective(config):
    from hfsdp.builtin.reward_model.loss import RewardModel

    return RewardModel(config.section("reward_model"))


@hookimpl
def hfsdp_export(state_dict, model_config, tokenizer, out_dir, max_shard_bytes):
    from hfsdp.builtin.reward_model.model import write_reward_model

    write_reward_model(state_dict, model_config, tokenizer, out_dir, max_shard_bytes=max_shard_bytes)
    return True
