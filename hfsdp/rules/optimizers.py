"""The optimizer choices (``train.optimizer``, named in :data:`hfsdp.config.schema.OPTIMIZER_NAMES`) and what
decides, before anything loads, whether and where each can run: the table of implementations (:data:`CHOICES`), the
keyword arguments ``optimizer_args`` may give (each optimizer's signature less what hfsdp sets, written down in the
table so that checking them imports nothing; a test holds it against the installed signatures), what the config
alone rules out (:func:`config_problems`) and the wrappers that cannot give one process's update
(:func:`wrapper_problems`), the arguments and parameter groups an optimizer is built with (:func:`arguments`,
:func:`param_groups`), and the trial of ``optimizer_args``' values on a small layer before any weight loads
(:func:`trial_problems`, the rule table's ``trial`` phase: the one function here that imports torch, when it runs).
The builder and the sharded implementations are :mod:`hfsdp.run.optimizers`."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hfsdp.config.schema import OPTIMIZER_NAMES
from hfsdp.rules.quantization import BITSANDBYTES

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig, TrainConfig


@dataclass(frozen=True)
class Choice:
    """One value of ``train.optimizer``."""

    path: str  # "module:Class"
    pip: str | None  # what installs it, None: torch itself
    adam: bool  # hfsdp passes betas and eps (train.adam_*)
    # the keyword arguments optimizer_args may give: the signature less what hfsdp sets (SET_BY), in its order
    takes: tuple[str, ...]
    defaults: dict[str, Any] = field(default_factory=dict)  # hfsdp's own, which optimizer_args may change
    # why each parameter must be whole (refused under FSDP1), None: it updates each element on its own
    whole: str | None = None

    def load(self) -> type:
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def installed(self) -> bool:
        # the package pip installs (hfsdp's own subclasses live in hfsdp, their base in it)
        module = self.pip.split("==")[0] if self.pip else self.path.split(".")[0].split(":")[0]
        return importlib.util.find_spec(module) is not None


SCHEDULEFREE = "schedulefree==1.4.1"  # the version hfsdp is tested with (pyproject's optimizers extra)
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096  # bitsandbytes' 8-bit block size and its smallest 8-bit tensor (its default)


CHOICES: dict[str, Choice] = {
    # fused: one kernel per step instead of a loop of per-parameter ops (CPU's default); 3x faster on 2 CPU cores.
    "adamw": Choice("torch.optim:AdamW", None, adam=True, defaults={"fused": True},
                    takes=("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")),
    "adamw_8bit": Choice(
        "hfsdp.run.sharded.adamw_8bit:ShardedAdamW8bit", BITSANDBYTES, adam=True,
        takes=("amsgrad", "optim_bits", "args", "min_8bit_size", "is_paged"),
        whole="its moments are quantized in blocks of each parameter"),
    "adafactor": Choice(
        "hfsdp.run.sharded.adafactor:ShardedAdafactor", None, adam=False,
        takes=("beta2_decay", "eps", "d", "foreach", "maximize"),
        whole="it factors each matrix's second moment into its rows and columns"),
    "muon": Choice("hfsdp.run.sharded.muon:WholeMatrixMuon", None, adam=True,
                   takes=("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn", "ns_eps"),
                   whole="it orthogonalises each whole matrix"),
    "schedule_free_adamw": Choice("schedulefree:AdamWScheduleFree", SCHEDULEFREE, adam=True,
                                  takes=("warmup_steps", "r", "weight_lr_power", "foreach")),
    "sgd": Choice("torch.optim:SGD", None, adam=False,
                  takes=("momentum", "dampening", "nesterov", "maximize", "foreach", "differentiable", "fused")),
}
assert tuple(CHOICES) == OPTIMIZER_NAMES, "every train.optimizer value has one implementation, in the schema's order"
MUON_TORCH = (2, 9)  # torch.optim.Muon's first release


# the keyword arguments hfsdp sets itself, from these keys (betas and eps only for the Adam family)
SET_BY = {"params": "hfsdp (the parameter groups)", "lr": "train.learning_rate", "weight_decay": "train.weight_decay",
          "betas": "train.adam_beta1 and train.adam_beta2", "eps": "train.adam_epsilon"}


def set_by_hfsdp(choice: Choice) -> set[str]:
    return {"params", "lr", "weight_decay"} | ({"betas", "eps"} if choice.adam else set())


def config_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """What cannot work, from the config alone, before anything loads and without importing torch: a package not
    installed, a torch without Muon, an argument the optimizer does not take or that a train key sets, schedule-free
    with an LR schedule."""
    cfg = config.train
    choice = CHOICES[cfg.optimizer]
    if choice.pip is not None and not choice.installed:  # (torch's own: hfsdp needs torch to train at all)
        return [("train.optimizer", f"{cfg.optimizer} needs {choice.pip.split('==')[0]}, which is not installed: "
                                    f"pip install '{choice.pip}' (or pip install 'hfsdp[optimizers]')")]
    if cfg.optimizer == "muon" and importlib.util.find_spec("torch") is not None:
        torch_version = importlib.metadata.version("torch")
        if tuple(int(part) for part in torch_version.split(".")[:2]) < MUON_TORCH:
            return [("train.optimizer", f"muon needs torch.optim.Muon, which torch {torch_version} lacks: "
                                        "pip install 'torch>=2.9'")]
    out = []
    for key in cfg.optimizer_args:
        if key in set_by_hfsdp(choice):
            out.append((f"train.optimizer_args.{key}", f"set by {SET_BY[key]}: remove it from optimizer_args"))
        elif key not in choice.takes:
            out.append((f"train.optimizer_args.{key}",
                        f"unknown argument of {cfg.optimizer} ({choice.path.replace(':', '.')}); it takes: "
                        f"{', '.join(choice.takes) or 'none'}"))
    if cfg.optimizer == "schedule_free_adamw" and cfg.lr_scheduler != "constant":
        out.append(("train.lr_scheduler", f"{cfg.lr_scheduler}: schedule-free AdamW replaces the LR schedule (it "
                                          "averages its iterates instead): set train.lr_scheduler: constant "
                                          "(train.warmup_steps still warms up)"))
    return out


def wrapper_problems(config: "HfsdpConfig", wrapper: str) -> list[tuple[str, str]]:
    """An optimizer that cannot give one process's update under ``wrapper`` (what wraps the model on this world:
    ``hfsdp.rules.wrapping.wrapper``), refused before any weight loads with the reason."""
    name = config.train.optimizer
    choice = CHOICES[name]
    if wrapper == "fsdp1" and choice.whole:
        return [("train.optimizer", f"{name} cannot run under FSDP1: {choice.whole}, and FSDP1 gives the optimizer "
                                    "flat slices of several parameters concatenated: use fsdp.version: 2")]
    return []


def arguments(cfg: "TrainConfig") -> dict[str, Any]:
    """The keyword arguments ``cfg.optimizer`` is built with: hfsdp's defaults, the learning rate, the Adam family's
    betas and epsilon from the ``train`` keys, then ``optimizer_args``."""
    choice = CHOICES[cfg.optimizer]
    return {**choice.defaults, "lr": cfg.learning_rate,
            **({"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon} if choice.adam else {}),
            **cfg.optimizer_args}


def param_groups(by_kind: dict[str, list], weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups from the trainable parameters by kind: ``hidden`` (Muon's matrices,
    ``use_muon``), ``decay`` (matrices), ``no_decay`` (norms, biases); empty groups left out."""
    groups = [{"params": by_kind["hidden"], "weight_decay": weight_decay, "use_muon": True},
              {"params": by_kind["decay"], "weight_decay": weight_decay},
              {"params": by_kind["no_decay"], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def trial_problems(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """The values of ``optimizer_args`` the optimizer itself refuses (a negative momentum, a tuple of the wrong
    length), found by building it as a run does over a small layer (its weight a hidden matrix) and stepping it once
    (schedule-free in train mode), before any weight loads. The names were checked by :func:`config_problems`."""
    cfg = config.train
    if not cfg.optimizer_args or config_problems(config):
        return []
    import torch

    layer = torch.nn.Linear(4, 4)
    muon = cfg.optimizer == "muon"
    by_kind = {"hidden": [layer.weight] if muon else [], "decay": [] if muon else [layer.weight],
               "no_decay": [layer.bias]}
    try:
        optimizer = CHOICES[cfg.optimizer].load()(param_groups(by_kind, cfg.weight_decay), **arguments(cfg))
        for p in layer.parameters():
            p.grad = torch.full_like(p, 0.5)
        if hasattr(optimizer, "train"):  # schedule-free steps in train mode
            optimizer.train()
        optimizer.step()
    except (ValueError, TypeError, RuntimeError, AssertionError) as err:
        refused = str(err).splitlines()[0] if str(err) else type(err).__name__
        return [("train.optimizer_args", f"{cfg.optimizer} refuses them: {refused}")]
    return []
