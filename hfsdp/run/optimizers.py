"""The optimizer a run trains with (``train.optimizer``, ``train.optimizer_args``): what is checked of the arguments
before any weight loads (the choices themselves and where each can run: :mod:`hfsdp.rules.optimizers`), the
parameter groups made by name, the builder, and the implementations that give one process's update on FSDP2's
shards.

Every choice is an implementation people already use: ``torch.optim.AdamW``, ``torch.optim.SGD``,
``torch.optim.Adafactor``, ``torch.optim.Muon`` (torch >= 2.9), bitsandbytes' ``AdamW8bit`` and the
``schedulefree`` package's ``AdamWScheduleFree``. hfsdp sets the learning rate, the weight decay (on matrices only)
and, for the Adam family, betas and epsilon from the ``train`` keys; ``optimizer_args`` passes the rest on, checked
against the optimizer's signature and tried on a small tensor before any weight loads.

The same update on N ranks as on one process: elementwise optimizers (AdamW, SGD, schedule-free AdamW) update a
shard as they update the whole tensor. Muon orthogonalises whole matrices: under FSDP2 :class:`WholeMatrixMuon`
runs Newton-Schulz on the gathered momentum and keeps this rank's rows of the result, which is torch's Muon on one
process. 8-bit AdamW quantizes its moments in blocks of the flattened parameter: :class:`ShardedAdamW8bit` runs
bitsandbytes' kernels on a rank's shard where FSDP2's dim-0 shards fall on the blocks, on the gathered tensor
elsewhere. Adafactor factors each matrix's second moment into rows and columns and scales by whole-tensor norms:
:class:`ShardedAdafactor` runs torch's update on the gathered tensors. The three need each parameter whole and are
refused where FSDP1 wraps the model (its flat parameters are slices of several parameters concatenated;
:func:`hfsdp.rules.optimizers.wrapper_problems`). The gradients they get are the same on N ranks as on one
process because the clipping norm is (:func:`hfsdp.parallel.world.clip_grad_norm`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, TYPE_CHECKING

from hfsdp.rules.optimizers import BNB_BLOCK, CHOICES, config_problems


if TYPE_CHECKING:
    import torch

    from hfsdp.config.schema import HfsdpConfig, TrainConfig


def refused_arguments(config: "HfsdpConfig") -> list[tuple[str, str]]:
    """The values of ``optimizer_args`` the optimizer itself refuses (a negative momentum, a tuple of the wrong
    length), found by building it over a small layer and stepping it once, before any weight loads (``train`` and
    ``hfsdp validate`` with its rows ask; the torch-free checks of the names are
    :func:`hfsdp.rules.optimizers.config_problems`)."""
    cfg = config.train
    if not cfg.optimizer_args or config_problems(config):
        return []
    refused = _try_on_small_tensors(config)
    return [("train.optimizer_args", f"{cfg.optimizer} refuses them: {refused}")] if refused else []


def _try_on_small_tensors(config: "HfsdpConfig") -> str | None:
    """The optimizer built with the run's arguments over a small matrix and vector (and stepped once): its own
    refusal of a value (a negative momentum, a tuple of the wrong length), or None."""
    import torch

    layer = torch.nn.Linear(4, 4)
    try:
        optimizer = build(layer, config.train, hidden={"weight"})
        for p in layer.parameters():
            p.grad = torch.full_like(p, 0.5)
        with training_mode(optimizer):
            optimizer.step()
    except (ValueError, TypeError, RuntimeError, AssertionError) as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


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
    the rest, in one optimizer (:class:`WholeMatrixMuon`)."""
    if matrices is None:
        matrices = {name for name, p in model.named_parameters() if p.ndim >= 2}
    if cfg.optimizer == "muon" and hidden is None:
        hidden = hidden_matrices(model)
    by_kind = groups(model, matrices, hidden if cfg.optimizer == "muon" else set())
    choice = CHOICES[cfg.optimizer]
    kwargs = {**choice.defaults, "lr": cfg.learning_rate,
              **({"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon} if choice.adam else {}),
              **cfg.optimizer_args}
    param_groups = [{"params": by_kind["hidden"], "weight_decay": cfg.weight_decay, "use_muon": True},
                    {"params": by_kind["decay"], "weight_decay": cfg.weight_decay},
                    {"params": by_kind["no_decay"], "weight_decay": 0.0}]
    return choice.load()([g for g in param_groups if g["params"]], **kwargs)


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
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    if hasattr(torch_optimizer, "train") and hasattr(torch_optimizer, "eval"):
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


@contextlib.contextmanager
def evaluation_weights(optimizer) -> Iterator[None]:
    """While inside: the parameters hold the weights a schedule-free optimizer defines for evaluation and export
    (its average ``x``, its ``eval()``); afterwards its train mode again if it was in it. Other optimizers' weights
    are the parameters themselves."""
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    switch = hasattr(torch_optimizer, "eval") and any(g.get("train_mode") for g in torch_optimizer.param_groups)
    if switch:
        torch_optimizer.eval()
    try:
        yield
    finally:
        if switch:
            torch_optimizer.train()


def _whole_matrix_muon() -> type:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.optim import _muon
    from torch.optim.adamw import adamw

    class WholeMatrixMuon(torch.optim.Muon):
        """torch's Muon for the groups marked ``use_muon`` (the hidden 2-D matrices) and AdamW for the others, in one
        optimizer (one state to checkpoint and verify). On FSDP2's sharded matrices (DTensors) Newton-Schulz runs on
        the gathered momentum, and each rank keeps its own rows of the result: the update one process makes.
        ``betas`` and ``eps`` are the AdamW groups'; ``ns_eps`` is Muon's own ``eps`` (its Newton-Schulz floor)."""

        def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                     nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                     ns_steps: int = 5, adjust_lr_fn: str | None = None, betas: tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, ns_eps: float = 1e-7):
            params = list(params)
            super().__init__([g for g in params if g.get("use_muon")] or [{"params": [], "use_muon": True}], lr=lr,
                             weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                             ns_coefficients=ns_coefficients, eps=ns_eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
            for group in params:
                if not group.get("use_muon"):  # Muon's constructor checks only its own groups for 2-D
                    self.add_param_group({**group, "use_muon": False, "betas": betas, "eps": eps})

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                (self._muon_step if group["use_muon"] else self._adamw_step)(group)
            return loss

        def _muon_step(self, group) -> None:
            """torch.optim._muon._single_tensor_muon, Newton-Schulz on the whole matrix."""
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = _muon._to_scalar(group["lr"]), group["momentum"]
            ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                if isinstance(update, DTensor):
                    whole = _muon._zeropower_via_newtonschulz(update.full_tensor(), *ns)
                    # every rank holds the same whole result: each keeps its own part, without communication
                    update = distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
                else:
                    update = _muon._zeropower_via_newtonschulz(update, *ns)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape))

        def _adamw_step(self, group) -> None:
            """torch's AdamW (its single-tensor path) on the embeddings, the head, norms and biases."""
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                  [], [s["step"] for s in states], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    return WholeMatrixMuon


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


