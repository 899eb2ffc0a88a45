"""GPU-only checks (``pytest -m gpu``, run by scripts/gpu_check.sh and by scripts/gpu_kit.sh run): NCCL, FSDP1 and
FSDP2, bf16, fp16 with its grad scaler, CPU offload (``cuda:nccl,cpu:gloo``), FULL and SHARDED checkpoints, export,
deterministic training (CUBLAS_WORKSPACE_CONFIG), a short bench and `hfsdp plan` against
``torch.cuda.max_memory_allocated``, on one CUDA GPU. Skipped cleanly on machines without CUDA."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# One process runs without a wrapper unless an option needs FSDP (cpu_offload): single_process: fsdp keeps it here.
CASES = {
    "fsdp2_bf16_sharded": {"version": 2, "sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16",
                           "state_dict_type": "SHARDED_STATE_DICT", "single_process": "fsdp"},
    "fsdp2_offload": {"version": 2, "sharding_strategy": "FULL_SHARD", "cpu_offload": True,
                      "state_dict_type": "SHARDED_STATE_DICT"},
    "fsdp1_bf16_full": {"version": 1, "sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16",
                        "state_dict_type": "FULL_STATE_DICT", "single_process": "fsdp"},
    "unwrapped_bf16": {"version": 2, "sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16"},
    "fsdp1_offload_sharded": {"version": 1, "sharding_strategy": "FULL_SHARD", "cpu_offload": True,
                              "state_dict_type": "SHARDED_STATE_DICT"},
    # fp16: torch.amp.GradScaler (FSDP2), FSDP1's ShardedGradScaler
    "fsdp2_fp16_scaler": {"version": 2, "sharding_strategy": "FULL_SHARD", "mixed_precision": "fp16",
                          "state_dict_type": "SHARDED_STATE_DICT", "single_process": "fsdp"},
    "fsdp1_fp16_scaler": {"version": 1, "sharding_strategy": "FULL_SHARD", "mixed_precision": "fp16",
                          "state_dict_type": "SHARDED_STATE_DICT", "single_process": "fsdp"},
}


def assert_grad_scaler_ran(checkpoint, steps):
    """The checkpoint holds the fp16 loss scaler's state after every step updated it: the scale started at 2**16 and
    halved at each overflow (a non-finite gradient norm, whose step the scaler skipped), and the growth tracker
    counts the finite steps since the last overflow (2000 are needed to grow)."""
    states = [torch.load(f, weights_only=True) for f in sorted(checkpoint.glob("custom_checkpoint_*.pkl"))]
    scaler = [st for st in states if isinstance(st, dict) and {"scale", "_growth_tracker"} <= st.keys()]
    assert len(scaler) == 1, [sorted(st) if isinstance(st, dict) else type(st) for st in states]
    overflows = [not math.isfinite(float(r["grad_norm"])) for r in steps]  # metrics.jsonl writes inf as "inf"
    since_last = len(overflows) - (max(i for i, o in enumerate(overflows) if o) + 1) if any(overflows) else len(steps)
    assert scaler[0]["scale"] == 2.0**16 * 0.5 ** sum(overflows), (scaler[0], overflows)
    assert scaler[0]["_growth_tracker"] == since_last, (scaler[0], overflows)


@pytest.mark.parametrize("name", list(CASES))
def test_trains_on_nccl_and_checkpoint_exports_the_final_weights(tmp_path, name):
    from safetensors.torch import load_file

    config = tiny_config(tmp_path, fsdp=CASES[name], train={"max_steps": 4, "save_every": 4})
    proc = run_cli("train", str(config))
    run = tmp_path / "run"
    report = json.loads((run / "startup_rank0.json").read_text())
    unwrapped = name == "unwrapped_bf16"  # one process without a wrapper: no process group
    assert report["distributed_type"] == ("NO" if unwrapped else "FSDP") and "cuda" in report["device"], report
    # CPU offload and FULL_STATE_DICT gathers need gloo next to NCCL, requested from the YAML (not FSDP_* variables)
    cpu_collectives = CASES[name].get("cpu_offload") or CASES[name].get("state_dict_type") == "FULL_STATE_DICT"
    backend = None if unwrapped else "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    assert report["process_group_backend"] == backend, report
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"], proc.stdout
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert all(0 < r["mem_max_allocated_gib"] <= r["mem_max_reserved_gib"] for r in steps), steps
    if torch.cuda.get_device_name().startswith("NVIDIA H"):  # in the peak table: MFU per step and in the summary
        assert all(0 < r["mfu_pct"] < 100 for r in steps) and "MFU" in proc.stdout, steps
    if CASES[name].get("mixed_precision") == "fp16":
        assert report["mixed_precision"] == "fp16" and len(steps) == 4, (report, steps)
        assert_grad_scaler_ran(run / "checkpoints" / "step-4", steps)
    run_cli("export", str(run / "checkpoints" / "step-4"), str(tmp_path / "exported"))
    final, exported = load_file(str(run / "final" / "model.safetensors")), load_file(
        str(tmp_path / "exported" / "model.safetensors"))
    assert final.keys() == exported.keys()
    for key in final:
        torch.testing.assert_close(exported[key], final[key], atol=0, rtol=0, msg=key)


def test_short_bench_on_gpu(tmp_path):
    out = tmp_path / "bench"
    # single_process: fsdp, so FULL_SHARD is a one-rank FSDP; FSDP2 NO_SHARD (DDP) runs without a wrapper.
    run_cli("bench", "tiny", "--strategies", "FULL_SHARD,NO_SHARD", "--nproc", "1", "--steps", "2", "--out", str(out),
            "--set", "fsdp.single_process=fsdp")
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["strategy"], r["runs_as"]) for r in rows] == [("FULL_SHARD", "FSDP"), ("none (1 process)", "NO")]
    assert all(r["memory_kind"] == "cuda_allocated" and r["mem_peak_mib"] > 0 for r in rows), rows


@pytest.mark.parametrize("single_process", ["auto", "fsdp"])
def test_plan_predicts_the_peak_max_memory_allocated_measures(tmp_path, single_process):
    """`hfsdp plan`'s predicted peak per rank is within 10% of torch.cuda.max_memory_allocated during the steps of a
    short real run (bench_probe, through `hfsdp bench`) of the bench model (75.5M parameters, float32, so the
    state and not cuBLAS's workspace dominates) on one GPU: without a wrapper (the default) and as a one-rank FSDP."""
    sets = ["--set", f"fsdp.single_process={single_process}"]
    out = tmp_path / "bench"
    run_cli("bench", "--strategies", "FULL_SHARD", "--nproc", "1", "--steps", "3", "--out", str(out), *sets)
    measured = json.loads((out / "bench.json").read_text())["rows"][0]
    assert measured["memory_kind"] == "cuda_allocated", measured
    assert measured["runs_as"] == ("NO" if single_process == "auto" else "FSDP"), measured
    planned = json.loads(run_cli("plan", "bench", "--nproc", "1", "--strategies", "FULL_SHARD", "--json",
                                 *sets).stdout)["rows"][0]
    assert planned["runs_as"] == ("no wrapper" if single_process == "auto" else "FSDP"), planned
    ratio = planned["device_peak"] / (measured["mem_peak_mib"] * 2**20)
    assert 0.9 <= ratio <= 1.1, (ratio, planned, measured)


def test_deterministic_training_on_cuda_repeats_bit_for_bit(tmp_path):
    """train.deterministic on CUDA: the CLI sets CUBLAS_WORKSPACE_CONFIG (without it torch raises on the first cuBLAS
    matmul under use_deterministic_algorithms), and two runs give the same losses bit for bit."""
    from conftest import base_env, step_losses

    losses = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        config = tiny_config(folder, train={"max_steps": 3, "deterministic": True, "eval_at_start": False})
        env = {k: v for k, v in base_env().items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        run_cli("train", str(config), env=env)
        losses.append(step_losses(folder / "run"))
    assert len(losses[0]) == 3 and losses[0] == losses[1]


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2", "flex_attention"])
def test_chunked_loss_compile_and_attention_kernels_on_gpu(tmp_path, attn):
    """Issue 21 on a GPU: the chunked loss with Inductor-compiled blocks trains the plain-loss eager steps (bf16,
    one-rank FSDP2) under each attention kernel; the start-up probe keeps the chunked loss (no fallback line) and
    the compiled graphs stop growing after the warm-up."""
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    runs = {}
    for name, train in (("plain", {"chunked_loss": False}), ("chunked_compiled", {"compile": True})):
        folder = tmp_path / name
        folder.mkdir()
        config = tiny_config(folder, model={"attn_implementation": attn},
                             fsdp={"mixed_precision": "bf16", "single_process": "fsdp"},
                             train={"max_steps": 5, "eval_at_start": False, "export_final": False, **train})
        proc = run_cli("train", str(config))
        steps = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()
                 if '"loss"' in line]
        runs[name] = (proc, steps)
    (_, plain), (proc, fast) = runs["plain"], runs["chunked_compiled"]
    assert "train.chunked_loss" not in proc.stdout and "transformer blocks compiled" in proc.stdout
    for a, b in zip(plain, fast):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), (a, b)
    graphs = [m["compile_graphs"] for m in fast]
    assert graphs[0] >= 1 and graphs[-1] == graphs[-2], graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_weights_one_gradient_on_gpu_is_the_plain_losss_and_repeats_bit_for_bit(tiny_model_dir, dtype):
    """Issue 56 on a GPU: under the chunked loss the tied embedding's backward adds its rows into the head's gradient
    with CUDA's ``index_put_(accumulate=True)``: the weight's ``.grad`` is that one tensor, equal to the plain
    loss's gradient, and two backward passes give it bit for bit under deterministic algorithms."""
    import copy

    from transformers import AutoModelForCausalLM

    from hfsdp.data import batches
    from hfsdp.model.token_loss import ChunkedLoss, token_loss_sum

    torch.use_deterministic_algorithms(True)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).cuda()
        generator = torch.Generator().manual_seed(0)
        rows = [{"input_ids": ids, "labels": [-100] * 4 + ids[4:]} for ids in
                (torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in (40, 33))]
        batch = batches.micro_batch(rows, pad_id=0, device="cuda", select_logits=True)
        plain = copy.deepcopy(model)
        token_loss_sum(plain, batch).backward()
        loss = ChunkedLoss(model, model.config.vocab_size)
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            value = loss(model, batch)
            head_gradient = value.grad_fn.grads[1].data_ptr()
            value.backward()
            weight = model.get_input_embeddings().weight
            assert weight.grad.data_ptr() == head_gradient
            grads.append(weight.grad.clone())
        assert torch.equal(grads[0], grads[1])
        expected = plain.get_input_embeddings().weight.grad
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((grads[0].float() - expected.float()).norm()) <= tolerance * float(expected.float().norm())
    finally:
        torch.use_deterministic_algorithms(False)


