"""Bad inputs through the real CLI: each gives exit 2, one message that says what is wrong (and where), and no
traceback. The cases run two at a time in one module fixture, each in a process of its own forked after the heavy
imports (tests/fork_server.py, behind conftest.run_cli); each is then its own test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest

from conftest import PRESET_DATA, base_env, run_cli, tiny_config
from hfsdp.checkpoint import store as checkpoint
from hfsdp.rules.table import load_checked
from hfsdp.setup.record import run_fingerprint

pytestmark = pytest.mark.slow

CHAT = PRESET_DATA / "contacts_train.jsonl"


def _cfg(case: Path, **sections) -> str:
    return str(tiny_config(case, **sections))


def _fake_checkpoint(run: Path, config: str, *, world_size: int = 1, complete: bool = True, **record) -> Path:
    """A checkpoint folder whose record matches ``config`` (only the record is read before the refusal)."""
    ckpt = run / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    if complete:
        cfg, _ = load_checked(config)
        (ckpt / checkpoint.RECORD).write_text(json.dumps(
            {"step": 2, "world_size": world_size,
             "config_hash": run_fingerprint(cfg), **record}))
    return ckpt


def _resuming(case: Path, *args: str, **record) -> list[str]:
    """``train CONFIG --resume ARGS`` of a run whose checkpoint has this ``record`` (and the config's hash)."""
    config = _cfg(case)
    _fake_checkpoint(case / "run", config, **record)
    return ["train", config, "--resume", *args]


def _cut(line: int, then: bytes = b"") -> bytes:
    """The bundled chat rows with line ``line`` (counted from 1) cut short in a string, followed by ``then``."""
    lines = CHAT.read_bytes().splitlines(keepends=True)[:20]
    cut = lines[line - 1][:lines[line - 1].index(b'"content": "') + 20] + then + b"\n"
    return b"".join(lines[:line - 1]) + cut + b"".join(lines[line:])


def _after(_made, argv: list[str]) -> list[str]:
    """``argv``, once the file or folder the case needs is made (the first argument)."""
    return argv


def _folder(path: Path) -> str:
    path.mkdir(parents=True)
    return str(path)


def _write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


# Each case: id -> (setup(case_dir, shared) -> argv, expected message substring). ``shared`` holds the tiny
# model folder and a copy of it without a chat template.
Case = tuple[Callable[[Path, dict], list[str]], str]
CASES: dict[str, Case] = {
    # --- config (reported before anything heavy is imported)
    "unknown key": (lambda d, s: ["train", _cfg(d, train={"max_stepz": 2})], "train.max_stepz: unknown key"),
    "wrong type": (lambda d, s: ["train", _cfg(d, train={"per_device_batch_size": "two"})],
                   "train.per_device_batch_size: Input should be a valid integer"),
    "bad enum": (lambda d, s: ["train", _cfg(d, fsdp={"sharding_strategy": "ZeRO-3"})],
                 "fsdp.sharding_strategy: Input should be 'FULL_SHARD'"),
    "lora target not in the model": (lambda d, s: ["train", _cfg(d, plugins=["lora"],
                                                                 lora={"target_modules": ["qkv_proj"]})],
                                     "lora.target_modules: Target modules {'qkv_proj'} not found in the base model"),
    "lora on tied embeddings": (lambda d, s: ["train", _cfg(d, plugins=["lora"], lora={"modules_to_save": ["lm_head"]})],
                                "lm_head is tied to the output embeddings of this model"),
    "fsdp1 knob on fsdp2": (lambda d, s: ["train", _cfg(d, fsdp={"forward_prefetch": True})],
                            "forward_prefetch only exist in FSDP1"),
    "size policy without min_num_params": (lambda d, s: ["train", _cfg(d, fsdp={"wrap_policy": "size"})],
                                           "wrap_policy 'size' needs fsdp.min_num_params"),
    "two eval sources": (lambda d, s: ["train", _cfg(d, data={"eval_split": "test"})],
                         "set only one of eval_path, eval_split, eval_fraction"),
    "missing config file": (lambda d, s: ["train", str(d / "nope.yaml")], "config file not found"),
    "malformed yaml": (lambda d, s: ["train", _write(d / "c.yaml", "model: {name_or_path: x\ntrain: [\n")],
                       "malformed YAML at line"),
    "--set wrong type": (lambda d, s: ["train", _cfg(d), "--set", "train.max_steps=abc"],
                         "hfsdp: error: --set: 1 problem(s)\n  train.max_steps: Input should be a valid integer, "
                         "unable to parse string as an integer (got 'abc')"),
    "--set wrong type beside the file's own problem": (
        lambda d, s: ["train", _cfg(d, train={"per_device_batch_size": "two"}), "--set", "train.max_steps=abc"],
        "config.yaml: 2 problem(s)\n  train.max_steps (--set train.max_steps=abc): Input should be a valid integer"),
    "a misspelt built-in model": (lambda d, s: ["validate", _cfg(d, model={"name_or_path": "smollm2-135m-instuct"}),
                                                "--no-rows"],
                                  "model.name_or_path: 'smollm2-135m-instuct' is not a built-in model: did you mean "
                                  "smollm2-135m-instruct?"),
    "a hub model offline": (lambda d, s: ["train", _cfg(d, model={"name_or_path": "someone/a-model"})],
                            "model.name_or_path: 'someone/a-model' is a hub id that is not in the local Hugging Face "
                            "cache, and the hub cannot be reached (HF_HUB_OFFLINE is set)"),
    "--set without value": (lambda d, s: ["train", _cfg(d), "--set", "train.max_steps"], "overrides look like --set"),
    "unknown plugin": (lambda d, s: ["train", _cfg(d, plugins=["nonexistent_plugin_xyz"])],
                       "'nonexistent_plugin_xyz' is neither an installed plugin nor an importable module"),
    "unknown format": (lambda d, s: ["train", _cfg(d, data={"format": "sharegpt"})], "unknown format 'sharegpt'"),
    "plugin section, plugin not enabled": (lambda d, s: ["train", _cfg(d, packing={})],
                                           "packing: section of plugin 'packing', which is not enabled: enable plugin 'packing'"),
    # --- data
    "missing dataset file": (lambda d, s: ["train", _cfg(d, data={"path": str(d / "nope.jsonl")})], "does not exist"),
    "unsupported file type": (lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.docx", "x"),
                                                                  "eval_path": None})],
                              "hfsdp reads .txt, .text, .json, .jsonl, .csv, .parquet files, not '.docx'"),
    "unreadable parquet": (lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.parquet", b"\x00garbage" * 64),
                                                               "eval_path": None})],
                           "data: {d}/rows.parquet: not a Parquet file pyarrow can read (Parquet magic bytes not found"),
    "malformed jsonl": (lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.jsonl", '{"messages": [\n'),
                                                            "eval_path": None})],
                        "data: {d}/rows.jsonl, line 1: Expecting value (column 15): the line ends inside a value, it "
                        "may be cut short; fix or remove that line"),
    # pyarrow said "JSON parse error: Missing a closing quotation mark in string. in row 11" for line 13
    "a jsonl line cut short": (lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.jsonl", _cut(13)),
                                                                   "eval_path": None})],
                               "data: {d}/rows.jsonl, line 13: Unterminated string starting at"),
    # ... and "Invalid encoding in string. in row 12" for a line 13 cut inside a character
    "a jsonl line cut inside a character": (
        lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.jsonl", _cut(13, "é".encode()[:1])),
                                             "eval_path": None})],
        "data: {d}/rows.jsonl, line 13: not UTF-8 text (byte 0xc3 at column "),
    "a csv row with an extra field": (lambda d, s: ["train", _cfg(d, data={"path": _write(
        d / "rows.csv", "prompt,completion\nhi,there\nhello,world,again\n"), "format": "instruction",
        "eval_path": None})], "data: {d}/rows.csv, line 3: 3 field(s), and the header (line 1) has 2"),
    "a json document that stops parsing": (lambda d, s: ["train", _cfg(d, data={"path": _write(
        d / "rows.json", '[\n{"prompt": "a", "completion": "b"},\n{"prompt": "c" "completion": "d"}\n]\n'),
        "format": "instruction", "eval_path": None})], "data: {d}/rows.json, line 3: Expecting ',' delimiter"),
    "empty dataset": (lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.jsonl", "\n"), "eval_path": None})],
                      "is empty (no rows to train on)"),
    "every sample too long (drop)": (lambda d, s: ["train", _cfg(d, data={"max_seq_len": 8, "too_long": "drop"})],
                                     "no train rows left after tokenization"),
    "every answer cut off (truncate)": (lambda d, s: ["train", _cfg(d, data={"max_seq_len": 8})],
                                        "raise data.max_seq_len (8): a truncated row keeps only the labelled tokens"),
    "chat data, tokenizer without template": (
        lambda d, s: ["train", _cfg(d, model={"name_or_path": s["no_template"]})],
        "chat data needs a chat template; this tokenizer has none: set data.chat_template"),
    "chat rows without roles": (lambda d, s: ["train", _cfg(d, data={
        "path": _write(d / "rows.jsonl", '{"messages": [{"content": "hi"}, {"content": "yo"}]}\n'), "eval_path": None})],
        "data.format 'chat': row 0 (counting from 0): message 0 has the keys ['content'], not role/content or "
        "from/value: set data.message_keys"),
    # ... and validate finds it first (issue 27: validate passed and train failed in tokenisation)
    "chat rows without roles, validate": (lambda d, s: ["validate", _cfg(d, data={
        "path": _write(d / "rows.jsonl", '{"messages": [{"content": "hi"}, {"content": "yo"}]}\n'), "eval_path": None})],
        "line 1 of "),
    "text format, wrong column": (lambda d, s: ["train", _cfg(d, data={"format": "text"})],
                                  "data.text_field: column 'text' not found"),
    "instruction format, chat rows": (lambda d, s: ["train", _cfg(d, data={"format": "instruction"})],
                                      "instruction data needs columns instruction, output"),
    "eval_fraction of one row": (lambda d, s: ["train", _cfg(d, data={
        "path": _write(d / "one.jsonl", json.dumps({"text": "a"}) + "\n"), "format": "text", "eval_path": None,
        "eval_fraction": 0.5})], "too few to hold some out"),
    # --- data.datasets mixtures and shards
    "mixture weight zero": (lambda d, s: ["train", _mixture(d, {"path": str(CHAT), "weight": 0})],
                            "data.datasets[0].weight: 0; it must be more than 0"),
    "mixture weight negative": (lambda d, s: ["validate", _mixture(d, {"path": str(CHAT), "weight": 1},
                                                             {"path": str(CHAT), "weight": -2})],
                                "data.datasets[1].weight: -2; it must be more than 0"),
    "mixture source missing": (lambda d, s: ["train", _mixture(d, {"path": str(CHAT)}, {"path": str(d / "no.jsonl")})],
                               "data.datasets[1].path: {d}/no.jsonl does not exist"),
    "mixture of incompatible formats": (
        lambda d, s: ["train", _mixture(d, {"path": str(CHAT)}, {"path": str(CHAT), "format": "paired"},
                                        plugins=[_write_plugin(d)])],
        "data.datasets[1] gives the columns ['input_ids', 'labels', 'pair_ids'], data.datasets[0] gives"),
    "mixture of incompatible formats, validate": (
        lambda d, s: ["validate", _mixture(d, {"path": str(CHAT)}, {"path": str(CHAT), "format": "paired"},
                                           plugins=[_write_plugin(d)])],
        "data.datasets[1] gives the columns ['input_ids', 'labels', 'pair_ids'], data.datasets[0] gives"),
    "empty shard": (lambda d, s: ["train", _mixture(d, {"path": str(_shards(d, ["{}\n", ""]) / "*.jsonl")})],
                    "data.datasets[0].path: the shard {d}/shards/part-1.jsonl is empty (no rows)"),
    # --- model, world, output folder, resume, export
    "distill teacher does not exist": (
        lambda d, s: ["train", _cfg(d, plugins=["distill"], distill={"teacher": str(d / "no-teacher")})],
        "distill.teacher: {d}/no-teacher does not exist"),
    "distill teacher does not exist, plan": (
        lambda d, s: ["plan", _cfg(d, plugins=["distill"], distill={"teacher": str(d / "no-teacher")}), "--nproc", "2"],
        "distill.teacher: '{d}/no-teacher' is neither a built-in model, a local folder, nor a hub id"),
    "model path does not exist": (lambda d, s: ["train", _cfg(d, model={"name_or_path": str(d / "no-model")})],
                                  "model.name_or_path: " + "{d}/no-model does not exist"),
    "model folder without config.json": (
        lambda d, s: ["train", _cfg(d, model={"name_or_path": _folder(d / "empty-model")})],
        "exists but has no config.json"),
    "hybrid shard size does not divide world": (  # FSDP on one process (unwrapped, a cluster config runs)
        lambda d, s: ["train", _cfg(d, fsdp={"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2,
                                             "single_process": "fsdp"})],
        "2 ranks per shard group does not divide the world size 1"),
    "gpu-only option in cpu rehearsal": (lambda d, s: ["train", _cfg(d, fsdp={"cpu_offload": True})],
                                         "fsdp.cpu_offload: needs a GPU"),
    "output folder holds another run": (
        lambda d, s: _after(_write(d / "run" / "metrics.jsonl", "{}\n"), ["train", _cfg(d)]),
        "already holds a run (metrics.jsonl). Pass --resume to continue it, --overwrite to replace it"),
    "resume from an incomplete folder": (
        lambda d, s: ["train", _cfg(d), "--resume", str(_fake_checkpoint(d / "other", _cfg(d), complete=False))],
        "is not a complete hfsdp checkpoint (no hfsdp_checkpoint.json)"),
    "resume with a changed config key": (
        lambda d, s: _resuming(d, "--set", "train.learning_rate=0.1"),
        "the config changed in keys that change the run"),
    "resume on another world size": (
        lambda d, s: _resuming(d, world_size=2),
        "it was saved on 2 rank(s), this run has 1"),
    "resume on a world size that cannot keep the global batch": (
        lambda d, s: _resuming(d, world_size=3, global_batch=3),
        "its global batch is 3 samples per step and 2 per device x 1 accumulation x 1 ranks makes 2; set one of: "
        "per_device_batch_size 1 with gradient_accumulation_steps 3; per_device_batch_size 3 with "
        "gradient_accumulation_steps 1"),
    "export an incomplete checkpoint": (
        lambda d, s: ["export", str(_fake_checkpoint(d / "run", _cfg(d), complete=False)), str(d / "out")],
        "is not a complete hfsdp checkpoint"),
    # --- issue 15: config files that are not YAML text, keys that would do something else than they say
    "binary config file": (lambda d, s: ["train", _write(d / "c.yaml", b"\x89PNG\r\n\x1a\n\x00\xff\xfe")],
                           "not a text file: byte 0 is not UTF-8"),
    "config path is a folder": (lambda d, s: ["train", str(d)], "is a folder, not a config file"),
    "config with a NUL character": (lambda d, s: ["train", _write(d / "c.yaml", "model:\x00 x\n")], "malformed YAML"),
    "train.compile under FSDP1": (lambda d, s: ["train", _cfg(d, train={"compile": True}, fsdp={"version": 1})],
                                  "train.compile: FSDP1 flattens each unit's parameters into one"),
    # --- issue 24: asynchronous saves write SHARDED checkpoints of a model FSDP wraps
    "train.async_save with FULL_STATE_DICT": (
        lambda d, s: ["train", _cfg(d, train={"async_save": True}, fsdp={"state_dict_type": "FULL_STATE_DICT"})],
        "train.async_save: writes SHARDED_STATE_DICT checkpoints (per-rank shards) in the background"),
    "train.async_save under FSDP1": (
        lambda d, s: ["train", _cfg(d, train={"async_save": True}, fsdp={"version": 1, "single_process": "fsdp"})],
        "train.async_save: FSDP1's sharded state dict holds ShardedTensors"),
    "train.async_save on one process without a wrapper": (
        lambda d, s: ["train", _cfg(d, train={"async_save": True})],
        "train.async_save: one process runs the model without FSDP (fsdp.single_process: auto)"),
    "fsdp2 with a buffer dtype": (
        lambda d, s: ["train", _cfg(d, fsdp={"mixed_precision": {"param": "bf16", "buffer": "bf16"}})],
        "fsdp.mixed_precision.buffer: bfloat16: only FSDP1 casts buffers"),
    "NO_SHARD as DDP with a reduce dtype": (
        lambda d, s: ["train", _cfg(d, fsdp={"sharding_strategy": "NO_SHARD",
                                             "mixed_precision": {"param": "bf16", "reduce": "bf16"}})],
        "runs as DDP, which reduces gradients in float32"),
    "NO_SHARD as DDP with cpu_ram_efficient_loading": (
        lambda d, s: ["train", _cfg(d, fsdp={"sharding_strategy": "NO_SHARD", "cpu_ram_efficient_loading": True})],
        "loads the weights on every rank (no cpu_ram_efficient_loading)"),
    "generation_eval on the text format": (
        lambda d, s: ["train", _cfg(d, data={"format": "text", "path": _write(d / "t.txt", "a b c\n\nd e f\n"),
                                             "eval_path": None}, generation_eval={})],
        "generation_eval: needs data.format chat or instruction"),
    # --- --set values
    "--set a section to a scalar": (lambda d, s: ["train", _cfg(d), "--set", "train=5"],
                                    "train: Input should be a valid dictionary"),
    "--set below a scalar": (lambda d, s: ["train", _cfg(d), "--set", "train.max_steps.x=1"],
                             "'max_steps' is not a section"),
    "--set with an empty key": (lambda d, s: ["train", _cfg(d), "--set", "=3"], "overrides look like --set"),
    "--set an unknown section": (lambda d, s: ["train", _cfg(d), "--set", "trainer.steps=1"], "unknown section"),
    # --- data files and rows
    "relative data path missing next to the config": (
        lambda d, s: _after(_write(d / "rows.jsonl", CHAT.read_text()),  # in the working directory, not next to
                            ["train", str(tiny_config(Path(_folder(d / "sub")), data={"path": "rows.jsonl"}))]),  # it
        "data.path: {d}/sub/rows.jsonl does not exist (a relative path in a config file is taken from the config "
        "file's folder"),
    "chat rows whose messages are not a list": (
        lambda d, s: ["train", _cfg(d, data={"path": _write(d / "rows.jsonl", '{"messages": "hello"}\n'),
                                             "eval_path": None})],
        "data.format 'chat': row 0 (counting from 0): the messages are str, not a list of messages"),
    "text file that is not UTF-8": (
        lambda d, s: ["train", _cfg(d, data={"format": "text", "path": _write(d / "t.txt", b"\xff\xfe\x00abc" * 50),
                                             "eval_path": None})],
        "data: {d}/t.txt, line 1: not UTF-8 text (byte 0xff at column 1"),
    "chat eval row without an assistant turn": (
        lambda d, s: ["train", _cfg(d, data={"eval_path": _write(d / "eval.jsonl", CHAT.read_text().splitlines()[0]
                                                 + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
                                                 + "\n")}, generation_eval={"num_samples": 2})],
        "generation_eval: eval row 1 has no assistant turn"),
    # --- model folders
    "model config.json is not JSON": (
        lambda d, s: ["train", _cfg(d, model={"name_or_path": str(_model_copy(s, d, {"config.json": "{"}))})],
        "model.name_or_path: cannot load the config of"),
    "model config.json of an unknown model_type": (
        lambda d, s: ["train", _cfg(d, model={"name_or_path": str(_model_copy(
            s, d, {"config.json": json.dumps({"model_type": "no-such-architecture"})}))})],
        "model.name_or_path: cannot load the config of"),
    "model folder without weights": (
        lambda d, s: ["train", _cfg(d, model={"name_or_path": str(_model_copy(s, d, {"model.safetensors": None}))})],
        "model.name_or_path: cannot load the weights of"),
    "model weights file damaged": (
        lambda d, s: ["train", _cfg(d, model={"name_or_path": str(_model_copy(s, d, {"model.safetensors": b"\x00" * 64}))})],
        "model.name_or_path: cannot load the weights of"),
    # --- QLoRA (model.quantization)
    "qlora without the lora plugin": (lambda d, s: ["train", _cfg(d, model={"quantization": {"bits": 4}})],
                                      "a 4-bit base cannot be trained in full"),
    "qlora storage that FSDP would cast": (
        lambda d, s: ["train", _cfg(d, plugins=["lora"], model={"quantization": {"bits": 4, "quant_storage": "bf16"}},
                                    fsdp={"mixed_precision": "fp16"})],
        "bfloat16: FSDP2 gathers floating-point parameters in float16"),
    "qlora under fsdp1": (lambda d, s: ["train", _cfg(d, plugins=["lora"], model={"quantization": {"bits": 4}},
                                                      fsdp={"version": 1})], "QLoRA runs under FSDP2 only"),
    "qlora 8-bit with a 4-bit option": (
        lambda d, s: ["train", _cfg(d, plugins=["lora"], model={"quantization": {"bits": 8, "quant_type": "nf4"}})],
        "bits 8 is not supported: bitsandbytes' 8-bit weights keep their scales on the parameter"),
    "qlora without bitsandbytes installed": (
        lambda d, s: ["train", _cfg(d, plugins=["lora"], model={"quantization": {"bits": 4}})],
        "needs bitsandbytes, which is not installed: pip install 'bitsandbytes==0.50.2'"),
    "qlora merged export of a base not in the cache": (
        lambda d, s: ["export", str(_with_config(_fake_checkpoint(d / "run", _cfg(
            d, plugins=["lora"], model={"name_or_path": "acme/llama-not-downloaded", "quantization": {"bits": 4}})),
            d)), str(d / "out"), "--merge-lora"],
        "'acme/llama-not-downloaded' is not in the local Hugging Face cache"),
    # --- train.optimizer, train.optimizer_args (hfsdp.run.optimizers)
    "optimizer unknown": (lambda d, s: ["train", _cfg(d, train={"optimizer": "adam"})],
                          "train.optimizer: Input should be 'adamw', 'adamw_8bit', 'adafactor', 'muon', "
                          "'schedule_free_adamw' or 'sgd' (got 'adam')"),
    "optimizer argument it does not take": (
        lambda d, s: ["train", _cfg(d, train={"optimizer_args": {"momentum": 0.9}})],
        "train.optimizer_args.momentum: unknown argument of adamw (torch.optim.AdamW); it takes: amsgrad, maximize, "
        "foreach, capturable, differentiable, fused"),
    "optimizer argument that a train key sets": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "muon", "optimizer_args": {"betas": [0.9, 0.95]}})],
        "train.optimizer_args.betas: set by train.adam_beta1 and train.adam_beta2: remove it from optimizer_args"),
    "optimizer argument value it refuses": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "sgd", "optimizer_args": {"momentum": -1}})],
        "train.optimizer_args: sgd refuses them: Invalid momentum value: -1"),
    "schedule-free with an LR schedule": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "schedule_free_adamw", "lr_scheduler": "cosine"})],
        "train.lr_scheduler: cosine: schedule-free AdamW replaces the LR schedule"),
    "muon under fsdp1": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "muon"}, fsdp={"version": 1, "single_process": "fsdp"})],
        "train.optimizer: muon cannot run under FSDP1: it orthogonalises each whole matrix"),
    "8-bit adamw under fsdp1": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "adamw_8bit"}, fsdp={"version": 1, "single_process": "fsdp"})],
        "train.optimizer: adamw_8bit cannot run under FSDP1: its moments are quantized in blocks of each parameter"),
    "adafactor under fsdp1": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "adafactor"}, fsdp={"version": 1, "single_process": "fsdp"})],
        "train.optimizer: adafactor cannot run under FSDP1: it factors each matrix's second moment into its rows"),
    "8-bit adamw without bitsandbytes installed": (
        lambda d, s: ["train", _cfg(d, train={"optimizer": "adamw_8bit"})],
        "train.optimizer: adamw_8bit needs bitsandbytes, which is not installed: pip install 'bitsandbytes==0.50.2' "
        "(or pip install 'hfsdp[optimizers]')"),
    # --- output and checkpoint paths, resume and export arguments
    "output_dir is an existing file": (
        lambda d, s: ["train", _cfg(d, train={"output_dir": _write(d / "out", "not a folder")})],
        "train.output_dir {d}/out: {d}/out is a file, not a folder"),
    "output_dir below a file": (
        lambda d, s: ["train", _cfg(d, train={"output_dir": str(Path(_write(d / "out", "x")) / "run")})],
        "train.output_dir {d}/out/run: {d}/out is a file, not a folder"),
    "resume from a path that does not exist": (lambda d, s: ["train", _cfg(d), "--resume", str(d / "nope")],
                                               "{d}/nope does not exist; name a checkpoint folder"),
    "resume from a damaged record": (
        lambda d, s: ["train", _cfg(d), "--resume", str(_damaged(_fake_checkpoint(d / "other", _cfg(d))))],
        "hfsdp_checkpoint.json is damaged (not a JSON record"),
    "export a checkpoint that does not exist": (lambda d, s: ["export", str(d / "nope"), str(d / "out")],
                                                "{d}/nope does not exist; name a checkpoint folder"),
    "export a run folder instead of one of its checkpoints": (
        lambda d, s: _after(_fake_checkpoint(d / "run", _cfg(d)), ["export", str(d / "run"), str(d / "out")]),
        "it is a run folder: name one of its checkpoints, e.g. the latest, {d}/run/checkpoints/step-2"),
    "export a model folder": (lambda d, s: ["export", s["model"], str(d / "out")],
                              "it is a model folder (config.json), already consolidated"),
    "export with a bad --max-shard-size": (
        lambda d, s: ["export", str(d / "nope"), str(d / "out"), "--max-shard-size", "lots"], "size 'lots'"),
    "export --set of an unknown key": (
        lambda d, s: ["export", str(_with_config(_fake_checkpoint(d / "run", _cfg(d)), d)), str(d / "out"),
                      "--set", "train.max_stepz=1"],
        "train.max_stepz: unknown key"),
    # --- preference tuning (plugin dpo, format preference): refused before any weight loads
    "preference row with an empty chosen": (
        lambda d, s: ["train", _pref(d, [{"prompt": "Q: 1+1?", "chosen": "", "rejected": " 3"}])],
        "row 1 (counting from 0): the chosen completion is empty"),
    "preference row without a rejected": (
        lambda d, s: ["train", _pref(d, [{"prompt": "Q: 1+1?", "chosen": " 2"}])],
        "row 1 (counting from 0): the rejected completion is missing"),
    "preference row with chosen equal to rejected": (
        lambda d, s: ["train", _pref(d, [{"prompt": "Q: 1+1?", "chosen": " 2", "rejected": " 2"}])],
        "row 1 (counting from 0): chosen and rejected are the same"),
    "preference prompt that fills max_seq_len": (
        lambda d, s: ["train", _pref(d, [{"prompt": "Q: what is one plus one, twice? " * 4, "chosen": " 4",
                                          "rejected": " 3"}], max_seq_len=16)],
        "row 1 (counting from 0): the prompt has 41 tokens and fills data.max_seq_len (16)"),
    "dpo without a reference route": (
        lambda d, s: ["train", _pref(d, [], dpo={"reference": "adapter"})],
        "dpo.reference: adapter: the reference is the base model with the LoRA adapters disabled, but lora is not "
        "enabled"),
    "preference rows packed before training": (
        lambda d, s: ["train", _pref(d, [], plugins=["dpo", "packing"], packing={"scope": "dataset"})],
        "packing.scope: preference rows are scored whole (a pair side by side, a row beside its KL row, a prompt's "
        "completions): they pack per micro-batch; set packing.scope: micro_batch or leave it out"),
    "dpo on chat rows": (lambda d, s: ["train", _cfg(d, plugins=["dpo"])],
                         "data.format: dpo trains on preference rows (prompt, chosen, rejected), not 'chat'"),
    "preference rows without a preference objective": (lambda d, s: ["train", _pref(d, [], plugins=[])],
                                                       "data.format: preference rows train a preference objective"),
    "prompt row without a prompt": (lambda d, s: ["train", _prompts(d, [{"answer": "{}"}])],
                                    "row 1 (counting from 0): the prompt is missing"),
    "prompt rows without grpo": (lambda d, s: ["train", _prompts(d, [], plugins=[])],
                                 "data.format: prompt rows (without answers) train an objective that generates"),
    "grpo unknown reward": (lambda d, s: ["train", _prompts(d, [], rewards=[{"name": "brevity"}])],
                            "grpo.rewards[0].name: unknown reward 'brevity' (offered by the enabled plugins: "
                            "contact_answer, json_fields, tool_call)"),
    "grpo reward module missing": (lambda d, s: ["train", _prompts(d, [], rewards=[{"name": "mypkg.rewards:brevity"}])],
                                   "grpo.rewards[0].name: 'mypkg.rewards:brevity': cannot import module 'mypkg.rewards'"),
    "grpo group not dividing the batch": (
        lambda d, s: ["train", _prompts(d, [], num_generations=3)],
        "grpo.num_generations: 3 does not divide train.per_device_batch_size (2), which counts completions"),
    "grpo beta without a reference": (lambda d, s: ["train", _prompts(d, [], beta=0.1)],
                                      "grpo.beta: the KL reference is the base model with the LoRA adapters disabled"),
    "grpo reward timeout not below the collective timeout": (
        lambda d, s: ["train", _prompts(d, [], reward_timeout_s=600)],
        "grpo.reward_timeout_s: 600 s is not below train.collective_timeout_s (600 s): the other ranks, waiting for "
        "this rank's rewards, would time out first"),
    "grpo on chat rows": (lambda d, s: ["train", _cfg(d, plugins=["grpo"], data={"eval_path": None},
                                                      grpo={"rewards": [{"name": "json_fields"}]})],
                          "data.format: grpo generates completions of prompts: set data.format: prompt"),
    "orpo on chat rows": (lambda d, s: ["train", _cfg(d, plugins=["orpo"])],
                          "data.format: orpo trains on preference rows (prompt, chosen, rejected), not 'chat'"),
    "reward model on chat rows": (lambda d, s: ["train", _cfg(d, plugins=["reward_model"])],
                                  "data.format: reward_model trains on preference rows (prompt, chosen, rejected)"),
    "reward model with lora": (lambda d, s: ["train", _pref(d, [], plugins=["reward_model", "lora"])],
                               "plugins: reward_model trains the whole model and its score head"),
    "reward model margin not a number": (
        lambda d, s: ["train", _cfg(d, plugins=["reward_model"], reward_model={"margin": True},
                                    data={"format": "preference", "eval_path": None, "path": _write(
                                        d / "margins.jsonl", json.dumps({**PAIR, "margin": 1.5}) + "\n"
                                        + json.dumps({**PAIR, "margin": "high"}) + "\n")})],
        "row 1 (counting from 0): margin 'high' is not a number"),
    "reward model margin column missing": (
        lambda d, s: ["train", _pref(d, [], plugins=["reward_model"], reward_model={"margin": True})],
        "reward_model.margin: true, but the training rows have no margin column"),
}

