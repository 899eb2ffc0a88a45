"""`hfsdp plan`: memory per rank predicted from the architecture alone, checked against exact parameter counts
and (slow) against the bytes `hfsdp bench` counts from live tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import PRESET_DATA, base_env, run_cli, tiny_config

# Llama-3.1-8B: embeddings and lm_head 2 x 128256 x 4096, 32 layers of 218,112,000, final norm 4096.
LLAMA_8B_PARAMS = 2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096) + 4096


def hub_config(tmp_path: Path, name: str, max_seq_len: int = 2048, **fsdp) -> Path:
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": name},
        "data": {"format": "chat", "path": str(PRESET_DATA / "contacts_train.jsonl"), "max_seq_len": max_seq_len},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 10},
        "fsdp": {"mixed_precision": "bf16", **fsdp},
    }))
    return path


def plan_json(*args: str) -> dict:
    proc = run_cli("plan", *args, "--json", env=base_env(HF_HUB_OFFLINE="1"))
    return json.loads(proc.stdout)


def row(data: dict, strategy: str, world: int) -> dict:
    return next(r for r in data["rows"] if r["strategy"] == strategy and r["world"] == world)


def test_llama_8b_on_8_gpus_offline_from_the_shipped_config(tmp_path):
    data = plan_json(str(hub_config(tmp_path, "meta-llama/Llama-3.1-8B")), "--nproc", "1,8", "--device-memory", "80GiB")
    assert data["parameters"] == LLAMA_8B_PARAMS == 8_030_261_248
    assert data["fsdp_units"] == 33  # 32 decoder layers + the root (embeddings, final norm, lm_head)
    full = row(data, "FULL_SHARD", 8)
    # Every dim 0 of Llama-3.1-8B divides by 8: an exact eighth of the fp32 weights, gradients and two Adam moments.
    assert full["params"] == full["grads"] == LLAMA_8B_PARAMS * 4 // 8
    assert full["optimizer"] == 2 * full["params"]
    assert full["fits"] is True and full["device_peak"] < 80 * 2**30
    ddp = row(data, "NO_SHARD", 8)
    assert ddp["runs_as_ddp"] and ddp["params"] == LLAMA_8B_PARAMS * 4 and ddp["fits"] is False
    assert ddp["suggestion"].startswith("fsdp.sharding_strategy=FULL_SHARD")
    one = row(data, "FULL_SHARD", 1)
    assert one["fits"] is False and "--nproc 8" in one["suggestion"]
    # Every rank reads the full fp32 model unless cpu_ram_efficient_loading: 8 copies per node.
    assert full["host_load_per_node"] == 8 * LLAMA_8B_PARAMS * 4


def test_cheapest_change_is_the_smallest_set_that_fits_the_seeds_7b_fp32_case(tmp_path):
    """The seeds' example: a 7B model in fp32 on 80 GB devices, params 26.98 + grads 26.98 + Adam 53.96 GiB on one
    rank. Two ranks under FULL_SHARD fit; activation checkpointing and bf16 are not needed on top (the search used
    to try more ranks alone, then more ranks with every cheap change at once, and printed all three)."""
    data = plan_json(str(hub_config(tmp_path, "mistralai/Mistral-7B-v0.1", mixed_precision="no")),
                     "--nproc", "1,2", "--device-memory", "80GB")
    one = row(data, "SHARD_GRAD_OP", 1)
    assert [round(one[k] / 2**30, 2) for k in ("params", "grads", "optimizer")] == [26.98, 26.98, 53.96]
    two = row(data, "FULL_SHARD", 2)
    assert two["fits"] and not row(data, "SHARD_GRAD_OP", 2)["fits"]
    expected = f"--nproc 2 (2 ranks) fsdp.sharding_strategy=FULL_SHARD -> {two['device_peak'] / 2**30:.1f} GiB"
    for strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
        assert row(data, strategy, 1)["suggestion"] == expected, strategy
    assert row(data, "FULL_SHARD", 1)["suggestion"].startswith("--nproc 2 (2 ranks) -> ")


def test_change_sets_come_in_order_of_cost():
    from hfsdp.tools.plan.planner import Change, change_sets

    a, b, n2, n4, lora = (Change("a"), Change("b"), Change("n2", group="n"), Change("n4", group="n"), Change("lora"))
    order = [" ".join(c.words for c in chosen) for chosen in change_sets([a, b, n2, n4, lora])]
    assert order[:8] == ["a", "b", "a b", "n2", "a n2", "b n2", "a b n2", "n4"]
    assert "n2 n4" not in " | ".join(order)  # one rank count at a time
    assert len(order) == len(set(order)) == 3 * 4 * 2 - 1  # (a?)(b?)(n2|n4|-)(lora?) less the empty set


def test_activation_checkpointing_and_offload_move_memory_where_they_should(tmp_path):
    plain = row(plan_json(str(hub_config(tmp_path, "meta-llama/Llama-3.1-8B")), "--nproc", "8",
                          "--strategies", "FULL_SHARD"), "FULL_SHARD", 8)
    data = plan_json(str(hub_config(tmp_path, "meta-llama/Llama-3.1-8B", activation_checkpointing=True,
                                    cpu_offload=True, cpu_ram_efficient_loading=True)),
                     "--nproc", "8", "--strategies", "FULL_SHARD,NO_SHARD")
    ckpt = row(data, "FULL_SHARD", 8)
    # A strategy the rest of the config rules out is a row saying why, not a crash.
    assert "cpu_ram_efficient_loading" in row(data, "NO_SHARD", 8)["problem"]
    # Checkpointing keeps each layer's input (1 x 2048 x 4096 bf16 = 16 MiB) plus one layer, not all 32 layers.
    assert ckpt["activations"] < plain["activations"] / 4
    assert ckpt["host_per_rank"] == plain["params"] + plain["grads"] + plain["optimizer"]
    assert ckpt["device_peak"] < plain["device_peak"] - plain["params"] - plain["optimizer"]
    assert ckpt["host_load_per_node"] == LLAMA_8B_PARAMS * 4  # only rank 0 reads the weights


def test_async_saves_count_their_host_staging_copy(tmp_path):
    config = tiny_config(tmp_path, train={"async_save": True})
    data = plan_json(str(config), "--nproc", "1,2", "--strategies", "FULL_SHARD,NO_SHARD")
    staged = row(data, "FULL_SHARD", 2)
    assert staged["host_per_rank"] == staged["params"] + staged["optimizer"] > 0  # the rank's shards, copied
    assert row(data, "NO_SHARD", 2)["host_per_rank"] == 0  # DDP: train.async_save is refused, nothing staged


def test_lora_adapters_alone_carry_gradients_and_optimizer_state(tmp_path):
    cfg = tiny_config(tmp_path, plugins=["lora"], fsdp={"version": 2})
    data = plan_json(str(cfg), "--nproc", "1", "--strategies", "NO_SHARD", "--device-memory", "1GiB")
    # smollm2-tiny: 2 layers, hidden 64, q/o 64x64, k/v 32x64, gate/up 256x64, down 64x256; r=8 adapters A (8 x in)
    # and B (out x 8) on each of the 7 linears.
    per_layer = sum(8 * i + o * 8 for o, i in [(64, 64), (32, 64), (32, 64), (64, 64), (256, 64), (256, 64), (64, 256)])
    assert data["trainable_parameters"] == 2 * per_layer == 22528
    r = data["rows"][0]
    assert r["grads"] == 22528 * 4 and r["optimizer"] == 2 * 22528 * 4
    assert r["params"] == data["parameters"] * 4


def test_a_third_party_plugin_shapes_the_plan_through_the_model_hooks(tmp_path):
    """plan builds its meta model through the same ``hfsdp_modify_model`` training runs and asks the plugins'
    ``hfsdp_before_model_load`` about each row's world: a plugin that freezes all but the last layer is planned with
    that layer's gradients and optimizer state alone, its refusal is the row's reason, what it prints stays out of
    the JSON, and plan suggests no LoRA on top of it."""
    env = base_env(PYTHONPATH=str(Path(__file__).resolve().parent / "adapter_plugin"), HF_HUB_OFFLINE="1")

    def plan_of(*args: str, **sections) -> dict:
        cfg = tiny_config(tmp_path, plugins=["hfsdp_freeze"], **sections)
        return json.loads(run_cli("plan", str(cfg), "--json", "--device-memory", "1MiB", *args, env=env).stdout)

    data = plan_of("--nproc", "1", "--strategies", "FULL_SHARD")
    # smollm2-tiny's layer: q, o 64x64, k, v 32x64, gate, up 256x64, down 64x256, two norms of 64; final norm 64
    layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 256 * 64 + 2 * 64
    assert data["trainable_parameters"] == layer + 64 == 61632
    (one,) = data["rows"]
    assert one["runs_as"] == "no wrapper" and (one["grads"], one["optimizer"]) == (61632 * 4, 2 * 61632 * 4)
    assert one["fits"] is False and "lora" not in (one["suggestion"] or ""), one["suggestion"]
    data = plan_of("--nproc", "1,2", "--strategies", "FULL_SHARD,NO_SHARD",
                   fsdp={"version": 1, "single_process": "fsdp"})
    for strategy, world in (("FULL_SHARD", 1), ("NO_SHARD", 1), ("NO_SHARD", 2)):
        assert "frozen tied embeddings under FSDP1 need 2+ shards" in row(data, strategy, world)["problem"]
    assert row(data, "FULL_SHARD", 2)["problem"] is None


def test_dpo_is_planned_with_both_completions_and_full_logits(tmp_path):
    """A DPO micro-batch of N pairs forwards 2N sequences (chosen, then rejected) and its loss computes the full
    logits (no chunked loss): planned as the plain loss on twice the rows."""
    pairs = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl")}
    (tmp_path / "dpo").mkdir(), (tmp_path / "sft").mkdir()
    dpo = tiny_config(tmp_path / "dpo", plugins=["dpo"], data=pairs, train={"per_device_batch_size": 1})
    sft = tiny_config(tmp_path / "sft", train={"per_device_batch_size": 2, "chunked_loss": False})
    rows = [row(plan_json(str(cfg), "--nproc", "2", "--strategies", "FULL_SHARD"), "FULL_SHARD", 2)
            for cfg in (dpo, sft)]
    for key in ("activations", "loss_transient", "device_peak"):
        assert rows[0][key] == rows[1][key] > 0, key
    header = run_cli("plan", str(dpo), "--nproc", "2", "--strategies", "FULL_SHARD").stdout.splitlines()[1]
    assert "micro-batch 1 x 96 tokens" in header and "loss DPO (2 sequences a row, full logits)" in header


def test_packed_micro_batches_are_planned_as_the_unpacked_tokens_in_rows_of_the_packed_length(tmp_path):
    """plugin packing (issue 51 item 3). DPO, 3 pairs of sequences of up to 96 tokens: 576 tokens, which packed
    micro-batches lay end to end in the rows that cost least, at their widest one row of all (no packing.max_len:
    the same tokens, so the same activations under sdpa, up to the rotary tables; more under eager, whose scores are
    576 x 576), or with max_len 384 in rows of 384 or of a pair (192), if longer: 2 rows of 384 (768 tokens, the
    last row padded). Rows packed before training
    (scope dataset) are planned as rows of packing.max_len, as a run whose rows are that long."""
    pairs = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl")}
    configs = {"dpo": {"plugins": ["dpo"], "data": pairs},
               "packed": {"plugins": ["dpo", "packing"], "data": pairs},
               "packed_384": {"plugins": ["dpo", "packing"], "data": pairs, "packing": {"max_len": 384}},
               "chat_packed_384": {"plugins": ["packing"], "packing": {"max_len": 384}},
               "chat_384": {"data": {"max_seq_len": 384}}}
    paths = {}
    for name, sections in configs.items():
        (tmp_path / name).mkdir()
        paths[name] = str(tiny_config(tmp_path / name, train={"per_device_batch_size": 3, "chunked_loss": False},
                                      **sections))

    def plan_of(name: str, attn: str = "sdpa") -> tuple[dict, dict]:
        data = plan_json(paths[name], "--nproc", "2", "--strategies", "FULL_SHARD", "--set",
                         f"model.attn_implementation={attn}")
        return data["micro_batch"], row(data, "FULL_SHARD", 2)

    shapes, rows = {}, {}
    for name in configs:
        shapes[name], rows[name] = plan_of(name)
    assert {k: v for k, v in shapes["dpo"].items() if k != "logits_positions_per_row"} == \
        {"rows": 6, "tokens_per_row": 96, "tokens": 576, "packing": None}
    assert shapes["packed"] == {"rows": 1, "tokens_per_row": 576, "tokens": 576, "logits_positions_per_row": 576,
                                "packing": "packed micro-batches: 6 sequences of up to 96 tokens laid end to end in "
                                           "rows of up to 576 tokens"}
    assert (shapes["packed_384"]["rows"], shapes["packed_384"]["tokens_per_row"], shapes["packed_384"]["tokens"]) \
        == (2, 384, 768)
    assert rows["packed"]["activations"] == pytest.approx(rows["dpo"]["activations"], rel=1e-3)
    assert rows["packed"]["loss_transient"] == rows["dpo"]["loss_transient"]
    assert rows["packed_384"]["activations"] == pytest.approx(rows["dpo"]["activations"] * 768 / 576, rel=1e-3)
    eager = {name: plan_of(name, "eager")[1]["activations"] for name in ("dpo", "packed")}
    assert eager["packed"] > eager["dpo"], eager
    assert shapes["chat_packed_384"] == {**shapes["chat_384"], "packing": "packed rows of up to 384 tokens"}
    assert (shapes["chat_384"]["rows"], shapes["chat_384"]["tokens_per_row"]) == (3, 384)
    for key in ("activations", "loss_transient", "device_peak"):
        assert rows["chat_packed_384"][key] == rows["chat_384"][key] > 0, key
    header = run_cli("plan", paths["packed_384"], "--nproc", "2", "--strategies", "FULL_SHARD").stdout.splitlines()[1]
    assert header.startswith("micro-batch 2 x 384 tokens (packed micro-batches: 6 sequences of up to 96 tokens "
                             "laid end to end in rows of up to 384 tokens), attention sdpa"), header


def test_the_reward_model_is_planned_with_its_head_and_without_vocabulary_logits(tmp_path):
    """plugin reward_model: the sequence-classification model (the tied LM head gone, a 1 x hidden score head) on
    both completions, one output per token instead of the vocabulary's logits."""
    pairs = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl")}
    (tmp_path / "rm").mkdir(), (tmp_path / "dpo").mkdir()
    configs = [tiny_config(tmp_path / short, plugins=[name], data=pairs, train={"per_device_batch_size": 1})
               for short, name in (("rm", "reward_model"), ("dpo", "dpo"))]
    rm, dpo = (plan_json(str(cfg), "--nproc", "2", "--strategies", "FULL_SHARD") for cfg in configs)
    assert rm["parameters"] == dpo["parameters"] + 64  # smollm2-tiny: hidden 64, tied embeddings
    a, b = row(rm, "FULL_SHARD", 2), row(dpo, "FULL_SHARD", 2)
    assert 0 < a["loss_transient"] < b["loss_transient"] / 1000, (a, b)  # 1 output per token, not 49,152


