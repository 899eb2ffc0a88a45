"""GPU-only checks (``pytest -m gpu``, run by scripts/gpu_check.sh): NCCL, bf16, CPU offload, FULL and SHARDED
checkpoints, export and a short bench, on one CUDA GPU. Skipped cleanly on machines without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = {
    "fsdp2_bf16_sharded": {"version": 2, "sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16",
                           "state_dict_type": "SHARDED_STATE_DICT"},
    "fsdp2_offload": {"version": 2, "sharding_strategy": "FULL_SHARD", "cpu_offload": True},
    "fsdp1_bf16_full": {"version": 1, "sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16",
                        "state_dict_type": "FULL_STATE_DICT"},
    "fsdp1_offload_sharded": {"version": 1, "sharding_strategy": "FULL_SHARD", "cpu_offload": True,
                              "state_dict_type": "SHARDED_STATE_DICT"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_trains_on_nccl_and_checkpoint_exports_the_final_weights(tmp_path, name):
    from safetensors.torch import load_file

    config = tiny_config(tmp_path, fsdp=CASES[name], train={"max_steps": 4, "save_every": 4})
    proc = run_cli("train", str(config))
    run = tmp_path / "run"
    report = json.loads((run / "startup_rank0.json").read_text())
    assert report["distributed_type"] == "FSDP" and "cuda" in report["device"], report
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"], proc.stdout
    run_cli("export", str(run / "checkpoints" / "step-4"), str(tmp_path / "exported"))
    final, exported = load_file(str(run / "final" / "model.safetensors")), load_file(
        str(tmp_path / "exported" / "model.safetensors"))
    assert final.keys() == exported.keys()
    for key in final:
        torch.testing.assert_close(exported[key], final[key], atol=0, rtol=0, msg=key)


def test_short_bench_on_gpu(tmp_path):
    out = tmp_path / "bench"
    run_cli("bench", "tiny", "--strategies", "FULL_SHARD,NO_SHARD", "--nproc", "1", "--steps", "2", "--out", str(out))
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {r["strategy"].split()[0] for r in rows} == {"FULL_SHARD", "NO_SHARD"}
    assert all(r["mem_peak_mib"] > 0 for r in rows), rows  # CUDA max_memory_allocated on GPU
