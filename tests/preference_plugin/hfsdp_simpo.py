"""A third-party preference loss written against hfsdp's public hooks (the example of docs/plugins.md): SimPO
(Meng, Xia and Chen, 2024), which needs no reference model. Enable with ``plugins: [hfsdp_simpo]`` (this folder on
PYTHONPATH, or the module installed with an entry point in the ``hfsdp`` group) and ``data.format: preference``.

    simpo:
      beta: 2.0    # scale of the length-normalised log-prob margin
      gamma: 0.5   # target margin

A pair's loss is ``-log sigmoid(beta * (logp(chosen)/|chosen| - logp(rejected)/|rejected|) - gamma)``.
"""

import torch.nn.functional as F
from pydantic import Field

import hfsdp
from hfsdp.config.schema import Section
from hfsdp.objective import PreferenceObjective


class SimpoSection(Section):
    beta: float = Field(2.0, gt=0, description="scale of the length-normalised margin")
    gamma: float = Field(0.5, ge=0, description="target margin")


@hfsdp.hookimpl
def hfsdp_config_section():
    return "simpo", SimpoSection


@hfsdp.hookimpl
def hfsdp_validate_config(config):
    if config.data.format != "preference":
        return [("data.format", "simpo trains on preference rows: set data.format: preference")]
    return None


@hfsdp.hookimpl
def hfsdp_objective(config):
    return SimPO(config.section("simpo"))


class SimPO(PreferenceObjective):
    def __init__(self, section: SimpoSection):
        super().__init__()
        self.section = section

    def loss(self, model, batch):
        chosen, rejected = self.completion_logps(model, batch)  # one forward of the chosen and rejected rows
        tokens = batch.completion_tokens.clamp(min=1).float()
        margin = self.section.beta * (chosen / tokens[:batch.pairs] - rejected / tokens[batch.pairs:])
        self.record(batch, **{"rewards/margins": margin, "rewards/accuracy": (margin > 0).float()})
        return (F.softplus(self.section.gamma - margin) * batch.weights).sum()  # summed; hfsdp averages over pairs
