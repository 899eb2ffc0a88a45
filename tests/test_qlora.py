"""QLoRA (``model.quantization``) through the real CLI: a 4-bit nf4 double-quant base on the shrunk SmolLM2, LoRA on
top, FSDP2 FULL_SHARD on 2 gloo ranks against one process on the same global batch (with accumulation):

* per-step losses and LoRA gradient norms equal to one process's, and the packed 4-bit weights really sharded (the
  start-up probe compared them with the loaded ones);
* the exported adapter, loaded with ``PeftModel`` over the same 4-bit base in plain transformers, gives the logits
  the trained model gave at the end of training (``tests/logits_plugin``);
* ``lora.merge: true`` (the one-process run) writes the base dequantized with the adapters merged, a plain
  Hugging Face folder that transformers loads without bitsandbytes and that gives the trained logits;
* a FULL_STATE_DICT checkpoint resumes on 2 ranks bit for bit (SHARDED ones: tests/test_combinations.py);
* ``hfsdp plan`` predicts the bytes each rank holds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import base_env, read_metrics, run_cli, run_torchrun, step_losses, tiny_config

pytestmark = pytest.mark.slow

STEPS = 4
LOSS_REL = 1e-4  # tests/test_multirank.py's tolerance for 2 ranks against one process
PLUGIN_DIR = Path(__file__).resolve().parent / "logits_plugin"
QUANT = {"bits": 4, "quant_type": "nf4", "double_quant": True}
TRAIN = {"max_steps": STEPS, "gradient_accumulation_steps": 2, "lr_scheduler": "constant", "save_every": 2,
         "eval_at_start": False, "max_eval_batches": 1}


def _env() -> dict[str, str]:
    return base_env(PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")])))


def _config(folder: Path, per_device: int, lora: dict) -> Path:
    return tiny_config(folder, plugins=["lora", "hfsdp_logits"], lora=lora,
                       model={"name_or_path": "smollm2-tiny", "quantization": QUANT},
                       train={**TRAIN, "per_device_batch_size": per_device},
                       fsdp={"version": 2, "sharding_strategy": "FULL_SHARD", "state_dict_type": "FULL_STATE_DICT"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    out = {}
    for name, world, per_device, lora in (("one", 1, 4, {"merge": True}), ("two", 2, 2, {})):
        (root / name).mkdir()
        config = _config(root / name, per_device, lora)
        args = ("train", str(config))
        proc = run_cli(*args, env=_env()) if world == 1 else run_torchrun(world, *args, env=_env())
        out[name] = (root / name / "run", proc.stdout + proc.stderr)
    return out


def _grad_norms(run: Path) -> dict[int, float]:
    return {m["step"]: m["grad_norm"] for m in read_metrics(run) if "grad_norm" in m}


def _report(run: Path, rank: int = 0) -> dict:
    return json.loads((run / f"startup_rank{rank}.json").read_text())


def test_two_ranks_compute_one_process_steps_on_a_sharded_4bit_base(runs):
    one, _ = runs["one"]
    two, log = runs["two"]
    losses, norms = step_losses(two), _grad_norms(two)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in step_losses(one).items():
        assert losses[step] == pytest.approx(loss, rel=LOSS_REL), (step, losses)
        assert norms[step] == pytest.approx(_grad_norms(one)[step], rel=LOSS_REL), (step, norms)
    assert norms[1] > 0 and losses[STEPS] < losses[1]
    for rank in (0, 1):
        base = _report(two, rank)["quantized_base"]
        assert base["sharded"] and base["layers"] == 14 and base["quant_storage"] == "float32"
        assert base["packed_bytes_this_rank"] == base["packed_bytes_full"] // 2
    assert "4-bit base: 14 nf4 Linears, double quant, stored float32" in log and "(sharded by FSDP2)" in log


def test_exported_adapter_over_the_same_4bit_base_gives_the_trained_logits(runs, tiny_model_dir, monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    from hfsdp_logits import IDS
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hfsdp.model.quantized import keep_packing

    two, _ = runs["two"]
    final = two / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2-tiny"
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), quantization_config=quant, device_map="cpu",
                                                dtype=torch.float32)
    # bitsandbytes' CPU inference kernel (AVX512-BF16 CPUs, eval mode) computes otherwise; hfsdp trains without it
    keep_packing(base)
    with torch.no_grad():
        before = base.eval()(input_ids=IDS).logits
        model = PeftModel.from_pretrained(base, str(final)).eval()
        logits = model(input_ids=IDS).logits
    trained = torch.load(two / "trained_logits.pt")
    torch.testing.assert_close(logits, trained, atol=1e-5, rtol=0)
    assert (trained - before).abs().max() > 1e-3  # the adapter changed the model


def test_full_checkpoint_resumes_bit_for_bit(runs, tmp_path):
    from safetensors.torch import load_file

    two, _ = runs["two"]
    run = tmp_path / "run"
    shutil.copytree(two / "checkpoints" / "step-2", run / "checkpoints" / "step-2")
    config = yaml.safe_load((two / "config.yaml").read_text())
    config["train"]["output_dir"] = str(run)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    run_torchrun(2, "train", str(tmp_path / "config.yaml"), "--resume", env=_env())
    want = {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(two) if "loss" in m}
    got = {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run) if "loss" in m}
    assert got == {step: want[step] for step in (3, 4)}
    a, b = load_file(run / "final" / "adapter_model.safetensors"), load_file(two / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_plan_predicts_the_4bit_base_bytes_each_rank_holds(runs):
    two, _ = runs["two"]
    proc = run_cli("plan", str(two.parent / "config.yaml"), "--nproc", "2", "--strategies", "FULL_SHARD", "--json",
                   env=_env())
    row = json.loads(proc.stdout)["rows"][0]
    for rank in (0, 1):
        report = _report(two, rank)
        held = report["param_bytes_this_rank"] + report["quantized_base"]["quant_state_bytes"]
        assert row["params"] == pytest.approx(held, rel=0.01), (row["params"], held)


def test_merged_export_is_a_plain_model_with_the_trained_logits(runs):
    import subprocess
    import sys

    one, _ = runs["one"]
    final = one / "final"
    assert not (final / "adapter_config.json").exists() and (final / "model.safetensors").is_file()
    # a fresh interpreter in which bitsandbytes cannot be imported (tests/no_bitsandbytes) loads it
    script = (f"import sys, torch; sys.path.insert(0, {str(PLUGIN_DIR)!r}); from hfsdp_logits import IDS; "
              "from transformers import AutoModelForCausalLM; "
              f"m = AutoModelForCausalLM.from_pretrained({str(final)!r}).eval(); "
              "assert all(type(l).__name__ == 'Linear' for l in m.model.layers[0].mlp.children() if hasattr(l, 'weight')); "
              f"torch.save(m(input_ids=IDS).logits.detach(), {str(one / 'merged_logits.pt')!r})")
    subprocess.run([sys.executable, "-c", script], check=True,
                   env=base_env(PYTHONPATH=str(Path(__file__).parent / "no_bitsandbytes")))
    import torch

    merged, trained = torch.load(one / "merged_logits.pt"), torch.load(one / "trained_logits.pt")
    torch.testing.assert_close(merged, trained, atol=1e-4, rtol=0)


def test_a_packed_byte_changed_by_sharding_is_refused_before_training(tmp_path):
    """bitsandbytes #1945 simulated (tests/logits_plugin/hfsdp_corrupt_shard.py flips one packed byte inside
    fully_shard): the start-up probe names the layer and the run stops before its first step."""
    config = tiny_config(tmp_path, plugins=["lora", "hfsdp_corrupt_shard"], model={"quantization": QUANT},
                         fsdp={"single_process": "fsdp"}, train={"max_steps": 2, "eval_at_start": False})
    proc = run_cli("train", str(config), env=_env(), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the 4-bit weights did not survive sharding" in proc.stderr and "layer(s) with other packed bytes" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()