def test_one_process_is_planned_as_train_runs_it(tmp_path):
    """One process trains without a wrapper by default (fsdp.single_process: auto): plan predicts that run (whole
    state, no FSDP buffers), and FSDP only when single_process: fsdp asks for it. The unwrapped figures are the
    bytes bench_probe counts from the live tensors of a real one-process run."""
    cfg = tiny_config(tmp_path, plugins=["bench_probe"], train={"max_steps": 1})
    data = plan_json(str(cfg), "--nproc", "1,2", "--strategies", "FULL_SHARD,NO_SHARD")
    whole = data["parameters"] * 4  # float32
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        one = row(data, strategy, 1)
        assert one["runs_as"] == "no wrapper"
        assert (one["params"], one["grads"], one["optimizer"]) == (whole, whole, 2 * whole)
        # the chunked loss: the tied embedding adds its gradient into the head's, no second one
        assert one["gathered"] == 0 and one["grad_buffers"] == 0
    plain = row(plan_json(str(cfg), "--nproc", "1", "--strategies", "FULL_SHARD", "--set",
                          "train.chunked_loss=false"), "FULL_SHARD", 1)
    assert plain["grad_buffers"] == 49152 * 64 * 4  # smollm2-tiny: vocab 49152 x hidden 64, tied embeddings
    assert row(data, "FULL_SHARD", 2)["runs_as"] == "FSDP" and row(data, "NO_SHARD", 2)["runs_as"] == "DDP"
    table = run_cli("plan", str(cfg), "--nproc", "1", "--strategies", "FULL_SHARD").stdout
    assert "FULL_SHARD (no wrapper)" in table
    run_cli("train", str(cfg), env=base_env(OMP_NUM_THREADS="1"))
    live = json.loads((tmp_path / "run" / "bench_rank0.json").read_text())
    assert live["distributed_type"] == "NO"
    assert (live["param_bytes"], live["grad_bytes"], live["optim_bytes"]) == (whole, whole, 2 * whole)
    fsdp = row(plan_json(str(cfg), "--nproc", "1", "--strategies", "FULL_SHARD", "--set",
                         "fsdp.single_process=fsdp"), "FULL_SHARD", 1)
    assert fsdp["runs_as"] == "FSDP" and fsdp["gathered"] > 0


