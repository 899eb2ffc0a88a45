"""The per-step throughput math (hfsdp/run/throughput.py): FLOPs, peak table, rates, memory, summary."""

from __future__ import annotations

import pytest
import torch

from hfsdp.run.throughput import (
    FlopsModel,
    StepMeter,
    compute_precision,
    format_throughput,
    medians,
    peak_flops,
    tokens_and_square_lengths,
    step_rates,
)


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), config


@pytest.mark.parametrize("tied", [False, True])
def test_flops_model_counts_every_matmul_weight_once(tied):
    model, config = _llama(tied)
    total = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    embedding = 100 * 16
    flops = FlopsModel.of(model, config)
    # untied: the embedding table is a lookup, the separate head a matmul; tied: the one table is the head's matmul
    assert flops.params == (total - embedding if not tied else total)
    assert flops.trainable == flops.params and flops.layers == 2 and flops.attention_width == 16


def test_frozen_weights_cost_forward_and_activation_gradients_only():
    model, config = _llama(tied=False)
    for name, p in model.named_parameters():
        p.requires_grad = "mlp" in name  # as if only the MLPs were trained
    flops = FlopsModel.of(model, config)
    mlp = sum(p.numel() for n, p in model.named_parameters() if "mlp" in n)
    assert flops.trainable == mlp < flops.params
    assert flops.step_flops(10, 0) == (4 * flops.params + 2 * mlp) * 10


def test_step_flops_is_6n_per_token_plus_the_causal_attention_term():
    flops = FlopsModel(params=1000, trainable=1000, layers=2, attention_width=8)
    # 3 rows of 4 tokens: 6 N per token, plus 6 * layers * width * length per token (gpu_mfu.sh's formula)
    assert flops.step_flops(tokens=12, sum_sq_lengths=3 * 16) == 6 * 1000 * 12 + 6 * 2 * 8 * 4 * 12


def test_tokens_and_square_lengths_of_micro_batches():
    from hfsdp.data import batches

    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    batches = [batches.micro_batch(rows, 0, "cpu"), batches.micro_batch([{"input_ids": [6] * 4, "labels": [6] * 4}], 0, "cpu")]
    assert tokens_and_square_lengths(batches) == (9, 9 + 4 + 16)


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989),
    ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA H100 NVL", "fp16", 835),
    ("NVIDIA H200", "bf16", 989),
    ("NVIDIA H200", "fp32", 67),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA A100 80GB PCIe", "bf16", 312),
    ("NVIDIA L40S", "bf16", 362),
    ("NVIDIA L4", "bf16", 121),
    ("NVIDIA A10", "fp32", 31.2),
    ("NVIDIA A10G", "bf16", None),  # not in the table: no MFU rather than a wrong one
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
    ("Tesla V100-SXM2-16GB", "fp16", 125),
    (None, "fp32", None),  # CPU
])
def test_peak_table(name, precision, tflops):
    assert peak_flops(name, precision) == (tflops * 1e12 if tflops else None)


def test_peak_override_wins():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", override_tflops=500) == 500e12
    assert peak_flops(None, "fp32", override_tflops=2) == 2e12


def test_compute_precision():
    assert compute_precision("bf16", "float32") == "bf16"
    assert compute_precision("no", "bfloat16") == "bf16"
    assert compute_precision("no", "float32") == "fp32"


def test_step_rates_per_device_and_mfu():
    rates = step_rates(flops=8e12, tokens=4000, seconds=2.0, world_size=4, peak=2e12)
    assert rates == {"tokens_per_s": 2000, "tokens_per_s_per_device": 500, "tflops": 1.0, "mfu_pct": 50.0}
    assert "mfu_pct" not in step_rates(8e12, 4000, 2.0, 4, None)


def test_meter_on_cpu_reports_rss_and_summary_skips_the_warmup_step():
    meter = StepMeter(FlopsModel(100, 100, 1, 4), world_size=1, device=torch.device("cpu"), peak=None)
    first = meter.step(tokens=100, sum_sq_lengths=1000, seconds=10.0)  # slow first step (warm-up)
    meter.step(tokens=100, sum_sq_lengths=1000, seconds=1.0)
    meter.step(tokens=100, sum_sq_lengths=1000, seconds=0.5)
    assert first["mem_rss_gib"] > 0 and first["mem_peak_rss_gib"] >= first["mem_rss_gib"]
    assert "mem_max_allocated_gib" not in first and "mfu_pct" not in first
    assert meter.postfix(first) == {"tok_s": "10", "mem": f"{first['mem_rss_gib']:.2f}G"}
    summary = meter.summary([1.5, 2.25])
    assert summary["tokens_per_s"] == 150  # median of 100 and 200: the 10 tokens/s first step left out
    line = format_throughput(summary)
    assert line.startswith("throughput: median 150 tokens/s (150/device), ") and "MFU" not in line
    assert line.endswith("peak memory per rank (peak RSS): 1.50, 2.25 GiB")


def test_medians_keep_a_single_step_and_mfu():
    steps = [{"tokens_per_s": 1.0, "tokens_per_s_per_device": 1.0, "tflops": 2.0, "mfu_pct": 40.0}]
    assert medians(steps) == steps[0]
    assert format_throughput({**steps[0], "peak_memory_gib_per_rank": [3.0], "memory_kind": "max allocated"}) == (
        "throughput: median 1 tokens/s (1/device), 2 TFLOP/s/device, MFU 40.0%; "
        "peak memory per rank (max allocated): 3.00 GiB")


def test_guide_peak_table_is_the_code_table():
    from conftest import REPO
    from hfsdp.run.throughput import PEAK_TFLOPS

    readme = (REPO / "docs" / "guide.md").read_text()
    for name, pattern, bf16, fp16, fp32 in PEAK_TFLOPS:
        assert f"| {name} | `{pattern}` | {bf16 if bf16 is not None else '-'} | {fp16} | {fp32} |" in readme, name