def _sharded_adamw_8bit() -> type:
    import torch
    from bitsandbytes.optim import AdamW8bit
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from hfsdp.parallel.world import local_tensor

    class ShardedAdamW8bit(AdamW8bit):
        """bitsandbytes' ``AdamW8bit``, its own state layout and kernels, on FSDP2's sharded parameters (DTensors)
        with one process's update. Whether a parameter's moments are 8-bit is decided by the whole parameter's size
        (bitsandbytes' ``min_8bit_size``), as on one process. Moments in 32 bits are elementwise: each rank updates
        its shard. 8-bit moments are quantized in blocks of 256 elements of the flattened parameter; FSDP2 shards on
        dim 0, so a rank's shard is a contiguous range of it: where that range starts and ends on block boundaries
        (:func:`blocks_follow_shards`), the rank quantizes its own blocks (its moments and their block scales are
        sharded as the parameter is). Elsewhere every rank runs the kernels on the gathered parameter and gradient,
        with the whole (replicated) moments, and keeps its own rows of the result, as :class:`WholeMatrixMuon`
        does. On plain tensors (one process, DDP) it is ``AdamW8bit`` itself."""

        def init_state(self, group, p, gindex, pindex):
            super().init_state(group, p, gindex, pindex)  # the 8-bit choice by p.numel(): a DTensor's is the whole's
            state = self.state[p]
            if not isinstance(p, DTensor) or state["state1"].dtype != torch.uint8:
                return  # 32-bit moments: zeros_like(p), sharded as p is
            mesh, placements = p.device_mesh, p.placements
            shards = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard())
            if all(pl.is_replicate() or pl.is_shard(0) for pl in placements) and blocks_follow_shards(p.shape, shards):
                local = local_tensor(p).numel()
                for key in ("absmax1", "absmax2"):
                    state[key] = DTensor.from_local(
                        torch.zeros(-(-local // BNB_BLOCK), dtype=torch.float32, device=p.device), mesh, placements,
                        run_check=False, shape=state[key].shape, stride=(1,))
            else:
                whole = [Replicate()] * mesh.ndim
                for key in ("state1", "state2", "absmax1", "absmax2"):
                    shape = p.shape if key.startswith("state") else state[key].shape
                    dtype = state[key].dtype
                    state[key] = DTensor.from_local(torch.zeros(shape, dtype=dtype, device=p.device), mesh, whole,
                                                    run_check=False)

        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            if not isinstance(p, DTensor):
                return super().update_step(group, p, gindex, pindex)
            state = self.state[p]
            gathered = (state["state1"].placements != p.placements
                        and all(pl.is_replicate() for pl in state["state1"].placements))
            shard = p.to_local()
            # bitsandbytes' own update_step on plain tensors: this rank's shard, or the gathered parameter
            param = (p.full_tensor() if gathered else shard).detach()
            param.grad = (p.grad.full_tensor() if gathered else p.grad.to_local())
            self.state[param] = {key: local_tensor(v) if torch.is_tensor(v) else v for key, v in state.items()}
            try:
                super().update_step(group, param, gindex, pindex)
            finally:
                state["step"] = self.state.pop(param)["step"]
            if gathered:
                # every rank holds the same whole result: each keeps its own part, without communication
                param = distribute_tensor(param, p.device_mesh, p.placements, src_data_rank=None).to_local()
            if param.data_ptr() != shard.data_ptr():
                shard.copy_(param)

    return ShardedAdamW8bit


def _sharded_adafactor() -> type:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.optim._adafactor import adafactor

    class ShardedAdafactor(torch.optim.Adafactor):
        """torch's Adafactor; on FSDP2's sharded parameters (DTensors) it runs on the gathered parameter and gradient
        (its update needs each matrix's column means and the whole parameter's and update's norms), so the update
        is one process's, and each rank keeps its own rows of the result, as :class:`WholeMatrixMuon` does. The
        state stays sharded where it follows the parameter's rows: a matrix's row factor (rows x 1) and a vector's
        second moment are sharded as the parameter is and gathered for the step (a rows-sized all-gather); the
        column factor (1 x columns), the same on every rank, is kept whole on each."""

        def _init_group(self, group, *lists):
            for p in group["params"]:
                if p.grad is not None and isinstance(p, DTensor) and not self.state.get(p):
                    self.state[p] = self._sharded_state(p)
            return super()._init_group(group, *lists)

        @staticmethod
        def _sharded_state(p) -> dict:
            """torch's initial state of ``p`` (zeros; step 0) as DTensors."""
            from torch.optim.optimizer import _get_scalar_dtype

            state = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype())}
            local = p.to_local()
            if p.dim() > 1:
                rows = [*p.shape[:-1], 1]
                state["row_var"] = DTensor.from_local(local.new_zeros([*local.shape[:-1], 1]), p.device_mesh,
                                                      p.placements, run_check=False, shape=torch.Size(rows),
                                                      stride=torch.empty(rows, device="meta").stride())
                state["col_var"] = DTensor.from_local(local.new_zeros([*p.shape[:-2], 1, p.shape[-1]]),
                                                      p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                                      run_check=False)
            else:
                state["variance"] = torch.zeros_like(p)
            return state

        @torch.no_grad()
        def step(self, closure=None):
            """torch's Adafactor.step, the sharded tensors gathered before torch's update and their own part kept
            after it."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                params, grads, row_vars, col_vars, variances, steps = [], [], [], [], [], []
                has_complex = self._init_group(group, params, grads, row_vars, col_vars, variances, steps)
                back = []  # (sharded tensor, its gathered copy that the update changes)
                for i, p in enumerate(params):
                    if not isinstance(p, DTensor):
                        continue
                    params[i], grads[i] = p.full_tensor(), grads[i].full_tensor()
                    back.append((p, params[i]))
                    for tensors in (row_vars, variances):
                        if tensors[i] is not None:
                            back.append((tensors[i], tensors[i].full_tensor()))
                            tensors[i] = back[-1][1]
                    if col_vars[i] is not None:
                        col_vars[i] = col_vars[i].to_local()  # whole on every rank
                eps1, eps2 = group["eps"]
                adafactor(params, grads, row_vars, col_vars, variances, steps, d=group["d"], lr=group["lr"],
                          beta2_decay=group["beta2_decay"], weight_decay=group["weight_decay"], eps1=eps1,
                          eps2=eps2, foreach=group["foreach"], maximize=group["maximize"],
                          grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                          has_complex=has_complex)
                for sharded, whole in back:
                    # every rank holds the same whole result: each keeps its own part, without communication
                    sharded.to_local().copy_(distribute_tensor(whole, sharded.device_mesh, sharded.placements,
                                                               src_data_rank=None).to_local())
            return loss

    return ShardedAdafactor


def __getattr__(name: str):
    """``WholeMatrixMuon``, ``ShardedAdamW8bit`` and ``ShardedAdafactor`` are made on first use (they subclass
    torch's Muon, which torch before 2.9 lacks, bitsandbytes' AdamW8bit, an optional package, and torch's
    Adafactor)."""
    makers = {"WholeMatrixMuon": _whole_matrix_muon, "ShardedAdamW8bit": _sharded_adamw_8bit,
              "ShardedAdafactor": _sharded_adafactor}
    if name in makers:
        globals()[name] = makers[name]()
        return globals()[name]
    raise AttributeError(name)
