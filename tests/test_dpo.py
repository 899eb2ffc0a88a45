"""Preference tuning (plugin ``dpo``, format ``preference``, hook ``hfsdp_objective``) through the real CLI on the
shrunk SmolLM2: the step-0 loss is ln 2, 2 gloo ranks compute what one process computes (full fine-tuning with
precomputed reference log-probs, and LoRA with the adapters disabled as the reference), the reference log-probs are
cached, the metrics are written, and a third-party preference loss (tests/preference_plugin) runs through the same
hooks. The comparison against TRL's DPOTrainer is benchmarks/trl_dpo.py (not in CI)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import CACHE_DIR, PRESET_DATA, REPO, base_env, read_metrics, run_cli, run_torchrun, tiny_config

pytestmark = pytest.mark.slow

LN2_FLOAT32 = torch.tensor(math.log(2)).item()  # ln 2 as the float32 loss holds it
STEPS = 3
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
           "logps/rejected")
PLUGIN_DIR = REPO / "tests" / "preference_plugin"


def dpo_config(folder: Path, per_device: int, plugins: tuple[str, ...] = ("dpo",), train: dict | None = None,
               **sections) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_config(folder, plugins=list(plugins),
                       data={"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl"),
                             "eval_path": str(PRESET_DATA / "contacts_pref_eval.jsonl"), "max_seq_len": 96,
                             "max_eval_samples": 4},
                       train={"max_steps": STEPS, "per_device_batch_size": per_device, "lr_scheduler": "constant",
                              "max_eval_batches": 1, "collective_timeout_s": 120, **(train or {})}, **sections)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (run folder, console). The global batch is 2 pairs per step in all of them."""
    root = tmp_path_factory.mktemp("dpo")
    cache = root / "cache"  # the test cache's models, but a preprocessing and reference cache of its own
    cache.mkdir()
    for entry in CACHE_DIR.iterdir():
        if entry.name not in ("datasets", "reference"):
            (cache / entry.name).symlink_to(entry)
    env = base_env(HFSDP_CACHE_DIR=str(cache))
    out = {}
    for name, world, lora in (("full_x1", 1, False), ("full_x2", 2, False), ("lora_x1", 1, True),
                              ("lora_x2", 2, True)):
        config = dpo_config(root / name, per_device=2 // world, plugins=("dpo", "lora") if lora else ("dpo",))
        proc = (run_cli("train", str(config), env=env) if world == 1
                else run_torchrun(world, "train", str(config), env=env))
        out[name] = (root / name / "run", proc.stdout + proc.stderr)
    return out


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


@pytest.mark.parametrize("name", ["full_x1", "full_x2", "lora_x1", "lora_x2"])
def test_the_first_loss_is_ln2_and_the_metrics_are_written(runs, name):
    run, console = runs[name]
    first = steps(run)[1]
    # The adapter reference is the same forward with the adapters off: exactly ln 2. Precomputed log-probs come from
    # micro-batches of other padding (full_x2 reads those full_x1 computed): float32 noise of the tiny random model's
    # large log-probs (about -350 per completion; 1e-6 relative at most), measured up to 1.5e-6 off ln 2.
    tolerance = 0 if name.startswith("lora") else 2e-6
    assert first["loss"] == pytest.approx(LN2_FLOAT32, abs=tolerance)
    assert abs(first["rewards/margins"]) < 1e-5 and abs(first["rewards/chosen"]) < 1e-5
    for step in steps(run).values():
        assert all(math.isfinite(step[key]) for key in METRICS), step
        assert step["logps/chosen"] < 0 and 0 <= step["rewards/accuracy"] <= 1
    evals = [m for m in read_metrics(run) if "eval_loss" in m]
    assert evals[0]["step"] == 0 and evals[0]["eval_loss"] == pytest.approx(LN2_FLOAT32, abs=tolerance)
    assert {f"eval_{key}" for key in METRICS} <= evals[-1].keys() and "eval_ppl" not in evals[-1]
    assert "margins=" in console and "accuracy=" in console  # the progress bar
    assert "perplexity" not in console


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_ranks_compute_what_one_process_computes(runs, kind):
    one, two = steps(runs[f"{kind}_x1"][0]), steps(runs[f"{kind}_x2"][0])
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), step
        assert two[step]["rewards/margins"] == pytest.approx(one[step]["rewards/margins"], abs=1e-4), step
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-3), step
        assert two[step]["rewards/accuracy"] == one[step]["rewards/accuracy"]
    assert one[STEPS]["loss"] != one[1]["loss"]  # it trained


