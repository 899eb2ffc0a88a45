"""The optimizer a run trains with (``train.optimizer``, ``train.optimizer_args``): what is checked of the arguments
before any weight loads (the choices themselves and where each can run: :mod:`hfsdp.rules.optimizers`), the parameter
groups made by name, the builder, and the implementations that give one process's update on FSDP2's shards.

Every choice is an implementation people already use: ``torch.optim.AdamW``, ``torch.optim.SGD``,
``torch.optim.Adafactor``, ``torch.optim.Muon`` (torch >= 2.9), bitsandbytes' ``AdamW8bit`` and the ``schedulefree``
package's ``AdamWScheduleFree``. hfsdp sets the learning rate, the weight decay (on matrices only) and, for the Adam
family, betas and epsilon from the ``train`` keys; ``optimizer_args`` passes the rest on, checked against the
optimizer's signature and tried on a small tensor before any weight loads (:mod:`hfsdp.rules.optimizers`).

The same update on N ranks as on one process: elementwise optimizers (AdamW, SGD, schedule-free AdamW) update a shard
as they update the whole tensor. Muon orthogonalises whole matrices: under FSDP2
:class:`~hfsdp.run.sharded.muon.WholeMatrixMuon` runs Newton-Schulz on the gathered momentum and keeps this rank's
rows of the result, which is torch's Muon on one process. 8-bit AdamW quantizes its moments in blocks of the flattened
parameter: :class:`~hfsdp.run.sharded.adamw_8bit.ShardedAdamW8bit` runs bitsandbytes' kernels on a rank's shard where
FSDP2's dim-0 shards fall on the blocks, on the gathered tensor elsewhere. Adafactor factors each matrix's second
moment into rows and columns and scales by whole-tensor norms: :class:`~hfsdp.run.sharded.adafactor.ShardedAdafactor`
runs torch's update on the gathered tensors. The three need each parameter whole and are refused where FSDP1 wraps the
model (its flat parameters are slices of several parameters concatenated;
:func:`hfsdp.rules.optimizers.wrapper_problems`). The gradients they get are the same on N ranks as on one process
because the clipping norm is (:func:`hfsdp.parallel.world.clip_grad_norm`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, TYPE_CHECKING

from hfsdp.rules.optimizers import BNB_BLOCK, CHOICES, arguments, param_groups


if TYPE_CHECKING:
    import torch

    from hfsdp.config.schema import TrainConfig


def groups(model: "torch.nn.Module", matrices: set[str], hidden: set[str]) -> dict[str, list]:
    """The trainable parameters by name: ``decay`` (matrices), ``no_decay`` (norms, biases), and for Muon
    ``hidden`` (2-D matrices of the hidden layers: not the embeddings, not the output head). Names are compared
    without the prefixes FSDP1 and its activation checkpointing add."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    out: dict[str, list] = {"hidden": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            name = clean_tensor_name(name)
            out["hidden" if name in hidden else "decay" if name in matrices else "no_decay"].append(p)
    return out


def hidden_matrices(model: "torch.nn.Module") -> set[str]:
    """Names of the 2-D parameters that are not the input embeddings or the output head (Muon's matrices)."""
    outer = set()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            outer |= {id(p) for p in module.parameters()}
    return {name for name, p in model.named_parameters() if p.ndim == 2 and id(p) not in outer}


def build(model: "torch.nn.Module", cfg: "TrainConfig", matrices: set[str] | None = None,
          hidden: set[str] | None = None) -> "torch.optim.Optimizer":
    """``cfg.optimizer`` over ``model``'s trainable parameters, weight decay on the ``matrices`` (names of the
    parameters that are 2-D or more; by default read from ``model``, which FSDP1 cannot give: its parameters are
    flat views of each rank's shard). Muon gets the ``hidden`` matrices (by default read from ``model``), and AdamW
    the rest, in one optimizer (:class:`hfsdp.run.sharded.muon.WholeMatrixMuon`)."""
    if matrices is None:
        matrices = {name for name, p in model.named_parameters() if p.ndim >= 2}
    if cfg.optimizer == "muon" and hidden is None:
        hidden = hidden_matrices(model)
    by_kind = groups(model, matrices, hidden if cfg.optimizer == "muon" else set())
    return CHOICES[cfg.optimizer].load()(param_groups(by_kind, cfg.weight_decay), **arguments(cfg))


def schedule_factor(step: int, *, name: str, warmup: int, total: int) -> float:
    """The learning rate's factor at ``step`` of ``train.lr_scheduler`` ``name`` after ``warmup`` steps of
    ``total``: transformers' ``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup`` and
    ``get_cosine_schedule_with_warmup`` (half a cycle), expression for expression, so the rates are its own bit for
    bit (tests/test_optimizers.py). Written here because ``transformers.optimization`` imports ``trainer_utils``,
    which imports peft and, through it, bitsandbytes and Inductor: about 2 s of every process's start."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def build_scheduler(optimizer: "torch.optim.Optimizer", cfg: "TrainConfig",
                    max_steps: int) -> "torch.optim.lr_scheduler.LambdaLR":
    """``cfg.lr_scheduler`` over ``max_steps`` as a ``LambdaLR`` of :func:`schedule_factor` (a ``partial``, as
    transformers makes it, so its state dict is transformers' too)."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, functools.partial(schedule_factor, name=cfg.lr_scheduler, warmup=cfg.warmup_steps,
                                                 total=max_steps))


