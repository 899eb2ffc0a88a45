"""The workers engine of the online objectives (``generation.engine: workers``): generation processes beside the
trainer, each holding a copy of the policy, sample rounds ahead while the ranks train.

Versions and staleness. The policy of version ``v`` is the weights round ``v`` trains from (version 0: the start).
Round ``r`` is sampled by version ``max(0, r - max_staleness)``, exactly: when round ``r`` starts, the ranks publish
version ``r`` and ask for round ``r + max_staleness`` with it, then wait for round ``r`` (asked for ``max_staleness``
rounds earlier). What a round's completions are is therefore a function of the config alone, whatever the timing:
``max_staleness: 0`` samples each round with the weights it trains from, as the inline engine does.

The weight sync never goes through the disk: rank 0 holds the weights in shared memory (:class:`SharedWeights`): the
parameters that never change (the frozen base under LoRA) once, and the trainable ones in ``max_staleness + 1``
slots, version ``v`` in slot ``v % (max_staleness + 1)``. Publishing version ``v`` overwrites the slot of version
``v - max_staleness - 1``, which no round still to be sampled uses; so a generation process that dies is restarted
and samples its rounds again from the slots, the same tokens. A generation process points its model's parameters at
a slot's tensors before each round (no copy), samples with :func:`~hfsdp.builtin.online.sampling.sample` (each
completion by its own seeded generator: the same tokens whichever process samples it, and however many there are)
and scores each micro-batch's completions as the trainer lays them out
(:func:`~hfsdp.builtin.online.rounds.prompt_completion_batch`): the sampler's own per-token log-probs
(``sampler_logps``), equal to the trainer's where the weights and dtype are the same.

A checkpoint holds the rounds asked for and not yet trained on (:meth:`GenerationWorkers.ahead`, waited for at
the save): a resume trains on them as the uninterrupted run would, and needs no older weights.
"""

from __future__ import annotations

import multiprocessing
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch

START_TIMEOUT_S = 300.0
"""Seconds a generation process has to start: the interpreter, torch and transformers, the model on the meta
device."""


@dataclass
class Request:
    """One round of one generation process: its micro-batches (``slots``, each the prompts of its completions in
    order, with their seeds), sampled by policy ``version`` (slot ``version % slots``)."""

    round_: int
    version: int
    slots: dict[int, dict[str, list]]  # micro-batch k -> prompt_ids, seeds
    width: int


@dataclass
class Settings:
    """What a generation process needs besides the weights: the model's config, dtype and attention, LoRA's config
    (None: none), the sampling section, the ids that end a completion, the pad id, whether logits are kept at the
    completion's positions only, the truncated completions' rule, its thread count and whether it hides its
    libraries' warnings."""

    model_config: Any
    dtype: str
    attention: str
    peft_config: dict | None  # plain JSON values (:func:`peft_dict`)
    section: Any
    eos: list[int]
    pad_id: int
    select_logits: bool
    mask_truncated: bool
    threads: int
    quiet: bool  # the trainer hides its libraries' warnings (hfsdp.quiet): the process does too


@dataclass
class SharedWeights:
    """The policy's parameters in shared memory (see the module docstring): ``frozen`` (never published again) and
    ``slots`` of the trainable ones, by parameter name."""

    frozen: dict[str, torch.Tensor]
    slots: list[dict[str, torch.Tensor]]


def peft_dict(config) -> dict:
    """LoRA's config as plain JSON values, as peft writes ``adapter_config.json`` (its enums as their strings, sets as
    lists): unpickling peft's own objects would import peft (and bitsandbytes, which speaks on import) before the
    generation process hides its libraries' warnings."""
    import json

    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


class GenerationError(Exception):
    """A generation process that did not start, or did not answer in time: the run stops with this message."""


def trained_parameters(unwrapped) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of each of the model's parameters once (a tied one under its first name), named as the
    model without its FSDP and checkpoint wrappers names them."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return [(clean_tensor_name(name), param) for name, param in unwrapped.named_parameters()]