def test_a_vision_language_model_is_planned_with_the_images_its_vision_tower_runs_on(tmp_path):
    """Qwen2.5-VL-7B-Instruct from its shipped config (8.29B parameters, as its model page says): a row's image
    tokens (by default all of its data.max_seq_len) come from images its vision tower runs on, and what the tower
    keeps for the backward is in the activations (tests/test_vision.py checks the bytes against a real tower's, and
    that a frozen tower keeps none); --image-tokens sets fewer, 0 none. --image-tokens is refused for a text-only
    model and beyond a row's length."""
    (tmp_path / "vl").mkdir()
    cfg = str(hub_config(tmp_path / "vl", "Qwen/Qwen2.5-VL-7B-Instruct", max_seq_len=512))
    args = ("--nproc", "8", "--strategies", "FULL_SHARD")
    whole, none = plan_json(cfg, *args), plan_json(cfg, *args, "--image-tokens", "0")
    assert whole["parameters"] == 8_292_166_656
    images = whole["micro_batch"]
    # one image of 512 image tokens: 2048 patches of 14 x 14 pixels through 32 blocks of width 1280, in bf16
    assert (images["image_tokens_per_row"], images["images"], images["image_tokens_per_image"]) == (512, 1, 512)
    tower = images["vision_tower_saved_bytes"]
    assert 32 * 2048 * 1280 * 2 * 10 < tower < 32 * 2048 * 1280 * 2 * 60
    assert (none["micro_batch"]["images"], none["micro_batch"]["vision_tower_saved_bytes"]) == (0, 0)
    assert row(whole, "FULL_SHARD", 8)["activations"] == row(none, "FULL_SHARD", 8)["activations"] + tower
    proc = run_cli("plan", cfg, *args, "--image-tokens", "256", env=base_env(HF_HUB_OFFLINE="1"))
    assert ("images: the vision tower runs on 1 image a micro-batch of 256 image tokens each, for 256 image tokens "
            "a row (--image-tokens); what it keeps for the backward is in column activ.") in proc.stdout
    for config, more, said in [
            (str(hub_config(tmp_path, "Qwen/Qwen2.5-0.5B")), "1", "Qwen/Qwen2.5-0.5B is a text-only model"),
            (cfg, "513", "--image-tokens 513: more than a row holds (data.max_seq_len: 512)")]:
        proc = run_cli("plan", config, *args, "--image-tokens", more, check=False, env=base_env(HF_HUB_OFFLINE="1"))
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr


