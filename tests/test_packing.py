"""The packing plugin and the preprocessing cache.

Packing must not change what the model learns: a packed row's summed token loss equals the sum of its samples'
losses computed one by one (no attention across samples, no label that crosses a boundary).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import CACHE_DIR, PRESET_DATA, base_env, run_cli, step_losses, tiny_config

from hfsdp.data import batches
from hfsdp.builtin.packing import pack


def test_pack_is_greedy_restarts_positions_and_drops_boundary_labels():
    ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    labels = [[-100, 2, 3], [4, 5], [6, -100, 8, 9], [10]]
    rows = pack(ids, labels, max_len=5)
    assert rows["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert rows["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    # the first token of each sample is never a target: it would be predicted from the previous sample
    assert rows["labels"] == [[-100, 2, 3, -100, 5], [-100, -100, 8, 9, -100]]


def test_collate_pads_packed_rows_as_a_block_of_their_own():
    batch = batches.collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "position_ids": [0, 1, 0]},
                          {"input_ids": [8], "labels": [8], "position_ids": [0]}], pad_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]
    inputs = batches.model_inputs(batch)  # transformers then masks by where position_ids restart
    assert "attention_mask" not in inputs and inputs["use_cache"] is False
    assert "attention_mask" in batches.model_inputs({k: v for k, v in batch.items() if k != "position_ids"})


def test_padding_fraction():
    assert batches.padding_fraction([4, 4, 4, 4], 2, seed=0) == 0.0
    assert batches.padding_fraction([2, 4], 2, seed=0) == pytest.approx(0.25)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_separate_losses(tiny_model_dir, attn):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.chat import tokenize_conversation
    from hfsdp.model.token_loss import token_loss_sum

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines()[:5]]
    samples = [tokenize_conversation(r["messages"], tokenizer) for r in rows]
    # text-style samples (loss on every token) too, so that the boundary token matters
    samples += [(ids, list(ids)) for ids, _ in samples[:2]]
    ids, labels = [s[0] for s in samples], [s[1] for s in samples]
    packed = pack(ids, labels, max_len=sum(map(len, ids)) - len(ids[-1]))  # two rows of different length
    assert len(packed["input_ids"]) == 2 and len(packed["input_ids"][0]) != len(packed["input_ids"][1])
    with torch.no_grad():
        packed_rows = [{k: packed[k][i] for k in packed} for i in range(2)]
        packed_batch = batches.micro_batch(packed_rows, tokenizer.pad_token_id, "cpu")
        packed_sum, packed_n = token_loss_sum(model, packed_batch), packed_batch.num_targets
        separate_sum, separate_n = 0.0, 0
        for i, row_labels in zip(ids, labels):
            single = batches.micro_batch([{"input_ids": i, "labels": row_labels}], tokenizer.pad_token_id, "cpu")
            separate_sum += float(token_loss_sum(model, single))
            separate_n += single.num_targets
        batch = batches.collate(packed_rows, tokenizer.pad_token_id)
    assert packed_n == separate_n
    assert float(packed_sum) == pytest.approx(separate_sum, rel=1e-5)
    # and without the block-diagonal mask (a plain 2D mask) the samples would see each other: the test has teeth
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"]).logits
        sealed = model(**batches.model_inputs(batch)).logits
    assert not torch.allclose(leaky, sealed, atol=1e-4)


def _private_cache(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A cache folder of its own (so the preprocessing cache starts empty) that links the shared built models."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in ("smollm2-tiny", "smollm2-tokenizer", "smollm2-135m-instruct"):
        if (CACHE_DIR / entry).exists():
            os.symlink(CACHE_DIR / entry, cache / entry)
    return cache


@pytest.mark.slow
def test_packing_run_and_preprocessing_cache(tmp_path, tiny_model_dir):
    cache = _private_cache(tmp_path, tiny_model_dir)
    env = base_env(HFSDP_CACHE_DIR=str(cache))
    config = tiny_config(tmp_path, plugins=["packing"], packing={"max_len": 384},
                         train={"max_steps": 4, "per_device_batch_size": 2, "learning_rate": 1e-2})
    first = run_cli("train", str(config), env=env)
    log1 = first.stdout + first.stderr
    match = re.search(r"padding ([\d.]+)% -> ([\d.]+)% \((\d+) samples packed into (\d+) rows\)", log1)
    assert match, log1[-3000:]
    before, after, samples, rows = float(match[1]), float(match[2]), int(match[3]), int(match[4])
    assert samples == 1000 and rows < samples / 3 and after < before
    assert "(preprocessing cache hit)" not in log1
    losses = step_losses(tmp_path / "run")
    assert losses[4] < losses[1]
    summary1 = json.loads((tmp_path / "run" / "summary.json").read_text())

    second = run_cli("train", str(config), "--overwrite", "--set", "train.max_steps=1", "--set", "train.eval_at_start=false",
                     "--set", "train.export_final=false", env=env)  # keys outside data: still a hit
    assert "(preprocessing cache hit)" in second.stdout + second.stderr
    summary2 = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary2["data"]["cache_hit"] and not summary1["data"]["cache_hit"]
    assert step_losses(tmp_path / "run")[1] == losses[1]  # the cached rows are the same rows
    ratio = summary2["data"]["preprocess_s"] / summary1["data"]["preprocess_s"]
    print(f"\npacking: padding {before}% -> {after}% ({samples} samples into {rows} rows); preprocessing "
          f"{summary1['data']['preprocess_s']:.2f} s -> {summary2['data']['preprocess_s']:.2f} s on a cache hit "
          f"(ratio {ratio:.2f})")
    assert ratio < 1.0
    shutil.rmtree(cache / "datasets", ignore_errors=True)


def _opt_model_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A real (randomly initialised) OPT model with the tiny model's tokenizer: OPT computes its positions from the
    attention mask and ignores position_ids, so packed samples attend to each other."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "tiny-opt"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model("opt", num_hidden_layers=2, num_attention_heads=2, hidden_size=32, ffn_dim=64,
                                  word_embed_proj_dim=32, vocab_size=len(tokenizer), max_position_embeddings=256,
                                  pad_token_id=tokenizer.pad_token_id or 0, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_packing_probe_passes_on_llama_and_refuses_a_model_that_leaks(tmp_path, tiny_model_dir):
    """The start-up probe (issue 15 item 10), on real models in this process: SmolLM2 (Llama) keeps packed samples
    apart under sdpa and eager; OPT does not."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfsdp.errors import UserError

    for attn in ("sdpa", "eager"):
        llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn, dtype=torch.float32)
        batches.check_packed_attention(llama, llama.config.vocab_size, "cpu")
    opt = AutoModelForCausalLM.from_pretrained(_opt_model_dir(tmp_path, tiny_model_dir))
    with pytest.raises(UserError, match="packing: this model lets packed samples attend to each other"):
        batches.check_packed_attention(opt, opt.config.vocab_size, "cpu")


@pytest.mark.slow
def test_packing_run_on_a_model_that_leaks_is_refused_before_training(tmp_path, tiny_model_dir):
    config = tiny_config(tmp_path, model={"name_or_path": str(_opt_model_dir(tmp_path, tiny_model_dir))},
                         plugins=["packing"], packing={})
    proc = run_cli("train", str(config), check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "packing: this model lets packed samples attend to each other" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
