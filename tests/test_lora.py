"""The lora plugin through the real CLI: training, adapter export, merged export, and a 2-rank FSDP2 run whose adapter
equals the single-process one."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli, run_torchrun, step_losses, tiny_config

LORA = {"r": 4, "alpha": 8}
STEPS = 6


def _lora_config(tmp_path: Path, per_device: int, **lora) -> Path:
    return tiny_config(tmp_path, plugins=["lora"], lora={**LORA, **lora},
                       train={"max_steps": STEPS, "per_device_batch_size": per_device, "learning_rate": 1e-2,
                              "save_every": STEPS, "eval_at_start": True})


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, per-device batch 4; exports of its last checkpoint as adapter and merged."""
    tmp = tmp_path_factory.mktemp("lora1")
    proc = run_cli("train", str(_lora_config(tmp, per_device=4)))
    run = tmp / "run"
    checkpoint = run / "checkpoints" / f"step-{STEPS}"
    run_cli("export", str(checkpoint), str(tmp / "merged"), "--merge-lora")
    run_cli("export", str(checkpoint), str(tmp / "adapter_from_checkpoint"))
    return {"run": run, "log": proc.stdout + proc.stderr, "checkpoint": checkpoint, "merged": tmp / "merged",
            "adapter_ck": tmp / "adapter_from_checkpoint"}


def _logits(model, seed: int = 0):
    import torch

    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
def test_lora_trains_only_the_adapters(single, tiny_model_dir):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hfsdp.checkpoint.safe_load import CheckpointWeights

    assert "lora: r=4 alpha=8 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in single["log"]
    losses = step_losses(single["run"])
    assert losses[STEPS] < losses[1] - 0.05, losses
    adapter = load_file(str(single["run"] / "final" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
    assert all(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0: trained
    # every base weight in the trained checkpoint is bit-identical to the pretrained one
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    weights = CheckpointWeights(single["checkpoint"])
    frozen = [k for k in weights if "lora_" not in k]
    assert len(frozen) >= len(base) - 1
    for key in frozen:
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(weights[key], base[name]), key


@pytest.mark.slow
def test_adapter_loads_with_peft_and_matches_merged_export(single, tiny_model_dir):
    import json

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = single["run"] / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(final))
    merged = AutoModelForCausalLM.from_pretrained(single["merged"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = _logits(peft_model)
    torch.testing.assert_close(_logits(merged), trained, atol=1e-4, rtol=0)
    assert (trained - _logits(base)).abs().max() > 1e-2  # the adapter changes the model
    # the checkpoint export writes the same adapter as the end of training
    a, b = load_file(str(final / "adapter_model.safetensors")), load_file(str(single["adapter_ck"] / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_adapter_export_never_replaces_what_it_did_not_write(single):
    import json

    from hfsdp.disk.durable import EXPORT_RECORD

    adapter = single["adapter_ck"]
    record = json.loads((adapter / EXPORT_RECORD).read_text())
    assert "adapter_model.safetensors" in record["files"] and "adapter_config.json" in record["files"]
    run = single["run"]
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    proc = run_cli("export", str(single["checkpoint"]), str(run), "--overwrite", check=False)
    assert proc.returncode == 2 and "contains the checkpoint being exported" in proc.stderr, proc.stderr[-2000:]
    (adapter / "notes.txt").write_text("mine")
    proc = run_cli("export", str(single["checkpoint"]), str(adapter), "--overwrite", check=False)
    assert proc.returncode == 2 and "the earlier export did not write (notes.txt)" in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before
    assert (adapter / "notes.txt").read_text() == "mine" and (adapter / "adapter_model.safetensors").is_file()
    (adapter / "notes.txt").unlink()
    run_cli("export", str(single["checkpoint"]), str(adapter), "--overwrite")  # an earlier export: replaced


@pytest.mark.slow
def test_two_ranks_save_the_same_adapter(single, tmp_path):
    import torch
    from safetensors.torch import load_file

    run_torchrun(2, "train", str(_lora_config(tmp_path, per_device=2)))
    two = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    one = load_file(str(single["run"] / "final" / "adapter_model.safetensors"))
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0, msg=key)
    assert step_losses(tmp_path / "run") == pytest.approx(step_losses(single["run"]), abs=1e-5)


def test_lora_with_fsdp1_needs_use_orig_params(tmp_path):
    config = tiny_config(tmp_path, plugins=["lora"], fsdp={"version": 1, "use_orig_params": False})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2
    assert "fsdp.use_orig_params: LoRA under FSDP1 needs use_orig_params: true" in proc.stderr


def test_lora_section_typo_names_the_plugin(tmp_path):
    proc = run_cli("validate", str(tiny_config(tmp_path, plugins=["lora"], lora={"rank": 8})), check=False)
    assert proc.returncode == 2
    assert "lora.rank: unknown key" in proc.stderr and "[section of plugin 'lora']" in proc.stderr
    proc = run_cli("validate", str(tiny_config(tmp_path, lora={"r": 8})), check=False)
    assert proc.returncode == 2 and "lora: section of plugin 'lora', which is not enabled: enable plugin 'lora'" in proc.stderr


def test_default_targets_and_tied_embeddings(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from hfsdp.builtin import lora
    from hfsdp.config.schema import FSDPConfig
    from hfsdp.errors import ConfigError

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert lora.default_target_modules(model, FSDPConfig()) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                                "up_proj", "v_proj"]
    assert model.config.tie_word_embeddings
    with pytest.raises(ConfigError, match="tied"):
        lora._check_tied(model, ["q_proj"], ["lm_head"])
    with pytest.raises(ConfigError, match="tied"):
        lora._check_tied(model, ["embed_tokens"], None)


@pytest.mark.slow
def test_lora_fsdp1_single_shard_with_tied_embeddings_is_refused(tmp_path):
    config = tiny_config(tmp_path, plugins=["lora"], fsdp={"version": 1, "single_process": "fsdp"},
                         train={"eval_at_start": False})
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fsdp.version: LoRA on a model with tied embeddings under FSDP1 with a single shard" in proc.stderr