def test_a_hub_id_without_a_shipped_config_is_refused_without_download(tmp_path):
    proc = run_cli("plan", str(hub_config(tmp_path, "someone/unknown-model")), check=False,
                   env=base_env(HF_HUB_OFFLINE="1"))
    assert proc.returncode == 2
    assert "never downloads" in proc.stderr and "meta-llama/Llama-3.1-8B" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_plan_options_are_clear_errors(tmp_path):
    cfg = str(hub_config(tmp_path, "Qwen/Qwen2.5-0.5B"))
    for args, words in [(["--strategies", "ZERO3"], "unknown ZERO3"), (["--nproc", "two"], "--nproc"),
                        (["--device-memory", "lots"], "size 'lots'")]:
        proc = run_cli("plan", cfg, *args, check=False)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr


def test_table_and_png(tmp_path):
    png = tmp_path / "plan.png"
    proc = run_cli("plan", str(hub_config(tmp_path, "Qwen/Qwen2.5-7B")), "--nproc", "1,2,8", "--nodes", "2",
                   "--device-memory", "40GiB", "--png", str(png))
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Qwen/Qwen2.5-7B: 7.62B parameters")
    header = lines[2].split()
    assert header[:3] == ["ranks", "strategy", "params"]
    # 2 nodes: HYBRID_SHARD is listed and shards within each node of 8.
    hybrid = [line for line in lines if "HYBRID_SHARD" in line and line.strip().startswith("16")]
    assert hybrid and png.stat().st_size > 10_000