PROMPT = {"prompt": "Q: what is 2+2?", "answer": "4"}


def _prompts(case: Path, rows: list[dict], plugins: list[str] = ("grpo",), rewards=({"name": "json_fields"},),
             **grpo) -> str:
    """A grpo config on a prompt file of a good row followed by ``rows``."""
    path = _write(case / "prompts.jsonl", "".join(json.dumps(r) + "\n" for r in [PROMPT, *rows]))
    return _cfg(case, plugins=list(plugins), data={"format": "prompt", "path": path, "eval_path": None},
                **({"grpo": {"rewards": list(rewards), "num_generations": 2, **grpo}} if "grpo" in plugins else {}))

PAIR = {"prompt": "Q: what is 2+2?", "chosen": " 4", "rejected": " 5"}


def _pref(case: Path, rows: list[dict], max_seq_len: int = 64, plugins: list[str] = ("dpo",), **sections) -> str:
    """A dpo config on a preference file of a good pair followed by ``rows``."""
    path = _write(case / "pref.jsonl", "".join(json.dumps(r) + "\n" for r in [PAIR, *rows]))
    return _cfg(case, plugins=list(plugins), data={"format": "preference", "path": path, "eval_path": None,
                                                   "max_seq_len": max_seq_len}, **sections)


def _mixture(case: Path, *sources: dict, **sections) -> str:
    return _cfg(case, data={"path": None, "datasets": list(sources)}, **sections)


