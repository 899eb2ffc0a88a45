"""``fsdp.wrap_policy: size``: FSDP units by parameter count, under FSDP1 and FSDP2, tied embeddings kept whole.

Accelerate's own size policy cannot be used: under FSDP2 it shards every module whose parameters (counting those
of units below it) exceed the threshold, so it picks the decoder layers' ``ModuleList``, which ``fully_shard``
refuses; under both versions it puts tied input and output embeddings in different units (FSDP1's first forward
fails; torch >= 2.13 refuses one parameter in two FSDP2 groups). :func:`size_units` is torch's size rule with tied
parameters left to the root; :class:`SizeUnits` is that rule as the policy Accelerate applies (imported only when
the size policy is asked for: it imports FSDP).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp.wrap import CustomPolicy, size_based_auto_wrap_policy


def size_units(model: torch.nn.Module, min_num_params: int) -> list[str]:
    """Names of the modules the size policy makes FSDP units, innermost first (the root, always a unit, not listed).

    torch's ``size_based_auto_wrap_policy``, in post-order: a module becomes a unit when its parameters not already
    in a unit below it number at least ``min_num_params``; containers (``ModuleList``, ``ModuleDict``: no forward)
    never do, and force-leaf modules (``MultiheadAttention``) are not looked into. hfsdp's one addition: a module
    holding a tied parameter (one parameter in several modules, such as tied input and output embeddings) never
    becomes a unit, so a tied pair is never split: it stays in the root unit. Only sizes and identities are read, so
    it works on the meta device (``hfsdp plan``).
    """
    containers = tuple(size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES)
    leaves = tuple(size_based_auto_wrap_policy.FORCE_LEAF_MODULES)
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    tied = {pid for pid, n in seen.items() if n > 1}
    units: list[str] = []
    in_unit: set[int] = set()

    def visit(name: str, module: torch.nn.Module) -> None:
        if not isinstance(module, leaves):
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
        if not name or isinstance(module, containers):
            return
        params = {id(p): p for p in module.parameters()}
        if tied & params.keys():
            return
        if sum(_num_params(p) for pid, p in params.items() if pid not in in_unit) >= min_num_params:
            units.append(name)
            in_unit.update(params)

    visit("", model)
    return units


def _num_params(param: torch.Tensor) -> int:
    """The weights a parameter holds: a packed 4-bit weight (bitsandbytes' ``Params4bit``, QLoRA) counts the
    weights of its layer, not its packed storage elements (8 per float32), so the units of a 4-bit base are those
    of the model it quantizes (and those ``hfsdp plan`` predicts from the unquantized meta model)."""
    state = getattr(param, "quant_state", None)
    return state.shape.numel() if state is not None else param.numel()


class SizeUnits(CustomPolicy):
    """The units of :func:`size_units` as a torch ``CustomPolicy``, which Accelerate passes to FSDP1
    (``FullyShardedDataParallel(auto_wrap_policy=...)`` and ``apply_activation_checkpointing``) and, once
    :func:`_fsdp2_honours_size_units` has taught it, applies under FSDP2 (``fully_shard`` per unit, and the
    activation-checkpoint wrappers).

    The units are those of the first model the policy is asked about. Accelerate asks first with the model as it
    was loaded (or as LoRA changed it), before anything wraps it; later questions (activation checkpointing after
    FSDP1 wrapped the model, FSDP2 sharding after the checkpoint wrappers) are about the same module objects.
    """

    def __init__(self, min_num_params: int):
        super().__init__(self.applies_to)
        self.min_num_params = min_num_params
        self.units: dict[int, str] | None = None  # id(module) -> name, once bound to a model

    def __repr__(self) -> str:
        return f"SizeUnits(min_num_params={self.min_num_params})"

    def bind(self, model: torch.nn.Module) -> None:
        if self.units is None:
            modules = dict(model.named_modules())
            self.units = {id(modules[name]): name for name in size_units(model, self.min_num_params)}

    def applies_to(self, module: torch.nn.Module) -> bool:
        return self.units is not None and id(module) in self.units

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        self.bind(root_module)
        return super()._run_policy(root_module, ignored_modules, root_kwargs)


def _fsdp2_honours_size_units() -> None:
    """Accelerate's FSDP2 preparation (``fsdp2_prepare_model``, ``fsdp2_apply_ac``) asks
    ``fsdp2_prepare_auto_wrap_policy(plugin, model)`` which modules to shard and checkpoint, and knows only its own
    transformer and size policies: for any other it answers None (no layer units; a TypeError under activation
    checkpointing). Wrapped once so that a :class:`SizeUnits` policy answers with its units; every other policy
    gets Accelerate's own answer."""
    from accelerate.utils import fsdp_utils

    original = fsdp_utils.fsdp2_prepare_auto_wrap_policy
    if getattr(original, "_hfsdp_size_units", False):
        return

    def prepare_auto_wrap_policy(fsdp2_plugin, model):
        policy = fsdp2_plugin.auto_wrap_policy
        if isinstance(policy, SizeUnits):
            policy.bind(model)
            return policy.applies_to
        return original(fsdp2_plugin, model)

    prepare_auto_wrap_policy._hfsdp_size_units = True
    fsdp_utils.fsdp2_prepare_auto_wrap_policy = prepare_auto_wrap_policy


_fsdp2_honours_size_units()