@pytest.mark.slow
def test_state_bytes_match_live_tensors_counted_by_bench(tmp_path):
    """plan's params + grads + optimizer bytes per rank equal what bench_probe counts in the running job."""
    cfg = tiny_config(tmp_path, plugins=["lora"], fsdp={"version": 1})
    out = tmp_path / "bench"
    run_cli("bench", str(cfg), "--strategies", "FULL_SHARD,SHARD_GRAD_OP", "--nproc", "2", "--steps", "2",
            "--out", str(out), timeout=900)
    measured = {r["strategy"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    data = plan_json(str(cfg), "--nproc", "2", "--strategies", "FULL_SHARD,SHARD_GRAD_OP")
    for strategy, m in measured.items():
        p = row(data, strategy, 2)
        assert (p["params"], p["grads"], p["optimizer"]) == (m["param_bytes"], m["grad_bytes"], m["optim_bytes"])


def test_the_chunked_loss_is_planned_without_the_full_logits(tmp_path):
    """Llama-3.1-8B, 2048 tokens per micro-batch, bf16: the plain loss saves a float32 log-softmax of the whole
    logits (2048 x 128,256 x 4 bytes = 1 GiB) and holds two such tensors at the end of forward; the chunked loss
    (train.chunked_loss, the default) saves none and makes each chunk's gradients (8 chunks of at most 261
    positions, 128 MiB of float32 logits each) at the end of forward: from the second chunk on, the chunk's own
    gradient of the lm_head (128,256 x 4,096 in bf16, 1 GiB) beside the sum of the chunks' before it, and the
    chunk's logits' gradient."""
    logits = 2048 * 128256 * 4
    chunk = (2**25 // 128256) * 128256 * 4
    head = 128256 * 4096 * 2
    rows = {}
    for chunked in (True, False):
        cfg = hub_config(tmp_path, "meta-llama/Llama-3.1-8B")
        rows[chunked] = row(plan_json(str(cfg), "--nproc", "8", "--strategies", "FULL_SHARD", "--set",
                                      f"train.chunked_loss={str(chunked).lower()}"), "FULL_SHARD", 8)
    assert rows[False]["loss_transient"] == 2 * logits and rows[True]["loss_transient"] == chunk + 2 * head
    # the saved log-softmax (of the 2047 positions that predict a token)
    assert rows[False]["activations"] - rows[True]["activations"] == pytest.approx(logits, rel=1e-3)
    assert rows[False]["device_peak"] - rows[True]["device_peak"] >= logits


# Mistral-7B-v0.1: embeddings and lm_head 2 x 32000 x 4096, 32 layers of (2 x 4096 x 4096 + 2 x 1024 x 4096
# + 3 x 14336 x 4096 + 2 x 4096), final norm 4096: every tensor a multiple of 256 elements, every dim 0 even.
MISTRAL_7B_PARAMS = 2 * 32000 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096) + 4096


def test_8bit_adamw_is_planned_per_shard_and_is_the_cheapest_change_where_it_fits(tmp_path):
    """8-bit AdamW keeps 2 bytes per element of each moment plus a float32 scale per 256 elements of each, and the
    two shared 256-entry maps: 65/32 bytes a parameter instead of AdamW's 8, of the rank's shard under FSDP2 (every
    shard of Mistral-7B falls on the 256-element blocks). On one 110 GB device in bf16 AdamW does not fit, and the
    cheapest change that does is the 8-bit optimizer, checked by the same estimate."""
    cfg = str(hub_config(tmp_path, "mistralai/Mistral-7B-v0.1"))
    eight = plan_json(cfg, "--nproc", "1,2", "--strategies", "FULL_SHARD", "--set", "train.optimizer=adamw_8bit",
                      "--device-memory", "110GB")
    assert MISTRAL_7B_PARAMS == 7_241_732_096 == eight["parameters"]
    assert row(eight, "FULL_SHARD", 1)["optimizer"] == MISTRAL_7B_PARAMS * 65 // 32 + 2 * 256 * 4
    assert row(eight, "FULL_SHARD", 2)["optimizer"] == MISTRAL_7B_PARAMS // 2 * 65 // 32 + 2 * 256 * 4
    plain = row(plan_json(cfg, "--nproc", "1", "--strategies", "FULL_SHARD", "--device-memory", "110GB"),
                "FULL_SHARD", 1)
    assert plain["fits"] is False and plain["optimizer"] == 8 * MISTRAL_7B_PARAMS
    fitted = row(eight, "FULL_SHARD", 1)
    assert fitted["fits"] and plain["suggestion"] == f"train.optimizer=adamw_8bit -> {fitted['device_peak'] / 2**30:.1f} GiB"


def test_grpo_is_planned_with_its_completions_and_their_kv_cache(tmp_path, tiny_model_dir):
    """plugin grpo (issue 35): the micro-batch is traced as prompts plus completions, and the sampling at each
    step's start is a moment of the peak: each rank generates the completions of its own micro-batches, so its KV
    cache does not grow with the data-parallel ranks (before, every rank sampled the global batch: 2 and 4 times
    the cache), while FSDP shards the rest. The cache the plan counts per token is the one transformers' generate
    holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfsdp.tools.plan.facts import kv_elements_per_token

    prompts = {"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"), "max_seq_len": 96}
    cfg = tiny_config(tmp_path, plugins=["grpo"], data=prompts,
                      grpo={"num_generations": 4, "max_new_tokens": 32, "rewards": [{"name": "json_fields"}]},
                      train={"per_device_batch_size": 8})
    data = plan_json(str(cfg), "--nproc", "1,2,4", "--strategies", "FULL_SHARD")
    two, four = row(data, "FULL_SHARD", 2), row(data, "FULL_SHARD", 4)
    assert 0 < two["generation"] == four["generation"], (two, four)  # a rank's share is its micro-batches
    assert four["params"] < two["params"]  # while the parameters shard
    for r in (two, four):
        assert r["device_peak"] >= r["params"] + r["optimizer"] + r["generation"]
    header = run_cli("plan", str(cfg), "--nproc", "2", "--strategies", "FULL_SHARD").stdout
    assert "micro-batch 8 x 128 tokens" in header and "sampling at each step's start" in header, header
    # fsdp.gather_for_generation (the default) gathers the whole model for sampling, in float32 here; without it
    # FSDP2 gathers a unit at a time, as a forward does
    per_layer = row(plan_json(str(cfg), "--nproc", "2", "--strategies", "FULL_SHARD", "--set",
                              "fsdp.gather_for_generation=false"), "FULL_SHARD", 2)
    assert two["generation"] - per_layer["generation"] == 4 * data["parameters"] - two["gathered"], (two, per_layer)

    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = torch.randint(0, 1000, (3, 11))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    assert held == kv_elements_per_token(config) * 3 * (11 + 5 - 1) * 4  # the last token's keys are never made


def test_the_workers_engines_generation_processes_are_counted_beside_the_ranks(tmp_path, tiny_model_dir):
    """grpo.generation.engine workers (issue 70): the header counts the shared weights of the generation processes
    (the frozen parameters once, LoRA's adapters in max_staleness + 1 slots) and a process's KV cache per
    completion, as the engine allocates them."""
    import re

    from hfsdp.tools.plan.facts import kv_elements_per_token
    from transformers import AutoConfig

    prompts = {"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"), "max_seq_len": 96}
    cfg = tiny_config(tmp_path, plugins=["grpo", "lora"], data=prompts,
                      grpo={"num_generations": 4, "max_new_tokens": 32, "rewards": [{"name": "json_fields"}],
                            "generation": {"engine": "workers", "max_staleness": 2, "processes": 2}},
                      train={"per_device_batch_size": 8})
    data = plan_json(str(cfg), "--nproc", "1", "--strategies", "FULL_SHARD")
    header = run_cli("plan", str(cfg), "--nproc", "1", "--strategies", "FULL_SHARD").stdout
    said = re.search(r"generation processes \(workers engine, on the CPU of the first rank's host, not in the "
                     r"columns\): 2 beside the ranks; shared weights (.+) \(frozen (.+) once, trainable (.+) x 3 "
                     r"slots\); each process's KV cache (.+) per completion", header)
    assert said, header

    def mib(text: str) -> float:
        value, unit = text.split()
        return float(value) * (1024 if unit == "GiB" else 1)

    shared, frozen, slot, kv = map(mib, said.groups())
    assert slot == pytest.approx(data["trainable_parameters"] * 4 / 2 ** 20, abs=0.01)
    assert frozen == pytest.approx((data["parameters"] - data["trainable_parameters"]) * 4 / 2 ** 20, abs=0.01)
    assert shared == pytest.approx(frozen + 3 * slot, abs=0.02)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert kv == pytest.approx(kv_elements_per_token(config) * (96 + 32) * 4 / 2 ** 20, abs=0.01)
    assert "generation processes" not in run_cli("plan", str(cfg), "--nproc", "1", "--set",
                                                  "grpo.generation.engine=inline").stdout


def test_expert_parallel_rows_say_a_ranks_experts_and_the_tokens_they_exchange(tmp_path):
    """``hfsdp plan --ep`` of Qwen3-30B-A3B (48 MoE layers of 128 experts, top 8, hidden 2048) on 8 ranks: at ep 8
    a rank holds 16 experts of a layer, whole (the same parameter bytes as FSDP2's 1/8 of each of the 128), so
    FSDP gathers 7/8 less of each layer's experts and moves none of them; the all-to-alls send each token's hidden
    state to its 8 experts and back, forward and backward, 7/8 of it off the rank."""
    config = hub_config(tmp_path, "Qwen/Qwen3-30B-A3B", version=2)
    data = plan_json(str(config), "--nproc", "8", "--ep", "1,8", "--strategies", "FULL_SHARD")
    plain, split = (next(r for r in data["rows"] if r["ep_size"] == ep) for ep in (1, 8))
    assert (plain["experts_per_rank"], split["experts_per_rank"]) == (128, 16)
    assert (split["params"], split["grads"], split["optimizer"]) == (plain["params"], plain["grads"],
                                                                      plain["optimizer"])
    experts_per_layer = 128 * 3 * 768 * 2048  # gate_up_proj and down_proj, in bf16 when gathered
    assert plain["gathered"] - split["gathered"] == 2 * experts_per_layer * 2 * 7 // 8  # a layer and its prefetch
    tokens = data["micro_batch"]["tokens"]
    assert plain["ep_comm"] == 0 and split["ep_comm"] == 2 * 2 * (48 * 8 * 2048) * tokens * 2 * 7 // 8
    assert split["fsdp_comm"] < plain["fsdp_comm"] and split["device_peak"] <= plain["device_peak"]
    table = run_cli("plan", str(config), "--nproc", "8", "--ep", "1,8", "--strategies", "FULL_SHARD",
                    env=base_env(HF_HUB_OFFLINE="1")).stdout
    lines = [line for line in table.splitlines() if "FULL_SHARD" in line]
    assert "experts/rank" in table and lines[1].startswith("8 ep8") and "  16  " in lines[1]


def test_a_float32_mixture_of_experts_is_planned(tmp_path):
    """The tiny Qwen3-MoE in float32 with its grouped experts: torch's meta kernel of grouped_mm takes bfloat16
    only, and the trace stopped there (RuntimeError: Expected inputs of BF16 type); it is traced as the CPU kernel
    runs it, saving its inputs, so a layer's activations are more than a dense layer of its width would save."""
    from conftest import tiny_moe_folder

    config = tiny_config(tmp_path, model={"name_or_path": str(tiny_moe_folder("qwen3_moe"))})
    data = plan_json(str(config), "--nproc", "2", "--strategies", "FULL_SHARD", "--ep", "1,2")
    assert [(r["ep_size"], r["experts_per_rank"], r["problem"]) for r in data["rows"]] == [(1, 8, None), (2, 4, None)]
    assert all(r["activations"] > 0 and r["fits"] for r in data["rows"])