def _shards(case: Path, texts: list[str]) -> Path:
    for k, text in enumerate(texts):
        _write(case / "shards" / f"part-{k}.jsonl", text)
    return case / "shards"


def _write_plugin(case: Path) -> str:
    """A plugin module (imported from the working directory) with a format whose rows carry one more column."""
    _write(case / "paired_format.py", "from hfsdp import hookimpl\nfrom hfsdp.builtin.chat import tokenize_chat\n\n"
           "def paired(batch, tokenizer, cfg):\n    out = tokenize_chat(batch, tokenizer, cfg)\n"
           "    return {**out, 'pair_ids': out['input_ids']}\n\n"
           "@hookimpl\ndef hfsdp_dataset_formats():\n    return {'paired': paired}\n")
    return "paired_format"


# Cases that need another environment than the others.
CASE_ENV = {case: {"PYTHONPATH": str(Path(__file__).parent / "no_bitsandbytes")}
            for case in ("qlora without bitsandbytes installed", "8-bit adamw without bitsandbytes installed")}


def _model_copy(shared: dict, case: Path, replace: dict) -> Path:
    """A copy of the tiny model folder with files replaced (text/bytes) or removed (None)."""
    folder = case / "model"
    shutil.copytree(shared["model"], folder)
    for name, content in replace.items():
        (folder / name).unlink(missing_ok=True)
        if content is not None:
            _write(folder / name, content)
    return folder