@contextlib.contextmanager
def training_mode(optimizer) -> Iterator[None]:
    """Schedule-free optimizers step in train mode (the parameters hold the point gradients are taken at);
    others have no mode."""
    torch_optimizer = _schedule_free(optimizer)
    if torch_optimizer is not None:
        torch_optimizer.train()
        # train() reads self.state[p] of every parameter, which leaves empty entries in the defaultdict before the
        # first step; torch's _init_optim_state (a resume's load target) then takes the state as made and loads
        # nothing into it
        for p in [p for p, st in torch_optimizer.state.items() if not st]:
            del torch_optimizer.state[p]
    yield


def set_training(optimizer) -> None:
    """Put a schedule-free optimizer in train mode (before training steps); others are left as they are."""
    with training_mode(optimizer):
        pass


# The optimizer-state key under which a checkpoint of a schedule-free run keeps its training weights (y) beside the
# averaged weights (x) its model files hold.
TRAINING_WEIGHTS = "hfsdp_training_weights"


def _schedule_free(optimizer):
    """The schedule-free torch optimizer inside ``optimizer`` (Accelerate wraps it), or None for any other."""
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    return torch_optimizer if hasattr(torch_optimizer, "eval") and hasattr(torch_optimizer, "train") else None


def keeps_training_weights(optimizer) -> bool:
    """Whether checkpoints of ``optimizer`` keep the training weights in its state (:func:`evaluation_weights`):
    schedule-free's."""
    return _schedule_free(optimizer) is not None


@contextlib.contextmanager
def evaluation_weights(optimizer) -> Iterator[None]:
    """While inside: the parameters hold the weights a schedule-free optimizer defines for evaluation and export
    (its average ``x``, its ``eval()``), and a copy of the training weights (``y``) is in its state
    (:data:`TRAINING_WEIGHTS`), so that a checkpoint saved there resumes on exactly them
    (:func:`loading_training_weights`); afterwards the parameters hold that copy again, bit for bit (schedulefree's
    ``train()`` computes them back from ``x``, which rounds differently: a run that saves or evaluates more often
    would train other weights). Other optimizers' weights are the parameters themselves."""
    torch_optimizer = _schedule_free(optimizer)
    if torch_optimizer is None or not any(g.get("train_mode") for g in torch_optimizer.param_groups):
        yield
        return
    params = _keep_training_weights(torch_optimizer)
    torch_optimizer.eval()
    try:
        yield
    finally:
        _back_to_training(torch_optimizer, params)


@contextlib.contextmanager
def loading_training_weights(optimizer, kept: bool) -> Iterator[None]:
    """Around the load of a checkpoint whose optimizer state ``kept`` the training weights
    (:func:`evaluation_weights`): a place for them in the state to load into (a sharded load fills what is there),
    and afterwards the parameters set to them, the optimizer in train mode and the copy dropped (the state the
    optimizer digest was taken of). A checkpoint without them (written before hfsdp kept them) resumes as it was
    written: :func:`set_training` computes the training weights from the averaged ones."""
    torch_optimizer = _schedule_free(optimizer)
    if torch_optimizer is None or not kept:
        yield
        return
    params = _keep_training_weights(torch_optimizer)
    yield
    _back_to_training(torch_optimizer, params)


def _keep_training_weights(torch_optimizer) -> list:
    """A copy of each stepped parameter (one with schedule-free's ``z``) in its state, under
    :data:`TRAINING_WEIGHTS`; the parameters."""
    params = [p for g in torch_optimizer.param_groups for p in g["params"] if "z" in torch_optimizer.state.get(p, {})]
    for p in params:
        torch_optimizer.state[p][TRAINING_WEIGHTS] = p.detach().clone()
    return params


def _back_to_training(torch_optimizer, params: list) -> None:
    """The parameters set to the training weights in their state (the copy dropped from it), the optimizer in train
    mode without recomputing them."""
    import torch

    with torch.no_grad():
        for p in params:
            if p.numel():
                p.copy_(torch_optimizer.state[p].pop(TRAINING_WEIGHTS))
            else:  # (FSDP1 loads no state for a rank's empty slice of a flat parameter)
                torch_optimizer.state[p].pop(TRAINING_WEIGHTS, None)
    for g in torch_optimizer.param_groups:
        g["train_mode"] = True


def blocks_follow_shards(shape: "tuple[int, ...] | torch.Size", shards: int, block: int = BNB_BLOCK) -> bool:
    """Whether bitsandbytes' quantization blocks of a parameter of ``shape`` (``block`` elements of the flattened
    tensor each) fall whole into the ``shards`` pieces FSDP2 cuts it into along dim 0 (``torch.chunk``'s: each
    ``ceil(rows / shards)`` rows, the last ones fewer or none), and the blocks' scales chunked the same way give each
    rank the scales of its own blocks: then a rank's shard is quantized in one process's blocks. True for the
    matrices of common models (576 x 576 in 2: 288 rows x 576 = 648 blocks), not for every shape (37 x 24 in 2)."""
    numel = math.prod(shape)
    if shards == 1 or numel == 0:
        return True
    rows = shape[0]
    per_shard = -(-rows // shards) * (numel // rows)
    blocks = -(-numel // block)
    return per_shard % block == 0 and -(-blocks // shards) * block == per_shard