def test_qlora_bf16_storage_survives_sharding_on_gpu(tmp_path):
    """Issue 22 on a GPU: QLoRA (nf4, double quant) with bf16 mixed precision stores the packed 4-bit weights in
    bfloat16 (the default) and FSDP2 gathers them on CUDA, where bitsandbytes #1945 saw NaN bit patterns
    canonicalised: the start-up probe must pass (or refuse with its message, never train on changed weights), and
    uint8 storage (kept whole) trains the same losses."""
    runs = {}
    for storage in ("bfloat16", "uint8"):
        folder = tmp_path / storage
        folder.mkdir()
        config = tiny_config(folder, plugins=["lora"],
                             model={"quantization": {"bits": 4, "quant_storage": storage}},
                             fsdp={"mixed_precision": "bf16", "single_process": "fsdp"},
                             train={"max_steps": 4, "eval_at_start": False})
        proc = run_cli("train", str(config), check=False)
        assert proc.returncode == 0 or "did not survive sharding" in proc.stderr, proc.stderr[-3000:]
        runs[storage] = [json.loads(line)["loss"] for line in (folder / "run" / "metrics.jsonl").read_text()
                         .splitlines() if '"loss"' in line] if proc.returncode == 0 else None
    assert runs["uint8"], "uint8 storage must always train"
    if runs["bfloat16"] is not None:
        assert runs["bfloat16"] == pytest.approx(runs["uint8"], rel=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_on_two_gpus_trains_the_steps_of_one(tmp_path):
    """Issue 37 on GPUs: tp 2 on 2 GPUs (NCCL, bf16) trains the losses of one GPU on the same rows (bf16 sums of
    other orders apart) and exports the final weights its checkpoint holds."""
    from conftest import run_torchrun
    from safetensors.torch import load_file

    losses = {}
    for tp in (1, 2):
        folder = tmp_path / f"tp{tp}"
        folder.mkdir()
        config = tiny_config(folder, fsdp={"mixed_precision": "bf16", "single_process": "fsdp"},
                             parallel={"tp_size": tp}, train={"max_steps": 4, "save_every": 4})
        proc = run_torchrun(2, "train", str(config)) if tp == 2 else run_cli("train", str(config))
        losses[tp] = [json.loads(line)["loss"] for line in (folder / "run" / "metrics.jsonl").read_text()
                      .splitlines() if '"loss"' in line]
    report = json.loads((tmp_path / "tp2" / "run" / "startup_rank0.json").read_text())
    assert report["tp_size"] == 2 and report["process_group_backend"] == "nccl", (report, proc.stdout)
    assert losses[2] == pytest.approx(losses[1], rel=2e-3)
    run = tmp_path / "tp2" / "run"
    run_cli("export", str(run / "checkpoints" / "step-4"), str(tmp_path / "exported"))
    final, exported = load_file(str(run / "final" / "model.safetensors")), load_file(
        str(tmp_path / "exported" / "model.safetensors"))
    assert final.keys() == exported.keys() and all(torch.equal(exported[k], final[k]) for k in final)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_sequence_parallel_on_two_gpus_trains_the_steps_of_one(tmp_path):
    """Issue 54 on GPUs: sp 2 on 2 GPUs (NCCL's all-to-all, SDPA's CUDA kernels, bf16) on rows of 1,371 to 1,536
    tokens trains the losses and eval losses of one GPU on the same rows (bf16 sums of other orders apart), with
    packed rows too (each packed sequence attended on its own over the whole row)."""
    from conftest import run_torchrun
    from test_sequence_parallel import sections

    for variant in ("base", "packing"):
        losses = {}
        for sp in (1, 2):
            folder = tmp_path / f"{variant}-sp{sp}"
            folder.mkdir()
            config = tiny_config(folder, **sections(variant, sp, fsdp={"mixed_precision": "bf16"},
                                                    train={"output_dir": str(folder / "run")}))
            proc = run_torchrun(2, "train", str(config)) if sp == 2 else run_cli("train", str(config))
            losses[sp] = [(m.get("loss"), m.get("eval_loss")) for m in map(json.loads, (folder / "run" /
                          "metrics.jsonl").read_text().splitlines()) if "loss" in m or "eval_loss" in m]
        report = json.loads((tmp_path / f"{variant}-sp2" / "run" / "startup_rank0.json").read_text())
        assert report["sp_size"] == 2 and report["process_group_backend"] == "nccl", (report, proc.stdout)
        flat = [[x for pair in losses[sp] for x in pair if x is not None] for sp in (1, 2)]
        assert flat[1] == pytest.approx(flat[0], rel=2e-3), (variant, losses)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_hfsdp_eval_on_two_gpus_scores_what_one_gpu_does(tmp_path, tiny_model_dir):
    """Issue 55 on GPUs: `hfsdp eval` on 2 GPUs (the model sharded by FSDP2 over NCCL, lm-eval's request split)
    scores the bundled multiple-choice task as on one GPU."""
    import shutil

    from conftest import run_torchrun

    scores = {}
    for nproc in (1, 2):
        model = tmp_path / f"model-{nproc}"
        shutil.copytree(tiny_model_dir, model)
        args = ("eval", str(model), "--tasks", "contacts_mc", "--batch-size", "8")
        proc = run_cli(*args) if nproc == 1 else run_torchrun(nproc, *args)
        scores[nproc] = json.loads((model / "eval_results.json").read_text())["scores"]
    assert scores[2] == scores[1], (scores, proc.stdout)


def test_a_sweep_on_gpu_puts_the_plan_within_10_percent_of_max_memory_allocated(tmp_path):
    """`hfsdp bench --seq-lens --micro-batches` on one GPU (issue 56, part 3): the bench model on plain-text rows
    that fill every sequence (every position labelled, as the plan assumes), 512 to 4,096 tokens a micro-batch,
    as a one-rank FSDP: at every point the plan's peak is within 10 % of torch.cuda.max_memory_allocated."""
    data = tmp_path / "long.jsonl"
    words = "the of and to in is was for on that with as by at from his her it an are this which be or".split()
    data.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(4000))}) + "\n"
                            for i in range(32)))
    out = tmp_path / "sweep"
    run_cli("bench", "--strategies", "FULL_SHARD", "--nproc", "1", "--steps", "3", "--seq-lens", "512,2048",
            "--micro-batches", "1,2", "--out", str(out), "--set", "fsdp.single_process=fsdp",
            "--set", "data.format=text", "--set", f"data.path={data}")
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["memory_kind"] == "cuda_allocated" for r in rows), rows
    assert all(r["micro_batch_tokens"] == r["seq_len"] * r["micro_batch"] for r in rows), rows
    assert all(0.9 <= r["plan_vs_measured"] <= 1.1 for r in rows), [(r["seq_len"], r["micro_batch"],
                                                                      r["plan_vs_measured"]) for r in rows]


