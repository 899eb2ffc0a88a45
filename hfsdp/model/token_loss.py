"""The training loss: the summed next-token cross entropy of a micro-batch's labelled positions, two ways.

* :func:`token_loss_sum` (``train.chunked_loss: false``): the model returns the logits of every kept position, and
  the cross entropy runs over them in float32. The whole logits tensor, its float32 copy, the saved log-softmax and,
  in backward, the logits' gradient each exist at once: for a 128k-token vocabulary that is 0.5 MiB per position
  and tensor, often the largest allocation of a step.
* :class:`ChunkedLoss` (``train.chunked_loss: true``, the default where it is exact): the model's output head
  (``get_output_embeddings()``: the ``lm_head``, a LoRA-wrapped one, or the tied embedding) computes the loss
  itself, inside the model's forward, so FSDP's gathered (unsharded) head is the one used. It takes the hidden
  states of the labelled positions only and runs the projection and the cross entropy over chunks of
  ``chunk_tokens`` positions. With autograd on, each chunk's gradients with respect to the hidden states and the
  head's trainable parameters are computed right there, in the forward (as Liger's fused linear cross entropy
  does), and only they are kept: backward scales them by the loss's gradient, with no second head projection. At
  most one chunk's logits, their float32 copy and gradient exist at once; the head's gradient exists from the end
  of the forward, where the backward that follows would make it anyway. Where the head's weight is the input
  embedding's (tied embeddings), the embedding's backward adds its rows into that gradient (:class:`_TiedLookup`)
  instead of making its own dense, head-sized one that autograd then adds to it: one gradient of the shared weight
  instead of two (SmolLM2-135M: 113 MB less a step, and the time to zero and add it).

Both compute the same sum over the same positions (up to float32 summation order), so the global-batch
normalisation in ``hfsdp.run.loop`` and everything that depends on it stay as they are. The chunked loss is used only
where the model's logits are exactly its head's output (no soft-capping or scaling after the head):
:func:`check_chunked_loss` proves it on the prepared model before training, and the run falls back to
:func:`token_loss_sum`, saying why, where it is not.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX


# Logit elements per chunk: 2**25 float32 values are 128 MiB (261 positions of a 128,256-token vocabulary, 682 of
# SmolLM2's 49,152): a few such tensors at a time instead of the micro-batch's whole logits, and chunks large enough
# that the per-chunk matmul stays efficient and the Python loop short.
LOSS_CHUNK_ELEMENTS = 2**25


def token_loss_sum(model, batch) -> torch.Tensor:
    """Summed next-token cross entropy of a micro-batch (over its ``num_targets`` labelled positions), from the
    logits the model returns (``train.chunked_loss: false``)."""
    logits = model(**batch.inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch.targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunks(hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
    for start in range(0, max(hidden.size(0), 1), chunk_tokens):  # an empty micro-batch: one empty chunk
        yield hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]


class _TiedGradient:
    """Where the loss's backward leaves the tied weight's gradient (the head's part) for the input embedding's
    backward, which runs later in the same backward, to add its own rows to."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: torch.Tensor | None = None


class _TiedLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward adds the gradient's rows into the head's gradient
    of the same weight (left in ``tied``), and returns that as the weight's gradient: the only one, since the loss
    returns none for it. The same sum as the embedding's own dense gradient added to the head's; ``index_put_``
    with ``accumulate`` is deterministic on GPUs too. Without the head's part (a forward whose loss did not use the
    head) the rows go into zeros, as the embedding's own backward does."""

    @staticmethod
    def forward(ctx, ids, tied, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.tied, ctx.shape, ctx.padding_idx = tied, weight.shape, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        grad, ctx.tied.grad = ctx.tied.grad, None
        if grad is None:
            grad = grad_out.new_zeros(ctx.shape)
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.size(-1))
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            kept = ids != ctx.padding_idx
            ids, rows = ids[kept], rows[kept]
        return None, None, grad.index_put_((ids,), rows.to(grad.dtype), accumulate=True), None


