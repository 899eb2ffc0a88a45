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
from hfsdp.builtin.packing import next_fit_rows, pack


def test_pack_fills_rows_best_fit_decreasing_in_sample_order_restarts_positions_and_drops_boundary_labels():
    ids = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10]]
    labels = [[-100, 2, 3], [4, 5, 6, 7], [8, -100], [10]]
    rows = pack(ids, labels, max_len=5)
    # longest first, each into the fullest row it fits: {4 tokens, 1 token} and {3, 2}, each row's samples in their
    # order; next-fit in order needs 3 rows ([3], [4], [2, 1])
    assert rows["input_ids"] == [[4, 5, 6, 7, 10], [1, 2, 3, 8, 9]]
    assert rows["position_ids"] == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    # the first token of each sample is never a target: it would be predicted from the previous sample
    assert rows["labels"] == [[-100, 5, 6, 7, -100], [-100, 2, 3, -100, -100]]
    assert next_fit_rows([3, 4, 2, 1], 5, window=10) == 3 and next_fit_rows([3, 4, 2, 1], 5, window=2) == 3


def _next_fit_in_order(lengths: list[int], max_len: int) -> int:
    """The rows next-fit in order needs, counted here (the packer the plugin had before best-fit decreasing)."""
    rows, used = 0, max_len
    for n in lengths:
        if used + n > max_len:
            rows, used = rows + 1, 0
        used += n
    return rows


def _bundled_chats(tiny_model_dir: Path) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoTokenizer

    from hfsdp.builtin.chat import tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines()]
    return [tokenize_conversation(r["messages"], tokenizer) for r in rows]


def test_best_fit_decreasing_packs_the_bundled_chats_into_fewer_rows_than_next_fit(tiny_model_dir):
    """The 1,000 bundled training chats (80 to 93 tokens with the tiny model's tokenizer): best-fit decreasing never
    needs more rows than next-fit in order, and about 12 % fewer at 256 tokens a row (next-fit closes a row as soon
    as the next chat does not fit in it, leaving room a shorter chat later on would have filled); every row fits,
    every sample is in exactly one row with its first label dropped, and packing again gives the same rows."""
    import math
    from collections import Counter

    samples = _bundled_chats(tiny_model_dir)
    ids, labels = [s[0] for s in samples], [s[1] for s in samples]
    lengths = [len(i) for i in ids]
    counts = {}
    for max_len in (128, 256, 384, 512, 1024):
        rows = pack(ids, labels, max_len)
        counts[max_len] = len(rows["input_ids"]), _next_fit_in_order(lengths, max_len)
        assert math.ceil(sum(lengths) / max_len) <= counts[max_len][0] <= counts[max_len][1], (max_len, counts)
        assert all(len(r) <= max_len for r in rows["input_ids"])
        unpacked = Counter()
        for row_ids, row_labels, positions in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
            starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
            assert positions == [p for a, b in zip(starts, starts[1:]) for p in range(b - a)]
            unpacked.update((tuple(row_ids[a:b]), tuple(row_labels[a:b])) for a, b in zip(starts, starts[1:]))
        assert unpacked == Counter((tuple(i), (-100, *labs[1:])) for i, labs in samples)
        assert pack(ids, labels, max_len) == rows
        assert next_fit_rows(lengths, max_len, window=10000) == counts[max_len][1]
    print("\nrows for 1000 chats, best-fit decreasing vs next-fit in order: "
          + ", ".join(f"{m} tokens {b} vs {n}" for m, (b, n) in counts.items()))
    bfd, next_fit = counts[256]
    assert bfd <= 0.9 * next_fit, counts
    assert counts[512][0] < counts[512][1], counts


def test_the_padding_report_says_how_many_rows_next_fit_would_have_needed(tmp_path, tiny_model_dir):
    """The data report's padding line: best-fit decreasing's rows beside next-fit's, on a build and on a cache hit
    (the count is kept in the cache entry's meta)."""
    from transformers import AutoTokenizer

    from hfsdp.rules.table import load_checked
    from hfsdp.data import prepare as data

    samples = _bundled_chats(tiny_model_dir)
    expected_rows = len(pack([s[0] for s in samples], [s[1] for s in samples], 256)["input_ids"])
    expected_next_fit = _next_fit_in_order([len(s[0]) for s in samples], 256)
    config, host = load_checked(str(tiny_config(tmp_path, plugins=["packing"], packing={"max_len": 256})))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for hit in (False, True):
        train, _, _, report = data.prepare_datasets(config, host, tokenizer, tmp_path / "cache")
        assert report["cache_hit"] is hit
        match = re.search(r"\((\d+) samples packed into (\d+) rows; next-fit: (\d+)\)", report["padding"])
        assert match, report["padding"]
        assert (int(match[1]), int(match[2]), int(match[3])) == (1000, expected_rows, expected_next_fit) == \
            (1000, len(train), expected_next_fit)
        assert expected_rows < expected_next_fit
        assert report["padding"].split("into ")[1].split()[0] == str(expected_rows)  # as test_combinations reads it


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
    match = re.search(r"padding ([\d.]+)% -> ([\d.]+)% \((\d+) samples packed into (\d+) rows; next-fit: (\d+)\)",
                      log1)
    assert match, log1[-3000:]
    before, after, samples, rows = float(match[1]), float(match[2]), int(match[3]), int(match[4])
    assert samples == 1000 and rows < samples / 3 and after < before and rows <= int(match[5])
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


def test_packed_rows_whose_attention_reads_the_spans_build_no_mask(tiny_model_dir, monkeypatch):
    """A packed micro-batch that carries its rows' spans (the packer's, which hfsdp's sdpa reads, one sequence at a
    time) builds no mask: transformers would build a rows x width x width block-diagonal one from the position ids
    that restart, which that attention ignores (issue 73). The logits are the masked forward's; a forward without
    the spans (generation, the packing probe) still builds its mask, also after a forward with them that raised."""
    import torch
    import transformers.masking_utils as masking
    from transformers import AutoModelForCausalLM

    from hfsdp.data.layout import SEGMENTS
    from hfsdp.model.packed_attention import use_sequence_sdpa

    built = []
    real = masking.sdpa_mask
    monkeypatch.setattr(masking, "sdpa_mask", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert use_sequence_sdpa(model)
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None]
    inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    with torch.no_grad():
        masked = model(**inputs).logits
        assert len(built) == 1 and built[0].shape == (1, 1, 40, 40)  # the block-diagonal mask, without the spans
        spanned = model(**inputs, **{SEGMENTS: [[(0, 15), (15, 40)]]}).logits
        assert len(built) == 1  # none built
        with pytest.raises(RuntimeError):  # float token ids: the embedding refuses them, inside the forward
            model(**{**inputs, "input_ids": ids.float()}, **{SEGMENTS: [[(0, 15), (15, 40)]]})
        model(**inputs)
        assert len(built) == 2
    assert torch.allclose(spanned, masked, atol=1e-5)