def _damaged(ckpt: Path) -> Path:
    (ckpt / checkpoint.RECORD).write_text('{"step": 2, "world_')
    return ckpt


def _with_config(ckpt: Path, case: Path) -> Path:
    shutil.copy(case / "config.yaml", ckpt / checkpoint.CONFIG_NAME)
    return ckpt


def _run(case: str, shared: dict) -> subprocess.CompletedProcess:
    """``python -m hfsdp ARGV`` of the case in its own folder (run_cli: forked from a server that has the heavy
    imports done, one for each start-up environment, e.g. the cases of :data:`CASE_ENV`)."""
    folder = shared["root"] / case.replace(" ", "_").replace("/", "_").replace(",", "")
    folder.mkdir()
    setup, _ = CASES[case]
    argv = setup(folder, shared)
    proc = run_cli(*argv, cwd=folder, env=base_env(**CASE_ENV.get(case, {})), timeout=300, check=False)
    proc.folder = folder
    return proc


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("bad")
    no_template = root / "no-template-model"
    shutil.copytree(tiny_model_dir, no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = no_template / "tokenizer_config.json"
    raw = json.loads(tok_cfg.read_text())
    raw.pop("chat_template", None)
    tok_cfg.write_text(json.dumps(raw))
    shared = {"root": root, "no_template": str(no_template), "model": tiny_model_dir}
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(lambda c: _run(c, shared), CASES)))