class _GradientsInForward(torch.autograd.Function):
    """The summed loss of :func:`chunked_cross_entropy`, its gradients with respect to ``hidden`` and ``params``
    computed in the forward, one chunk at a time; backward returns them times the loss's gradient (the tied
    weight's, ``tied_index`` of ``params``: left in ``tied`` for :class:`_TiedLookup`)."""

    @staticmethod
    def forward(ctx, head, targets, chunk_tokens, tied, tied_index, hidden, *params):
        total, grad_hidden, grad_params = None, [], [None] * len(params)
        wanted = [hidden.requires_grad, *(p.requires_grad for p in params)]
        for h, t in _chunks(hidden, targets, chunk_tokens):
            with torch.enable_grad():
                h = h.detach().requires_grad_(hidden.requires_grad)
                part = _chunk_loss(head, h, t)
                inputs = [x for x, want in zip((h, *params), wanted) if want]
                grads = iter(torch.autograd.grad(part, inputs, allow_unused=True))
            if hidden.requires_grad:
                grad_hidden.append(next(grads))
            for i, p in enumerate(params):
                if p.requires_grad:
                    g = next(grads)
                    if g is not None:
                        grad_params[i] = g.detach() if grad_params[i] is None else grad_params[i].add_(g)
            part = part.detach()
            total = part if total is None else total + part
        ctx.grads = (torch.cat(grad_hidden) if grad_hidden else None, *grad_params)
        ctx.tied, ctx.tied_index = tied, tied_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # scaled in place: no second head-sized gradient. Not views (detached in forward): autograd adds a second
        # gradient of the same weight in place only into a tensor that is not a view.
        grads, ctx.grads = [None if g is None else g.mul_(grad_total) for g in ctx.grads], None
        if ctx.tied is not None:
            ctx.tied.grad, grads[1 + ctx.tied_index] = grads[1 + ctx.tied_index], None
        return (None, None, None, None, None, *grads)


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          targets: torch.Tensor, chunk_tokens: int,
                          params: tuple[torch.Tensor, ...] = (),
                          tied: tuple[_TiedGradient, int] | None = None) -> torch.Tensor:
    """``sum(cross_entropy(head(hidden).float(), targets))`` over ``hidden`` (positions x width) in chunks of
    ``chunk_tokens`` positions. With autograd on (``hidden`` or one of the head's ``params`` requiring a gradient),
    the gradients are computed chunk by chunk in the forward and only they are kept (:class:`_GradientsInForward`);
    ``params`` must be every tensor the head reads that a gradient reaches. ``tied``: the input embedding's
    :class:`_TiedLookup` of this forward takes the gradient of ``params[index]``."""
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        slot, index = tied if tied is not None else (None, None)
        return _GradientsInForward.apply(head, targets, chunk_tokens, slot, index, hidden, *params)
    total = None
    for h, t in _chunks(hidden, targets, chunk_tokens):
        part = _chunk_loss(head, h, t)
        total = part if total is None else total + part
    return total


def output_head(model) -> torch.nn.Module | None:
    """The module that turns the final hidden states into logits (a LoRA model: its base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    getter = getattr(base, "get_output_embeddings", None)
    return getter() if getter is not None else None


def tied_input_embedding(model) -> torch.nn.Embedding | None:
    """The input embedding whose weight the output head reads (tied embeddings), where :class:`ChunkedLoss` adds
    its gradient into the head's: a plain ``nn.Embedding`` (``max_norm`` and ``scale_grad_by_freq`` change what its
    backward does, ``sparse`` what it returns; a subclass may scale its output)."""
    head = output_head(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = base.get_input_embeddings()
    if head is None or type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None \
            or embedding.scale_grad_by_freq or embedding.sparse:
        return None
    return embedding if any(p is embedding.weight for p in head.parameters()) else None


class ChunkedLoss:
    """Installs itself as the forward of the model's output head (before the model is wrapped); then
    ``loss(model, batch)`` is the micro-batch's summed token loss, computed chunk by chunk inside the model's forward.
    Outside a loss call (generation, the packing probe) the head computes logits as before."""

    def __init__(self, model, vocab_size: int):
        head = output_head(model)
        if head is None:
            raise ValueError("the model has no output head (get_output_embeddings() is None)")
        self.head = head
        # where each of the head's parameters lives (module path, attribute): read at each forward, since FSDP puts
        # the gathered tensors there (FSDP2 unsharded parameters, FSDP1 views of its flat parameter)
        self._params = [(name.rpartition(".")[0], name.rpartition(".")[2]) for name, _ in head.named_parameters()]
        self.chunk_tokens = max(1, LOSS_CHUNK_ELEMENTS // vocab_size)
        self._original = head.forward  # the bound forward of the head's class (LoRA: base layer + adapter)
        self._batch = None
        self.calls = 0  # loss computations done by the head (a test sees that chunking really ran)
        self._capture: list[torch.Tensor] | None = None
        head.forward = self._forward
        self.embedding = tied_input_embedding(model)
        self._tied: _TiedGradient | None = None
        self._tied_index: int | None = None  # which of the head's parameters is the embedding's weight
        if self.embedding is not None:
            self._tied_index = next(i for i, p in enumerate(head.parameters()) if p is self.embedding.weight)
            self.embedding.forward = self._lookup

    def uninstall(self) -> None:
        """The head's own forward back (the run uses the plain loss), and the input embedding's."""
        del self.head.forward
        if self.embedding is not None:
            del self.embedding.forward

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The tied input embedding's forward: in a loss call with autograd on, :class:`_TiedLookup` (its
        gradient and the head's one tensor), else the embedding's own."""
        weight = self.embedding.weight  # read at each forward: FSDP puts the gathered tensor there
        if self._batch is None or not (torch.is_grad_enabled() and weight.requires_grad):
            return F.embedding(ids, weight, self.embedding.padding_idx)
        self._tied = _TiedGradient()
        return _TiedLookup.apply(ids, self._tied, weight, self.embedding.padding_idx)

    def _forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch, self._batch = self._batch, None
        if batch is None:
            out = self._original(hidden, *args, **kwargs)
            if self._capture is not None:
                self._capture.append(out)
            return out
        self.calls += 1
        flat = hidden.reshape(-1, hidden.size(-1)).index_select(0, batch.label_positions)
        targets = batch.targets.reshape(-1).index_select(0, batch.label_positions)
        params = tuple(getattr(self.head.get_submodule(path), name) for path, name in self._params)
        tied, self._tied = self._tied, None
        # handed over only where the two still share the tensor (FSDP puts the gathered one in both modules) and
        # the lookup's backward will run (it does only with a gradient to the hidden states)
        handed = tied is not None and flat.requires_grad and params[self._tied_index] is self.embedding.weight
        return chunked_cross_entropy(self._original, flat, targets, self.chunk_tokens, params,
                                     (tied, self._tied_index) if handed else None)

    def __call__(self, model, batch) -> torch.Tensor:
        """The summed token loss: the model's forward returns it in place of the logits (so that FSDP's hooks on
        the forward's outputs see it, as they would see the logits)."""
        self._batch = batch
        try:
            loss = model(**batch.inputs).logits
        finally:
            called, self._batch, self._tied = self._batch is None, None, None
        if not called or loss.dim() != 0:
            raise RuntimeError("the chunked loss was not computed by the model's output head")
        return loss

    @contextlib.contextmanager
    def capturing(self):
        """The head's outputs of the forwards inside, in order (for :func:`check_chunked_loss`)."""
        self._capture = []
        try:
            yield self._capture
        finally:
            self._capture = None


