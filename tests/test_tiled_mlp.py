"""The tiled MLP (``train.tiled_mlp``, issue 73): each decoder layer's dense MLP over a micro-batch's positions a tile
at a time, each tile recomputed in the backward. The claims: the tiles give the untiled outputs and gradients while
keeping only their input for the backward (the tiny model's real MLP); the real CLI trains the untiled steps with
it (FSDP2 on 2 ranks with LoRA and activation checkpointing; one process and FSDP1 with --full-matrix); a mixture
of experts and compiled blocks are refused; and ``benchmarks/tiled_mlp.py`` (shrunk) measures a long row's peak
lower with it than without.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, tiny_config
from test_combinations import read_metrics


def _saved_bytes(fn) -> int:
    """The bytes of the tensors autograd keeps (each storage once) while ``fn()`` runs a forward, and its result."""
    import torch

    saved: dict[int, int] = {}

    def pack(t):
        base = t._base if t._base is not None else t
        saved[id(base)] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved.values()), out


def test_the_tiles_give_the_untiled_outputs_and_gradients_keeping_only_their_inputs(tiny_model_dir):
    """The tiny model's first MLP (SmolLM2's: gate, up, SiLU, down) on 2 rows of 300 positions in tiles of 64: the
    same outputs and gradients (of the input and of every weight) as untiled; what autograd keeps is its input, not
    the gate, up and activation outputs (4 times the width, 4 of them); eval forwards run it untiled."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfsdp.model.loading import layer_classes
    from hfsdp.config.schema import FSDPConfig
    from hfsdp.model.tiled_mlp import tile_mlps

    def mlp():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return model, model.model.layers[0].mlp

    x = torch.randn(2, 300, 64, generator=torch.Generator().manual_seed(0))
    results = []
    for tiled in (False, True):
        model, module = mlp()
        if tiled:
            assert tile_mlps(model, layer_classes(FSDPConfig(), model.config), 64) == 2  # both decoder layers
        leaf = x.clone().requires_grad_()
        kept, out = _saved_bytes(lambda: module(leaf))
        out.square().sum().backward()
        results.append((kept, out.detach(), leaf.grad, {n: p.grad for n, p in module.named_parameters()}))
        with torch.no_grad():  # eval forwards: untiled, the same values
            assert torch.equal(module(x), results[0][1])
    (untiled, out, grad, grads), (kept, tiled_out, tiled_grad, tiled_grads) = results
    assert torch.allclose(tiled_out, out, atol=1e-6) and torch.allclose(tiled_grad, grad, atol=1e-6)
    assert all(torch.allclose(tiled_grads[n], g, atol=1e-5) for n, g in grads.items())
    value = 2 * 300 * 4  # a float32 value a position
    assert untiled >= value * (64 + 4 * 256), untiled  # the input, and the intermediates of every position
    assert kept == value * 64, kept  # the input alone (the tiles are views of it)


# (world, sections): CI runs FSDP2 with LoRA on 2 ranks with activation checkpointing (the tiles' checkpoints inside
# each layer's), the rest with --full-matrix
CLI_CASES = {
    "lora-checkpointing-x2": (2, {"plugins": ["lora"], "fsdp": {"activation_checkpointing": True}}),
    "x1": (1, {}),
    "fsdp1-x2": (2, {"fsdp": {"version": 1}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [c if c == "lora-checkpointing-x2" else pytest.param(c, marks=pytest.mark.full_matrix)
                                  for c in CLI_CASES])
def test_the_cli_trains_the_untiled_steps_with_tiles(tmp_path, case):
    """Tiles of 32 positions (rows of up to 96) give the untiled losses and gradient norms within 1e-5."""
    from conftest import run_torchrun

    world, sections = CLI_CASES[case]
    metrics = {}
    for tiles in (None, 32):
        (tmp_path / f"tiles-{tiles}").mkdir()
        config = tiny_config(tmp_path / f"tiles-{tiles}", train={"max_steps": 3, "tiled_mlp": tiles}, **sections)
        proc = (run_cli if world == 1 else lambda *args: run_torchrun(world, *args))("train", str(config))
        said = "train.tiled_mlp 32: the MLPs of 2 layers in tiles of 32 positions, each recomputed in the backward"
        assert (said in proc.stdout) == (tiles is not None), proc.stdout[-2000:]
        metrics[tiles] = [m for m in read_metrics(tmp_path / f"tiles-{tiles}" / "run") if "loss" in m]
    assert len(metrics[None]) == len(metrics[32]) == 3
    for a, b in zip(metrics[None], metrics[32]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)


@pytest.mark.parametrize("sections, says", [
    ({"train": {"tiled_mlp": 64, "compile": True}, "fsdp": {"version": 2}},
     "compiled blocks with checkpointed MLP tiles inside are not tried yet"),
])
def test_what_the_tiled_mlp_cannot_combine_with_is_refused(tmp_path, sections, says):
    config = tiny_config(tmp_path, **sections)
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2 and "train.tiled_mlp" in proc.stderr and says in proc.stderr, proc.stderr[-2000:]


def test_a_mixture_of_experts_mlp_is_not_tiled():
    from conftest import tiny_moe_config
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.rules.wrapping import tiled_mlp_model_problems

    config = HfsdpConfig.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x"},
                                         "train": {"output_dir": "x", "max_steps": 1, "tiled_mlp": 64}})
    assert tiled_mlp_model_problems(config, tiny_moe_config("qwen3_moe")) == [
        ("train.tiled_mlp", "qwen3_moe is a mixture of experts, whose MLP (its router and experts) is not tiled: "
                            "remove train.tiled_mlp")]


@pytest.mark.slow
@pytest.mark.full_matrix
def test_a_long_row_peaks_lower_with_tiles(tmp_path):
    """``benchmarks/tiled_mlp.py`` shrunk (one row of 16,384 tokens, one process, the tiny model with an MLP of width
    2,048: its MLP's intermediates outweigh the loss's chunks, as a real model's do; on the tiny model's width 256
    the peak is the loss's and tiles change nothing, measured 1.016): the process's peak memory above the prepared
    model during the step is lower with tiles of 1,024 positions than without (measured 0.628), and the loss is the
    untiled one."""
    import subprocess
    import sys

    from conftest import REPO, _tiny_variant, base_env

    model = _tiny_variant("smollm2-tiny-wide-mlp-seed0", 0, intermediate_size=2048)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tiled_mlp.py"), "--out", str(tmp_path),
                           "--model", str(model), "--seq-len", "16384", "--tile", "1024"],
                          capture_output=True, text=True, env=base_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    plain, tiled = json.loads((tmp_path / "tiled_mlp.json").read_text())
    assert (plain["tile"], tiled["tile"], plain["tokens"], tiled["tokens"]) == (None, 1024, 16384, 16384)
    assert tiled["peak_above_start"] < plain["peak_above_start"], (plain, tiled)
    assert tiled["loss"] == pytest.approx(plain["loss"], rel=1e-5)