def test_table_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, results):
    proc = results[case]
    expected = CASES[case][1].replace("{d}", str(proc.folder))
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert expected in proc.stderr, proc.stderr[-4000:]
    assert "Failed to load" not in proc.stderr, proc.stderr[-4000:]  # datasets' own log line of an unreadable file
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hfsdp: error:")]
    assert len(errors) == 1, proc.stderr[-4000:]  # one message, not one per layer that saw the problem


def test_lora_targets_are_refused_before_the_weights_load(results):
    """The adapters are tried on the meta model before loading: no "Loading weights" bar, no minutes lost."""
    for case in ("lora target not in the model", "lora on tied embeddings"):
        assert "Loading weights" not in results[case].stderr, results[case].stderr[-3000:]


def test_output_folder_of_a_refused_run_is_untouched(results):
    folder = results["output folder holds another run"].folder
    assert sorted(p.name for p in (folder / "run").iterdir()) == ["metrics.jsonl"]
    assert (folder / "run" / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root reads files whatever their mode")
def test_unreadable_dataset_file(tmp_path):
    rows = tmp_path / "rows.jsonl"
    shutil.copy(CHAT, rows)
    rows.chmod(0)
    proc = subprocess.run([sys.executable, "-m", "hfsdp", "train", _cfg(tmp_path, data={"path": str(rows)})],
                          env=base_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "permission denied" in proc.stderr


@pytest.mark.parametrize("env,expected", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "two"}, "environment variable WORLD_SIZE='two' is not a valid world size"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    # alone, without WORLD_SIZE: a process that took itself for rank 1 of 1 printed and wrote nothing (hfsdp eval)
    ({"RANK": "1"}, "RANK=1 is not below WORLD_SIZE=1"),
])
def test_stray_rank_variables_are_refused_before_torch(tmp_path, env, expected):
    """Rank variables set by hand (not by a launcher) used to reach Accelerate, which raised a traceback."""
    proc = subprocess.run([sys.executable, "-m", "hfsdp", "train", _cfg(tmp_path)], env={**base_env(), **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in proc.stderr and "launch with torchrun or accelerate launch" in proc.stderr
    assert not (tmp_path / "run").exists()