class _Process:
    """One generation process, with the requests it has not answered yet, in order."""

    def __init__(self, index: int, settings: Settings, weights: SharedWeights):
        context = multiprocessing.get_context("spawn")
        self.index = index
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, settings, weights), daemon=True,
                                       name=f"hfsdp-generation-{index}")
        self.process.start()
        child.close()
        self.ready = False
        self.pending: list[Request] = []
        self.since = time.monotonic()  # when it started, or began its oldest pending request's wait

    def send(self, request: Request) -> None:
        if not self.pending:
            self.since = time.monotonic()
        self.pending.append(request)
        try:
            self.conn.send(request)
        except OSError:  # it died: found by its sentinel, and the request sent again to its replacement
            pass

    def stop(self) -> None:
        """Kill it (a frozen process too, which a request to stop would leave waiting)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


class GenerationWorkers:
    """The generation processes of one run (on rank 0) and the publishing of each version (on every rank: gathering
    the weights is collective). See the module docstring."""

    def __init__(self, section, rank: int, wait_timeout_s: float, objective: str):
        self.generation, self.rank = section.generation, rank
        self.settings: Settings | None = None  # set before the first publish
        self.wait_timeout_s, self.objective = wait_timeout_s, objective
        self.weights: SharedWeights | None = None
        self.processes: list[_Process] = []
        self.done: dict[int, dict[int, dict[str, list]]] = {}  # round -> micro-batch -> values
        self.parts: dict[int, int] = {}  # round -> parts still to come
        self.asked = -1  # the last round asked for
        self.published = -1
        self.floor = 0  # the first version this process published: no older one is in the slots
        self.held = [-1] * (self.staleness + 1)  # the version each slot holds
        self.restarts = 0
        self.stats: dict[str, float] = {}  # this round's, until taken (:meth:`take_stats`)

    @property
    def staleness(self) -> int:
        return self.generation.max_staleness

    def version_of(self, round_: int) -> int:
        """The policy version that samples round ``round_``: ``max(0, round_ - max_staleness)``; after a resume
        from a checkpoint without the rounds in flight (saved by another engine or staleness), the resumed version
        for those."""
        return max(0, round_ - self.staleness, self.floor)

    def take_stats(self) -> dict[str, float]:
        """The metrics of the round sampled since the last call (zeros if none): the seconds and bytes of the
        weight sync, the seconds the trainer waited for the round, its staleness and the processes restarted."""
        stats, self.stats = self.stats, {}
        return {"generation/sync_s": 0.0, "generation/sync_bytes": 0.0, "generation/wait_s": 0.0,
                "generation/staleness": 0.0, **stats, "generation/restarts": float(self.restarts)}

    # ---- every rank

    def publish(self, model, unwrapped, version: int, gather: bool) -> None:
        """Make the model's weights now version ``version`` of the policy (collective: every rank gathers them, rank 0
        copies them into shared memory)."""
        from torch.distributed.tensor import DTensor

        from hfsdp.run.generation import generating

        started = time.perf_counter()
        copied = 0
        if self.published < 0:
            self.floor = version
        first = self.published < 0
        with generating(model, gather):
            named = trained_parameters(unwrapped)
            if first and self.rank == 0:
                self.weights = self._allocate(named)
            slot = None if self.rank else self.weights.slots[version % len(self.weights.slots)]
            for name, param in named:
                if not (param.requires_grad or first):
                    continue
                value = param.full_tensor() if isinstance(param, DTensor) else param
                copied += value.numel() * self._sampling_dtype(value).itemsize
                if self.rank == 0:
                    target = slot[name] if name in slot else self.weights.frozen[name]
                    target.copy_(value.detach())
        self.published = version
        self.held[version % (self.staleness + 1)] = version
        self.stats = {"generation/sync_s": time.perf_counter() - started, "generation/sync_bytes": float(copied)}

    def _sampling_dtype(self, param) -> torch.dtype:
        """A parameter's dtype in the generation processes: ``generation.dtype`` for a floating-point one, if set."""
        return getattr(torch, self.generation.dtype) if self.generation.dtype and param.is_floating_point() \
            else param.dtype

    def _allocate(self, named) -> SharedWeights:
        """Shared-memory tensors for the parameters (``named``): the frozen ones once, the trainable ones in
        ``max_staleness + 1`` slots, in the sampling dtype."""
        def empty(param):
            return torch.empty(param.shape, dtype=self._sampling_dtype(param)).share_memory_()

        frozen = {name: empty(p) for name, p in named if not p.requires_grad}
        slots = [{name: empty(p) for name, p in named if p.requires_grad} for _ in range(self.staleness + 1)]
        return SharedWeights(frozen, slots)

    # ---- rank 0

    def start(self) -> None:
        """Start the generation processes (rank 0, after the first :meth:`publish`); they load while the ranks
        go on, and are killed when the trainer's interpreter exits (before multiprocessing's own exit handler,
        which would wait for a frozen one forever)."""
        self.processes = [_Process(i, self.settings, self.weights) for i in range(self.generation.processes)]
        weakref.finalize(self, GenerationWorkers._stop_all, self.processes)

    def ask(self, round_: int, slots: dict[int, dict[str, list]], width: int) -> None:
        """Ask for round ``round_`` (its micro-batches ``slots``), sampled by its version (published already)."""
        keys = sorted(slots)
        share = -(-len(keys) // len(self.processes))
        parts = [keys[i:i + share] for i in range(0, len(keys), share)]
        version = self.version_of(round_)
        if self.held[version % len(self.held)] != version:  # an invariant of the schedule (module docstring)
            raise RuntimeError(f"round {round_} needs version {version}, but its slot holds version "
                               f"{self.held[version % len(self.held)]}")
        self.done[round_], self.parts[round_] = {}, len(parts)
        for process, part in zip(self.processes, parts):
            process.send(Request(round_, version, {k: slots[k] for k in part}, width))
        self.asked = round_

    def take(self, round_: int) -> dict[int, dict[str, list]]:
        """Round ``round_``'s values per micro-batch, once every part has come (restarting a process that died; a
        :class:`GenerationError` past the wait timeout)."""
        started = time.perf_counter()
        while self.parts.get(round_, 0):
            self._receive()
        self.parts.pop(round_, None)
        self.stats["generation/wait_s"] = time.perf_counter() - started
        self.stats["generation/staleness"] = float(round_ - self.version_of(round_))  # versions behind its own
        return self.done.pop(round_)

    def ahead(self) -> dict[int, dict[int, dict[str, list]]]:
        """Every round asked for and not taken yet, waited for (what a checkpoint keeps)."""
        for round_ in sorted(self.parts):
            while self.parts[round_]:
                self._receive()
        return {r: values for r, values in self.done.items()}

    def restore(self, ahead: dict[int, dict[int, dict[str, list]]]) -> None:
        """The rounds a checkpoint kept (:meth:`ahead`), to be taken as if asked for."""
        for round_, values in ahead.items():
            self.done[int(round_)], self.parts[int(round_)] = values, 0
        self.asked = max(map(int, ahead), default=self.asked)

    def _receive(self) -> None:
        """Wait for one message from any generation process and handle it."""
        busy = [p for p in self.processes if p.pending or not p.ready]
        waitables = {p.conn: p for p in busy} | {p.process.sentinel: p for p in busy}
        deadline = min(p.since for p in busy) + (START_TIMEOUT_S if any(not p.ready for p in busy) else 0) \
            + self.wait_timeout_s
        ready = wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = min(busy, key=lambda p: p.since)
            what = (f"round {late.pending[0].round_}" if late.pending else "its start")
            self._stop_all(self.processes)
            raise GenerationError(
                f"{self.objective}.generation: generation process {late.index} (pid {late.process.pid}) did not "
                f"answer within {self.wait_timeout_s:g} s ({what}): it is stopped and the run ends here, the last "
                f"checkpoint intact; if sampling a round legitimately takes this long, raise "
                f"train.collective_timeout_s (the wait is half of it)")
        for item in ready:
            process = waitables[item]
            try:
                message = process.conn.recv() if item is process.conn else None
            except (EOFError, OSError):
                message = None
            if message is None:
                self._restart(process)
                return
            self._handle(process, message)

    def _handle(self, process: _Process, message: tuple) -> None:
        kind, *rest = message
        if kind == "ready":
            process.ready, process.since = True, time.monotonic()
        elif kind == "round":
            round_, values = rest
            request = process.pending.pop(0)
            assert request.round_ == round_, (request.round_, round_)
            self.done[round_].update(values)
            self.parts[round_] -= 1
            process.since = time.monotonic()
        else:  # "failed": the process could not build its model or sample
            raise GenerationError(f"{self.objective}.generation: generation process {process.index}: {rest[0]}")

    def _restart(self, process: _Process) -> None:
        """Replace a generation process that died, and ask its replacement for the rounds it had not answered (the
        same tokens: their versions are still in the slots)."""
        process.process.join(timeout=5)  # its end seen on the pipe may come before the kernel reaps it
        process.stop()  # (killed if it lives on without its pipe)
        code = process.process.exitcode
        pending = process.pending
        if not process.ready:
            raise GenerationError(f"{self.objective}.generation: generation process {process.index} ended while "
                                  f"starting (exit code {code}); its output above says why")
        self.restarts += 1
        replacement = _Process(process.index, self.settings, self.weights)
        self.processes[process.index] = replacement
        print(f"{self.objective}.generation: generation process {process.index} ended (exit code {code}); "
              f"restarted, sampling round(s) {', '.join(str(r.round_) for r in pending) or 'none'} again",
              flush=True)
        for request in pending:
            replacement.send(request)

    @staticmethod
    def _stop_all(processes: list[_Process]) -> None:
        for process in processes:
            process.stop()


def _serve(conn, settings: Settings, weights: SharedWeights) -> None:
    """A generation process: build the model on the meta device, point its parameters at the shared weights, then
    answer each :class:`Request` (``None`` or the trainer's end: stop)."""
    import ctypes
    import signal
    import traceback

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer
    torch.set_num_threads(settings.threads)
    if settings.quiet:
        from hfsdp.quiet import hide_library_warnings

        hide_library_warnings()
    try:
        model, trainable = _model(settings, weights)
    except Exception:  # noqa: BLE001 (reported to the trainer, which stops the run with it)
        conn.send(("failed", f"could not build the model: {traceback.format_exc(limit=4)}"))
        return
    conn.send(("ready",))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        slot = weights.slots[request.version % len(weights.slots)]
        for name, param in trainable.items():
            param.data = slot[name]
        conn.send(("round", request.round_, _sample_round(model, settings, request)))


def _model(settings: Settings, weights: SharedWeights):
    """The policy's module with its parameters the shared tensors (the trainable ones pointed at a slot per round),
    in eval mode; and its trainable parameters by name."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    if settings.attention.startswith("hfsdp"):
        from hfsdp.model.packed_attention import register

        register()
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(settings.model_config, dtype=getattr(torch, settings.dtype),
                                                 attn_implementation=settings.attention)
    model.tie_weights()
    if settings.peft_config is not None:
        from peft import get_peft_config, get_peft_model

        model = get_peft_model(model, get_peft_config(settings.peft_config))
    named = trained_parameters(model)
    wanted = {**weights.frozen, **weights.slots[0]}
    if set(dict(named)) != set(wanted):
        missing, extra = sorted(set(wanted) - set(dict(named))), sorted(set(dict(named)) - set(wanted))
        raise RuntimeError(f"the sampling model's parameters differ from the trainer's: {missing[:3]} not in it, "
                           f"{extra[:3]} not sent")
    replaced = {id(param): torch.nn.Parameter(wanted[name], requires_grad=False) for name, param in named}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[attr] = replaced[id(param)]
    by_name = {name: replaced[id(param)] for name, param in named}
    model.eval()
    return model, {name: by_name[name] for name in weights.slots[0]}


@torch.no_grad()
def _sample_round(model, settings: Settings, request: Request) -> dict[int, dict[str, list]]:
    """The request's completions (all its micro-batches sampled together) and each micro-batch's sampler log-probs,
    laid out as the trainer lays out that micro-batch."""
    from hfsdp import IGNORE_INDEX
    from hfsdp.builtin.online.rounds import labelled_of, per_row, prompt_completion_batch, token_logps
    from hfsdp.builtin.online.sampling import sample

    keys = sorted(request.slots)
    prompts = [p for k in keys for p in request.slots[k]["prompt_ids"]]
    seeds = [s for k in keys for s in request.slots[k]["seeds"]]
    completions = sample(model, model, prompts, seeds, settings.pad_id, request.width, settings.section,
                         settings.eos, gather=False, synced=False)
    out, start = {}, 0
    for k in keys:
        n = len(request.slots[k]["prompt_ids"])
        mine = completions[start:start + n]
        start += n
        labelled = labelled_of(mine, {*settings.eos, settings.pad_id}) if settings.mask_truncated else None
        batch = prompt_completion_batch(request.slots[k]["prompt_ids"], mine, settings.pad_id, "cpu",
                                        settings.select_logits, labelled)
        mask = batch.sequence_targets != IGNORE_INDEX
        out[k] = {"completion_ids": mine,
                  "sampler_logps": per_row(token_logps(model, batch, settings.section.temperature)[0], mask)}
    return out