def test_reference_log_probs_are_computed_once_and_cached(runs):
    """Full fine-tuning: computed before training by the first run, read back by the next one on the same rows and
    weights (the 2-rank run); LoRA uses the base with its adapters disabled and precomputes nothing."""
    assert "dpo: computing the reference log-probs of the train split (256 pairs)" in runs["full_x1"][1]
    assert "dpo: reference log-probs of the train split read from the cache" in runs["full_x2"][1]
    assert "reference log-probs" not in runs["lora_x1"][1]


def test_the_adapter_reference_is_the_base_model(tiny_model_dir):
    """peft's disable_adapter gives exactly the base model's completion log-probs, also with adapters that change
    the model (random B matrices)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.dpo import DpoSection
    from hfsdp.builtin.dpo.loss import DPO
    from hfsdp.builtin.preference import tokenize_pair
    from hfsdp.config.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(format="preference", path="unused", max_seq_len=64)
    rows = [tokenize_pair("Q: 2+2?", " 4", " five", tokenizer, cfg), tokenize_pair("Q: 3+1?", " 4.", " 2", tokenizer, cfg)]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    objective = DPO(DpoSection(), "adapter", None, tokenizer)
    batch = objective.micro_batch(rows, tokenizer.pad_token_id, "cpu", select_logits=True)
    with torch.no_grad():
        want = objective.completion_logps(base, batch)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        objective.unwrapped = model
        adapted = objective.completion_logps(model, batch)
        with objective.base_only():
            got = objective.completion_logps(model, batch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.allclose(adapted[0], want[0])


def test_conversational_rows_follow_trls_conventions(tiny_model_dir):
    """The completion starts where the tokenized prompt (with the generation prompt) and prompt + completion
    diverge; an implicit prompt (no prompt column) is the shared beginning; plain texts end with EOS."""
    from transformers import AutoTokenizer

    from hfsdp import IGNORE_INDEX
    from hfsdp.builtin.preference import tokenize_pair
    from hfsdp.config.schema import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(format="preference", path="unused", max_seq_len=128)
    user = [{"role": "user", "content": "2+2?"}]
    good, bad = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    row = tokenize_pair(user, good, bad, tokenizer, cfg)
    prompt = tokenizer.apply_chat_template(user, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    assert row["input_ids"] == tokenizer.apply_chat_template(user + good, tokenize=True, return_dict=True)["input_ids"]
    assert row["labels"][:len(prompt)] == [IGNORE_INDEX] * len(prompt) and row["input_ids"][:len(prompt)] == prompt
    assert row["labels"][len(prompt):] == row["input_ids"][len(prompt):]
    assert tokenize_pair(None, user + good, user + bad, tokenizer, cfg) == row
    text = tokenize_pair("Q: 2+2?", " 4", " 5", tokenizer, cfg)
    assert text["input_ids"][-1] == tokenizer.eos_token_id and text["rejected_labels"][-1] == tokenizer.eos_token_id


def test_a_third_party_preference_loss_through_the_same_hooks(tmp_path):
    """tests/preference_plugin/hfsdp_simpo.py: SimPO, reference-free, one pair per step: the logged loss is its
    formula of the logged margin."""
    config = dpo_config(tmp_path, per_device=1, plugins=("hfsdp_simpo",), simpo={"beta": 2.0, "gamma": 0.5},
                        train={"max_steps": 2, "eval_at_start": False})
    run_cli("train", str(config), env=base_env(PYTHONPATH=str(PLUGIN_DIR)))
    for step in steps(tmp_path / "run").values():
        margin = step["rewards/margins"]
        assert step["loss"] == pytest.approx(math.log1p(math.exp(0.5 - margin)), rel=1e-5), step
        assert step["rewards/accuracy"] == float(margin > 0)