def test_the_ring_on_cuda_computes_sdpa_over_whole_rows_and_its_gradients():
    """Issue 73 on a GPU: the ring's blocks (float32 tiles of scores) on CUDA tensors, its passes through the threaded
    process group, give CUDA sdpa's attention and gradients over whole rows (9 heads over 3 KV heads, causal and
    packed), as tests/test_context_parallel.py checks on CPU."""
    from test_context_parallel import assert_ring_computes_sdpa

    assert_ring_computes_sdpa(2, "cuda")


def test_the_tiled_mlp_on_gpu_trains_the_untiled_steps(tmp_path):
    """Issue 73 on a GPU: tiles of 32 positions in bf16 under FSDP2 with activation checkpointing give the untiled
    losses (bf16 sums of other orders apart)."""
    losses = {}
    for tiles in (None, 32):
        folder = tmp_path / f"tiles-{tiles}"
        folder.mkdir()
        config = tiny_config(folder, train={"max_steps": 3, "tiled_mlp": tiles},
                             fsdp={"mixed_precision": "bf16", "single_process": "fsdp", "activation_checkpointing": True})
        run_cli("train", str(config))
        losses[tiles] = [json.loads(line)["loss"] for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()
                         if "loss" in json.loads(line)]
    assert len(losses[None]) == 3 and losses[32] == pytest.approx(losses[None], rel=2e-3), losses