@torch.no_grad()
def check_chunked_loss(model, loss: ChunkedLoss, vocab_size: int, device, select_logits: bool) -> str | None:
    """None if the chunked loss is exact for this (prepared) model, else why not. Exact means: the logits the model
    returns are exactly its head's output (no soft-capping, scaling or other step after the head), and the chunked
    loss of a probe micro-batch (several chunks, masked labels) equals the loss from those logits. Every rank runs
    the same forwards (FSDP collectives)."""
    from hfsdp.data.batches import micro_batch, reshard

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (9, 6)]
    rows = [{"input_ids": ids[0], "labels": [IGNORE_INDEX] * 3 + ids[0][3:]},
            {"input_ids": ids[1], "labels": ids[1][:2] + [IGNORE_INDEX] * 2 + ids[1][4:]}]
    batch = micro_batch(rows, pad_id=0, device=device, select_logits=select_logits)
    was_training, chunk_tokens = model.training, loss.chunk_tokens
    model.eval()
    try:
        with loss.capturing() as heads:
            logits = model(**batch.inputs).logits
        if len(heads) != 1 or not torch.equal(heads[0], logits):
            return ("the model's logits are not its output head's output (it changes them after the head, e.g. "
                    "soft-capping or scaling)")
        reference = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch.targets.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
        loss.chunk_tokens = 4  # the probe's 9 labelled positions in 3 chunks
        chunked = loss(model, batch)
    finally:
        loss.chunk_tokens = chunk_tokens
        model.train(was_training)
        reshard(model)
    if not torch.allclose(chunked.float(), reference, rtol=1e-4, atol=1e-6):
        return f"the chunked loss of a probe batch ({float(chunked):.6g}) differs from the model's ({float(reference):.6g})"
    return None


def run_loss(model, chunked: ChunkedLoss | None, accelerator, vocab_size: int):
    """``train.chunked_loss: true``: ``chunked`` (installed before the model was prepared) where
    :func:`check_chunked_loss` proves it exact on the prepared ``model``, else the plain loss, saying why."""
    from hfsdp.model.loading import accepts_logits_to_keep

    why = (check_chunked_loss(model, chunked, vocab_size, accelerator.device,
                              accepts_logits_to_keep(accelerator.unwrap_model(model)))
           if chunked else "the model has no output head module (get_output_embeddings)")
    if why is None:
        return chunked
    if chunked:
        chunked.uninstall()
    accelerator.print(f"train.chunked_loss: the plain loss instead ({why}); set train.chunked_loss: false to "
                      "silence this")
    return token_loss_sum
