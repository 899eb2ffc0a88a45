"""Test-only third-party plugin that trains only the last ``freeze.train_last`` decoder layers and the final norm
(layer freezing, as axolotl's ``unfrozen_parameters`` does), to prove that ``hfsdp plan`` predicts what a plugin's
model hooks do, not only what the built-in lora plugin does. Enable it with ``plugins: [hfsdp_freeze]`` and this
folder on PYTHONPATH.

Like LoRA, it leaves the tied embeddings frozen, which trips torch's FSDP1 bug with a single shard: that combination
is refused in ``hfsdp_before_model_load``, as the lora plugin refuses it.
"""

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.config.schema import Section
from hfsdp.errors import ConfigError

__version__ = "0.0.1"


class FreezeSection(Section):
    train_last: int = Field(1, gt=0, description="decoder layers trained, counted from the last")


@hookimpl
def hfsdp_config_section():
    return "freeze", FreezeSection


@hookimpl
def hfsdp_before_model_load(config, world, model_config, setup):
    single_shard = world.size == 1 or config.fsdp.sharding_strategy == "NO_SHARD"
    if setup.wrapper == "fsdp1" and single_shard and getattr(model_config, "tie_word_embeddings", False):
        raise ConfigError([("freeze", "frozen tied embeddings under FSDP1 need 2+ shards: use fsdp.version: 2")])
    if config.section("freeze").train_last > model_config.num_hidden_layers:
        raise ConfigError([("freeze.train_last", f"the model has {model_config.num_hidden_layers} layers")])


@hookimpl
def hfsdp_modify_model(model, config, world):
    keep = config.section("freeze").train_last
    layers = model.model.layers
    trained = [p for layer in layers[len(layers) - keep:] for p in layer.parameters()]
    trained += list(model.model.norm.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    if world.rank == 0:
        print(f"freeze: training the last {keep} of {len(layers)} layers", flush=True)
