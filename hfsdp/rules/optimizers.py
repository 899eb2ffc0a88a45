"""The optimizer choices (``train.optimizer``) and what decides, before anything loads, where each can run: the
table of implementations (:data:`CHOICES`), the keyword arguments ``optimizer_args`` may give (each optimizer's
signature less what hfsdp sets), and the wrappers that cannot give one process's update
(:func:`wrapper_problems`). Torch-free; the builders, the parameter groups and the sharded implementations are
:mod:`hfsdp.run.optimizers`, which also tries ``optimizer_args`` on a small tensor (:func:`hfsdp.run.optimizers.problems`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig


@dataclass(frozen=True)
class Choice:
    """One value of ``train.optimizer``."""

    path: str  # "module:Class"
    pip: str | None  # what installs it, None: torch itself
    adam: bool  # hfsdp passes betas and eps (train.adam_*)
    defaults: dict[str, Any] = field(default_factory=dict)  # hfsdp's own, which optimizer_args may change
    # why each parameter must be whole (refused under FSDP1), None: it updates each element on its own
    whole: str | None = None
    # why a shard of a parameter cannot be updated as the whole one (refused where FSDP2 shards), None: it can
    unsharded: str | None = None

    def load(self) -> type:
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def installed(self) -> bool:
        # the package pip installs (hfsdp's own subclasses live in hfsdp, their base in it)
        module = self.pip.split("==")[0] if self.pip else self.path.split(".")[0].split(":")[0]
        return importlib.util.find_spec(module) is not None


BITSANDBYTES = "bitsandbytes==0.50.2"  # the version hfsdp is tested with (pyproject's optimizers and qlora extras)


SCHEDULEFREE = "schedulefree==1.4.1"
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096  # bitsandbytes' 8-bit block size and its smallest 8-bit tensor (its default)


CHOICES: dict[str, Choice] = {
    # fused: one kernel per step instead of a loop of per-parameter ops (CPU's default); 3x faster on 2 CPU cores.
    "adamw": Choice("torch.optim:AdamW", None, adam=True, defaults={"fused": True}),
    "adamw_8bit": Choice(
        "hfsdp.run.optimizers:ShardedAdamW8bit", BITSANDBYTES, adam=True,
        whole="its moments are quantized in blocks of each parameter"),
    "adafactor": Choice(
        "hfsdp.run.optimizers:ShardedAdafactor", None, adam=False,
        whole="it factors each matrix's second moment into its rows and columns"),
    "muon": Choice("hfsdp.run.optimizers:WholeMatrixMuon", None, adam=True,
                   whole="it orthogonalises each whole matrix"),
    "schedule_free_adamw": Choice("schedulefree:AdamWScheduleFree", SCHEDULEFREE, adam=True),
    "sgd": Choice("torch.optim:SGD", None, adam=False),
}


OPTIMIZER_NAMES = tuple(CHOICES)


# the keyword arguments hfsdp sets itself, from these keys (betas and eps only for the Adam family)
SET_BY = {"params": "hfsdp (the parameter groups)", "lr": "train.learning_rate", "weight_decay": "train.weight_decay",
          "betas": "train.adam_beta1 and train.adam_beta2", "eps": "train.adam_epsilon"}


def set_by_hfsdp(choice: Choice) -> set[str]:
    return {"params", "lr", "weight_decay"} | ({"betas", "eps"} if choice.adam else set())


def signature_keys(choice: Choice) -> list[str]:
    """The keyword arguments ``optimizer_args`` may give: the optimizer's signature less what hfsdp sets."""
    return [p.name for p in inspect.signature(choice.load()).parameters.values()
            if p.name not in set_by_hfsdp(choice) and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def wrapper_problems(config: "HfsdpConfig", wrapper: str) -> list[tuple[str, str]]:
    """An optimizer that cannot give one process's update under ``wrapper`` (what wraps the model on this world:
    ``hfsdp.rules.wrapping.wrapper``), refused before any weight loads with the reason."""
    name = config.train.optimizer
    choice = CHOICES[name]
    if wrapper == "fsdp1" and choice.whole:
        return [("train.optimizer", f"{name} cannot run under FSDP1: {choice.whole}, and FSDP1 gives the optimizer "
                                    "flat slices of several parameters concatenated: use fsdp.version: 2")]
    if wrapper == "fsdp2" and choice.unsharded:
        return [("train.optimizer", f"{name} cannot run on FSDP2's sharded parameters: {choice.unsharded}. Run it "
                                    "without FSDP2's shards: on one process without FSDP (fsdp.single_process: "
                                    "auto), under DDP (fsdp.sharding_strategy: NO_SHARD), or choose another "
                                    "optimizer")]
    return []
