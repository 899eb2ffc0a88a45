"""Options combined, not only alone (issue 28): a smoke matrix and a resume matrix of real CLI runs on the tiny preset.

* Smoke: FSDP1/FSDP2 x one process (``fsdp.single_process: fsdp``, a one-rank FSDP) / 2 gloo ranks x the common
  options (:data:`OPTIONS`). Every run trains 4 steps, saves at step 2 and 4, and exports ``final/``; the option is
  proven to have acted (checkpointed layers, packed rows, adapters, a bf16 run's other losses, ...). FSDP1 and FSDP2
  of the same option and world compute the same steps (weight decay on, so FSDP1's flat parameters are covered).
* Resume: a run ``--resume``d from the step-2 checkpoint of its smoke run gives the same losses at steps 3 and 4
  and the same exported weights, bit for bit (``torch.equal``).

CI runs a tier of each matrix, ``pytest --full-matrix`` all of it (:func:`pytest_generate_tests`). Runs are made
once and shared between the tests that read them, across pytest-xdist's workers and test modules (conftest.RunRegistry).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import (CACHE_DIR, PRESET_DATA, RUN_ENV, RunRegistry, rank_errors, read_completions, read_metrics,
                      run_cli, run_torchrun, tiny_config, tiny_moe_folder, tiny_teacher_folder)
from vlm_models import colour_data, tiny_vlm_folder

pytestmark = pytest.mark.slow

STEPS = 4
# Constant LR: a resumed run continues the same schedule whatever max_steps it is given; weight decay on, so that
# which parameters decay (FSDP1 flattens them) is part of every comparison.
TRAIN = {"max_steps": STEPS, "save_every": 2, "lr_scheduler": "constant", "weight_decay": 0.1,
         "eval_at_start": False, "max_eval_batches": 1, "per_device_batch_size": 2,
         "collective_timeout_s": 120}  # a hang fails in minutes
LORA = {"plugins": ["lora"]}
PACKING = {"plugins": ["packing"], "data": {"max_seq_len": 256}}  # rows of ~80 tokens: about 3 per packed row

# Preference objectives on the bundled pairs. DPO (plugin dpo): full fine-tuning, reference log-probs precomputed
# and cached; ORPO full fine-tuning (its NLL a token mean over the global batch); SimPO with LoRA and its NLL term.
PAIRS_DATA = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_pref_eval.jsonl")}
DPO = {"plugins": ["dpo"], "data": PAIRS_DATA}
# KTO (plugin kto) on the bundled pairs unpaired, full fine-tuning: reference log-probs (rows and KL rows) precomputed;
# seed 42: rows whose KL estimate is above 0 from step 2 (with the tiny preset's seed 7 it stays clamped at 0)
KTO = {"plugins": ["kto"], "data": {"format": "unpaired", "path": str(PRESET_DATA / "contacts_unpaired_train.jsonl"),
                                    "eval_path": str(PRESET_DATA / "contacts_unpaired_eval.jsonl")},
       "train": {"seed": 42}}

# GRPO (plugin grpo) on the bundled prompts, full fine-tuning: a reward that differs within a group (module:function
# on PYTHONPATH), 3 iterations a round, so that the step-2 checkpoint is inside a round (its completions restored)
GRPO = {"plugins": ["grpo"], "data": {"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"),
                                      "eval_path": None},
        "grpo": {"num_generations": 2, "max_new_tokens": 4, "num_iterations": 3, "log_completions": 2,
                 "rewards": [{"name": "grpo_test_rewards:letters"}]}}

# RLOO (plugin rloo, issue 52) on GRPO's prompts, reward and rounds: full fine-tuning (beta 0 without lora); with
# LoRA, TRL's default KL penalty in the reward (0.05, towards the adapters' base), the rewards clamped (the letters
# reward lies in [0, 1]: clamped at 0.95 some differ from 1), the advantages normalised over the batch
RLOO = {"plugins": ["rloo"], "data": GRPO["data"], "rloo": GRPO["grpo"]}
LORA_RLOO = {**RLOO, "plugins": ["lora", "rloo"],
             "rloo": {**GRPO["grpo"], "reward_clip_range": [0.0, 0.95], "normalize_advantages": True}}

# Agent data (issue 57): the bundled tool conversations (tool calls, results, a tools column) under hfsdp's
# chatml_tools template, in the format the other options chose: SFT rows, DPO pairs (the right call against one naming
# someone else), GRPO prompts with their tools (the tool_call reward reads each completion's parsed calls; letters
# varies within a group)
TOOLS_FILES = {"chat": "contacts_tools", "preference": "contacts_tools_pref", "prompt": "contacts_tools_prompts"}


def with_tools(sections: dict) -> dict:
    """``sections`` training on the tool conversations of their format (``chat`` when unset)."""
    data = sections.get("data", {})
    name = TOOLS_FILES[data.get("format", "chat")]
    tools = {"data": {"path": str(PRESET_DATA / f"{name}_train.jsonl"), "chat_template": "chatml_tools",
                      "eval_path": None if data.get("eval_path") is None and "format" in data
                      else str(PRESET_DATA / f"{name}_eval.jsonl"), "max_seq_len": 320}}
    if "grpo" in sections:
        tools["grpo"] = {"rewards": [{"name": "tool_call"}, *sections["grpo"]["rewards"]]}
    return _merge(sections, tools)


def acting(sections: dict) -> dict:
    """Rollouts that act (issue 69): the online objective the other options chose (GRPO if none) on the tool
    prompts, each rollout with an environment (its reset appended to the prompt, its tool rendered into it, its
    get_reward an extra reward) and up to 2 turns of calls: the random tiny model calls none in 4 tokens, so that
    the rollouts' turns, the tool workers on each rank and the environments' rewards meet the other options
    (tests/test_agents.py: a model that calls, on 1, 2 and 4 ranks). On-policy distillation samples every round
    (lmbda 1): the tool prompts hold no completion of their own."""
    online = next((name for name in ("grpo", "rloo", "distill_online") if name in sections), None)
    if online is None:
        sections, online = _merge(sections, GRPO), "grpo"
    return _merge(with_tools(sections), {online: {"environment": "grpo_test_rewards:Notebook",
                                                  "max_tool_calling_iterations": 2,
                                                  **({"lmbda": 1.0} if online == "distill_online" else {})}})


def workers(sections: dict) -> dict:
    """Sampling beside the trainer (issue 70): the online objective the other options chose (GRPO if none) sampled
    by a generation process at max_staleness 1 (round 1 by the policy of round 0), the weights published through
    shared memory after each round (tests/test_generation_engine.py: against inline bit for bit, 2 processes, faults)."""
    online = next((name for name in ("grpo", "rloo", "distill_online") if name in sections), None)
    if online is None:
        sections, online = _merge(sections, GRPO), "grpo"
    return _merge(sections, {online: {"generation": {"engine": "workers", "max_staleness": 1}}})


def grpo_with(*plugins: str, **keys) -> dict:
    """:data:`GRPO` with more ``grpo`` keys (TRL's loss options, issue 50) and plugins before it."""
    return {**GRPO, "plugins": [*plugins, "grpo"], "grpo": {**GRPO["grpo"], **keys}}


# GRPO's loss options each with other GRPO options: CISPO (its cap at ScaleRL's 5) with the KL to LoRA's base (3
# iterations a round); GSPO (sequence-level ratios) with LoRA; SAPO with two rewards normalised apart (GDPO); LUSPO
# at sequence level with two-sided clipping; VESPO on the top half of the tokens by entropy (a forward without
# gradient before each step's, its quantile over both ranks) with accumulation; truncated completions left out (the
# random tiny model never emits EOS in 4 tokens: every completion, so the loss and gradient are 0)
GRPO_LOSS_OPTIONS = {
    "lora_grpo_cispo": grpo_with("lora", loss_type="cispo", epsilon_high=5.0, beta=0.04),
    "lora_grpo_sequence": grpo_with("lora", loss_type="grpo", importance_sampling_level="sequence"),
    "grpo_sapo": grpo_with(loss_type="sapo", multi_objective_aggregation="normalize_then_sum", rewards=[
        {"name": "grpo_test_rewards:letters"}, {"name": "grpo_test_rewards:characters", "weight": 0.5}]),
    "grpo_luspo": grpo_with(loss_type="luspo", importance_sampling_level="sequence", delta=1.5),
    "grpo_vespo": {**grpo_with(loss_type="vespo", top_entropy_quantile=0.5),
                   "train": {"per_device_batch_size": 2, "gradient_accumulation_steps": 2}},
    "grpo_masked": grpo_with(mask_truncated_completions=True),
}


def _merge(*parts: dict) -> dict:
    """Config sections merged in order (a section's keys over the earlier ones'); ``plugins`` lists are joined."""
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            if key == "plugins":
                merged[key] = [*merged.get(key, []), *(p for p in value if p not in merged.get(key, []))]
            else:
                merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return merged


def mixture_of(sections: dict) -> dict:
    """``sections`` with its training data made a mixture: its train file (weight 3) and its eval file (weight 1,
    with its format set on the source itself), whatever format the other options chose."""
    data = {"path": str(PRESET_DATA / "contacts_train.jsonl"), "eval_path": str(PRESET_DATA / "contacts_eval.jsonl"),
            "format": "chat", **sections.get("data", {})}
    second = data["eval_path"] or data["path"]  # a run without eval data: its train file again
    return _merge(sections, {"data": {"path": None, "datasets": [
        {"path": data["path"], "weight": 3}, {"path": second, "format": data["format"], "weight": 1}]}})


def vision_language(sections: dict) -> dict:
    """``sections`` training the tiny Qwen2.5-VL, its vision tower frozen, on colour questions about images (a
    preference objective's: colour pairs, the image in the prompt; an online objective's: the questions as
    prompts), the widest images (56x48) scaled down by ``data.image_max_pixels``; a mixture's sources are those
    image rows; rows another option chose for a template of its own (tool conversations) are kept, the model
    trained on them."""
    data = sections.get("data", {})
    own_format = data.get("format") in ("preference", "prompt")
    train, eval_ = colour_data(CACHE_DIR, data["format"] if own_format else "chat")
    model = {"model": {"name_or_path": str(tiny_vlm_folder("qwen2_5_vl", CACHE_DIR)), "freeze": ["vision"]},
             "data": {"image_max_pixels": 48 * 48}}
    if own_format and not data.get("chat_template") and not data.get("datasets"):
        return _merge(sections, model, {"data": {"path": str(train), "eval_path": str(eval_)}})
    if data.get("datasets"):
        return _merge(sections, model, {"data": {"datasets": [{"path": str(train), "weight": 3},
                                                              {"path": str(eval_), "format": "chat", "weight": 1}]}})
    if data.get("format", "chat") != "chat" or data.get("chat_template"):
        return _merge(sections, model)
    return _merge(sections, model, {"data": {"format": "chat", "path": str(train), "eval_path": str(eval_)}})


def compose(*parts) -> dict:
    """Options (:data:`OPTIONS` values: sections, or a function of the sections so far, applied after the plain
    ones) over base sections."""
    sections = _merge(*(p for p in parts if not callable(p)))
    for part in parts:
        if callable(part):
            sections = part(sections)
    return sections


IPO = _merge(DPO, {"dpo": {"loss_type": "ipo", "beta": 0.5}})  # a loss of (1 / (2 beta))^2 = 1 at step 1
ORPO = {"plugins": ["orpo"], "data": PAIRS_DATA}
LORA_SIMPO = {"plugins": ["lora", "simpo"], "data": PAIRS_DATA, "simpo": {"nll_weight": 1.0}}
REWARD_MODEL = {"plugins": ["reward_model"], "data": PAIRS_DATA, "reward_model": {"center_rewards_coefficient": 0.01}}


def distill(sections: dict) -> dict:
    return _merge(sections, {"plugins": ["distill"], "distill": {
        "teacher": str(tiny_teacher_folder()), "loss": "jsd", "alpha": 0.5, "temperature": 2.0}})


# On-policy distillation (plugin distill_online, issue 52) on GRPO's prompts: the student samples, the frozen teacher
# (another seed of the tiny model, sharded over the ranks) scores every token, the JSD of beta 0.5; 3 steps a round
# (TRL's is 1), so that the step-2 checkpoint is inside a round; lmbda 0.5 (seed 7's draws: the first round sampled,
# the second on the rows' own answers)
DISTILL_ONLINE = {"plugins": ["distill_online"], "data": GRPO["data"], "distill_online": {
    "teacher": str(tiny_teacher_folder()), "beta": 0.5, "max_new_tokens": 4, "num_iterations": 3, "log_completions": 2,
    "lmbda": 0.5, "completion_column": "answer"}}


# Packing for every objective (issue 51): each objective's micro-batches packed (the only scope of preference,
# unpaired and prompt rows; distillation's token rows with scope micro_batch), a pair's two sequences in one row,
# against the option unpacked (PACKED_FROM: the same rows each step). packing_dpo and packing_grpo are the pairs
# packing+dpo and packing+grpo (the same sections: one run).
PACKED_FROM = {"packing_dpo": "dpo", "packing_ipo": "ipo", "packing_orpo": "orpo", "lora_packing_simpo": "lora_simpo",
               "packing_kto": "kto", "packing_reward_model": "reward_model", "packing_distill": "distill",
               "packing_grpo": "grpo"}
PACKED_OPTIONS = {
    "packing_dpo": _merge(PACKING, DPO), "packing_ipo": _merge(PACKING, IPO), "packing_orpo": _merge(PACKING, ORPO),
    "lora_packing_simpo": _merge(LORA, PACKING, LORA_SIMPO), "packing_kto": _merge(PACKING, KTO),
    "packing_reward_model": _merge(PACKING, REWARD_MODEL),
    "packing_distill": lambda sections: distill(_merge(sections, PACKING, {"packing": {"scope": "micro_batch"}})),
    "packing_grpo": _merge(PACKING, GRPO),
}


# option name -> config sections merged over the tiny preset (or a function of them: :func:`compose`)
OPTIONS = {
    "base": {},
    "checkpointing": {"fsdp": {"activation_checkpointing": True}},
    "packing": PACKING,
    "lora": LORA,
    "bf16": {"fsdp": {"mixed_precision": "bf16"}},
    "accumulation": {"train": {"per_device_batch_size": 1, "gradient_accumulation_steps": 2}},
    "shard_grad_op": {"fsdp": {"sharding_strategy": "SHARD_GRAD_OP"}},
    "lora_checkpointing": {**LORA, "fsdp": {"activation_checkpointing": True}},
    "lora_packing": {**PACKING, "plugins": ["lora", "packing"]},
    "full_state_dict": {"fsdp": {"state_dict_type": "FULL_STATE_DICT"}},
    "lora_full_state_dict": {**LORA, "fsdp": {"state_dict_type": "FULL_STATE_DICT"}},
    "size_wrap": {"fsdp": {"wrap_policy": "size", "min_num_params": 40_000}},  # the seeds' policy, tied model
    "plain_loss": {"train": {"chunked_loss": False}},  # the full-logits loss (the chunked one is the default)
    "compile": {"train": {"compile": True}},  # each block compiled in place (Inductor)
    "async_save": {"train": {"async_save": True}},  # checkpoints written in the background
    "dpo": DPO,
    "ipo": IPO,
    "orpo": ORPO,
    "lora_simpo": LORA_SIMPO,
    # a reward model: the causal LM as its sequence-classification model (a new score head), the pairwise loss with
    # the centring term, exported as a folder AutoModelForSequenceClassification loads
    "reward_model": REWARD_MODEL,
    "kto": KTO,
    # distillation from a frozen teacher (another seed of the tiny model, sharded over the ranks), the JSD mixed
    # with the token loss
    "distill": distill,
    "mixture": mixture_of,  # the run's own train and eval files as two sources, 3:1
    "qlora": {**LORA, "model": {"quantization": {"bits": 4}}},  # 4-bit nf4 base, sharded (float32 storage)
    "qlora_checkpointing": {**LORA, "model": {"quantization": {"bits": 4}}, "fsdp": {"activation_checkpointing": True}},
    "grpo": GRPO,
    **GRPO_LOSS_OPTIONS,
    "rloo": RLOO,
    "lora_rloo": LORA_RLOO,
    "distill_online": DISTILL_ONLINE,
    **PACKED_OPTIONS,
    # train.optimizer: Muon (whole-matrix Newton-Schulz on FSDP2's shards), schedule-free AdamW (its averaged
    # weights evaluated, checkpointed and exported), 8-bit AdamW (its moments quantized in one process's blocks on
    # FSDP2's shards), Adafactor (the gathered matrices' rows and columns factored)
    "muon": {"train": {"optimizer": "muon"}},
    "schedule_free": {"train": {"optimizer": "schedule_free_adamw"}},
    "adamw_8bit": {"train": {"optimizer": "adamw_8bit"}},
    "adafactor": {"train": {"optimizer": "adafactor"}},
    # 8-bit AdamW over QLoRA's adapters (their matrices are under bitsandbytes' 4096 elements: 32-bit moments, on
    # each rank's shard, as one process keeps them)
    "qlora_adamw_8bit": {**LORA, "model": {"quantization": {"bits": 4}}, "train": {"optimizer": "adamw_8bit"}},
    # tensor parallelism: the decoder layers' projections split over 2 ranks (on 2 ranks: one data-parallel rank,
    # the rows of one process; tests/test_tensor_parallel.py: 2 x 2 on 4 ranks)
    "tp2": {"parallel": {"tp_size": 2}},
    # sequence parallelism: each row's positions split over 2 ranks, attention's heads exchanged for them (on 2
    # ranks: one data-parallel rank; tests/test_sequence_parallel.py: long rows, 2 x 2 on 4 ranks, LoRA, packing)
    "sp2": {"parallel": {"sp_size": 2}},
    # context parallelism: each row's positions split over a ring of 2 ranks, the keys and values passed around it
    # (on 2 ranks: one data-parallel rank; tests/test_context_parallel.py: rows of 3,072 tokens on 9 heads, packing,
    # LoRA, sp 2 x cp 2 on 4 ranks)
    "cp2": {"parallel": {"cp_size": 2}},
    # the tiled MLP: each decoder layer's MLP over tiles of 32 positions, each recomputed in the backward
    # (tests/test_tiled_mlp.py: the untiled steps with LoRA and activation checkpointing, a long row's lower peak)
    "tiled_mlp": {"train": {"tiled_mlp": 32}},
    "agent": with_tools,
    # the end of training writes the merged LoRA model as q8_0 GGUF and a Modelfile beside the folder (its model
    # card names them); transformers' GGUF loader reads it back into the folder's logits
    "gguf": {"plugins": ["lora", "gguf_export"], "lora": {"merge": True}},
    "dpo_tools": lambda sections: with_tools(_merge(sections, DPO)),
    "grpo_tools": lambda sections: with_tools(_merge(sections, GRPO)),
    "acting": acting,
    "workers": workers,
    # a mixture of experts (issue 71): the tiny Qwen3-MoE (8 experts a layer, 2 a token), its experts' 3-D weights
    # sharded, its router's load-balancing loss in the gradient (tests/test_moe.py: every architecture, against
    # transformers' loss, 2 ranks against one process)
    "moe": {"model": {"name_or_path": str(tiny_moe_folder("qwen3_moe"))}},
    # expert parallelism (issue 71): the tiny Qwen3-MoE's experts split over 2 ranks (4 each), tokens sent to them
    # and back, each rank on its own rows (tests/test_moe.py: 2 and 4 ranks against one process, other architectures)
    "ep2": {"model": {"name_or_path": str(tiny_moe_folder("qwen3_moe"))}, "parallel": {"ep_size": 2}},
    # a vision-language model (issue 72): the tiny Qwen2.5-VL on one-image colour questions, its tower frozen
    # (tests/test_vision.py: labels against TRL, 2 ranks against one process, SmolVLM under FSDP1 with LoRA)
    "vlm": vision_language,
    # DPO on a vision-language model: pairs of answers to a question about an image, the image through both
    # sequences and the reference (tests/test_vision.py: pairs against TRL's collator, 2 ranks, SmolVLM with LoRA)
    "vlm_dpo": lambda sections: vision_language(_merge(sections, DPO)),
    # GRPO on a vision-language model: prompts with images, completions sampled with their pixel inputs
    # (tests/test_vision.py: the sampler's log-probs against the training forward's on seven architectures, 2 ranks)
    "vlm_grpo": lambda sections: vision_language(_merge(sections, GRPO)),
}
# Options run under FSDP2 only: the data alone (the rows each step trains on, the same under any wrapper), and
# the optimizers FSDP1 cannot run (their refusal before any weight loads: test_bad_inputs).
FSDP2_ONLY = ("mixture", "muon", "adamw_8bit", "adafactor", "qlora_adamw_8bit", "tp2", "ep2", "agent", "gguf",
              "dpo_tools", "grpo_tools")
# Resume cases beyond the smoke runs: (world, fsdp overrides), FSDP2 only.
EXTRA = {
    "no_shard": (2, {"sharding_strategy": "NO_SHARD"}),
    "hybrid_shard_x4": (4, {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}),
}
# torch's FSDP1 asserts on one shard of frozen tied weights: LoRA of the tied tiny model under FSDP1 on one process
# is refused with that reason (hfsdp.builtin.lora) instead of crashing at the first forward.
REFUSED = {(1, 1, name): "LoRA on a model with tied embeddings under FSDP1 with a single shard"
           for name in OPTIONS if name.startswith("lora")}
# hfsdp compiles blocks before FSDP2 shards them; FSDP1 flattens them first: refused in validation.
REFUSED.update({(1, world, "compile"): "train.compile: FSDP1 flattens each unit's parameters" for world in (1, 2)})
# DCP's host-memory staging cannot copy FSDP1's ShardedTensors: refused in validation.
REFUSED.update({(1, world, "async_save"): "train.async_save: FSDP1's sharded state dict holds ShardedTensors"
                for world in (1, 2)})
# QLoRA runs under FSDP2 only: refused in validation (hfsdp.model.quantized).
REFUSED.update({(1, world, name): "QLoRA runs under FSDP2 only" for world in (1, 2) for name in OPTIONS
                if name.startswith("qlora")})
# A tensor-parallel group of 2 ranks needs 2 ranks.
REFUSED[2, 1, "tp2"] = "parallel.tp_size: 2 does not divide the world size 1"
REFUSED.update({(v, 1, "sp2"): "parallel.sp_size: 2 does not divide the world size 1" for v in (1, 2)})
REFUSED.update({(v, 1, "cp2"): "parallel.cp_size: 2 does not divide the world size 1" for v in (1, 2)})
REFUSED[2, 1, "ep2"] = "parallel.ep_size: 2 does not divide the 1 ranks FSDP shards over"
# torch's FSDP1 on one shard drops a frozen part from the state dict it saves (the vlm option freezes the tower).
REFUSED.update({(1, 1, name): "model.freeze under FSDP1 with a single shard"
                for name in ("vlm", "vlm_dpo", "vlm_grpo")})
# FSDP1 and FSDP2 of the same option: other float32 summation orders (flat parameters) within this; bf16 computes
# in bf16, where FSDP1 also casts the buffers.
LOSS_REL = {"bf16": 2e-3}
DEFAULT_LOSS_REL = 1e-5
GRAD_REL = {"bf16": 5e-2}
DEFAULT_GRAD_REL = 1e-3


@pytest.fixture(scope="module")
def runs(run_registry) -> RunRegistry:
    return run_registry


def smoke_sections(version: int, world: int, option: str) -> dict:
    fsdp = {"version": version, "sharding_strategy": "FULL_SHARD", "single_process": "fsdp"}
    return compose({"train": TRAIN, "fsdp": fsdp}, OPTIONS[option])


def smoke_run(runs: RunRegistry, version: int, world: int, option: str):
    return runs.run(f"fsdp{version}-x{world}-{option}", world, smoke_sections(version, world, option),
                    check=(version, world, option) not in REFUSED)


def losses(run: Path) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run) if "loss" in m}


def exported(run: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted((run / "final").glob("*.safetensors"))
    assert files, f"nothing exported in {run / 'final'}"
    return {f.name: load_file(f) for f in files}


def startup(run: Path) -> dict:
    return json.loads((run / "startup_rank0.json").read_text())


SMOKE = [(v, w, o) for o in OPTIONS for v in (1, 2) for w in (1, 2) if v == 2 or o not in FSDP2_ONLY]
# CI's tier (``pytest --full-matrix``: every cell): FSDP1 on one process only for the base run and LoRA's refusal,
# since FSDP1's own paths are its flat parameters and state dicts, which 2 ranks shard (every option there).
FSDP1_ONE_PROCESS_CI = ("base", "lora")
# FSDP2 on one process (a one-rank FSDP) leaves out, in CI, the options that take no path of their own there: they
# compute on one rank what they compute on 2 ranks' shards (precision, micro-batches, a strategy that one rank
# cannot tell from FULL_SHARD, blocks compiled or checkpointed before the same fully_shard, units of another policy,
# the loss, the rows, a preference objective's reference pass, LoRA with another option, an optimizer's step on one
# shard: the whole; a GGUF export of one process's checkpoint: tests/test_gguf.py's runs).
FSDP2_ONE_PROCESS_SAME = ("bf16", "accumulation", "shard_grad_op", "compile", "checkpointing", "size_wrap",
                          "lora_checkpointing", "packing", "lora_packing", "lora_full_state_dict", "plain_loss", "dpo",
                          "lora_simpo", "reward_model", "kto", "mixture", "distill", "muon", "schedule_free",
                          "adamw_8bit", "adafactor", "agent", "dpo_tools", "grpo_tools", "ipo", "rloo", "lora_rloo",
                          "distill_online", "acting", "workers", "moe", "vlm", "vlm_dpo", "vlm_grpo", "gguf",
                          "cp2", *PACKED_OPTIONS)
# FSDP1 on 2 ranks leaves out, in CI, the objectives and row options whose code FSDP1 does not change (the loss,
# packed rows, reference-free objectives): they meet FSDP1 through the same forward and backward as the base run.
FSDP1_SAME = ("plain_loss", "packing", "lora_packing", "orpo", "lora_simpo", "reward_model", "kto", "distill", "ipo",
              "rloo", "lora_rloo", "distill_online", "acting", "vlm_dpo", "vlm_grpo", *PACKED_OPTIONS,
              "cp2")  # (the ring's groups are sp2's, whose FSDP1 run tests/test_sequence_parallel.py checks)
# Options that CI runs in a test of their own: 8-bit AdamW and Adafactor on 2 FSDP2 ranks against one process, and
# their resumes (tests/test_optimizers.py)
CI_ELSEWHERE = ("adamw_8bit", "adafactor", "qlora_adamw_8bit")  # the last: with --full-matrix only
# DPO and GRPO on a vision-language model: on 2 ranks against one process, resumed, in tests/test_vision.py
CI_ELSEWHERE += ("vlm_dpo", "vlm_grpo")
# Compiled blocks (Inductor) on 2 FSDP2 ranks against the eager steps, without recompiling: tests/test_compile.py
# (the smoke cell's 57 s and its resume's 23 s of Inductor compiling, in the CI run of stop 83, run with --full-matrix)
CI_ELSEWHERE += ("compile",)
# The tiled MLP against the untiled steps on 2 FSDP2 ranks with LoRA and checkpointing: tests/test_tiled_mlp.py
CI_ELSEWHERE += ("tiled_mlp",)
# GRPO's loss options: CI runs three cells (CISPO with the KL and LoRA and the entropy quantile's collective on 2
# FSDP2 ranks, truncated completions under FSDP1, which compares it with FSDP2), the rest with --full-matrix
GRPO_LOSS_CI = {(2, 2, "lora_grpo_cispo"), (2, 2, "grpo_vespo"), (1, 2, "grpo_masked")}
CI_SMOKE = [(v, w, o) for v, w, o in SMOKE if not ((v, w) == (1, 1) and o not in FSDP1_ONE_PROCESS_CI)
            and not ((v, w) == (2, 1) and o in FSDP2_ONE_PROCESS_SAME) and not (v == 1 and o in FSDP1_SAME)
            and o not in CI_ELSEWHERE and (o not in GRPO_LOSS_OPTIONS or (v, w, o) in GRPO_LOSS_CI)]


def assert_refused(proc, run: Path, world: int, reason: str) -> None:
    """Refused up front: exit 2 (one process) or each rank's one-line error, ``reason`` said, no weights loaded."""
    if world == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    else:  # torchrun reports its failed workers with a traceback of its own; each rank's error is one line,
        # and the first rank to fail ends the others (a refusal in validation may leave only one line)
        assert proc.returncode != 0 and re.search(r"\[rank [01]\] hfsdp: error:", proc.stderr), proc.stderr[-3000:]
    assert reason in proc.stderr, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr  # refused from the model's config, before its weights load
    assert not (run / "checkpoints").exists()


def assert_mixture_shares(sources: list[dict], train: dict, world: int) -> None:
    """The run's plan over the rows its sources gave (packed rows, preference pairs, ...): over 1,000 steps each
    source's share within 2 % of its weight (a few steps of a shuffled epoch are no measure of it)."""
    from hfsdp.data import batches
    from hfsdp.config.schema import DataConfig

    rows = [s["rows"] for s in sources]
    mixture = batches.Mixture.of(DataConfig(datasets=[{"path": s["path"], "weight": w}
                                                      for s, w in zip(sources, (3, 1))]), rows)
    plan = batches.BatchPlan(sum(rows), train["per_device_batch_size"], world,
                             train.get("gradient_accumulation_steps", 1), 7, mixture=mixture)  # tiny_config seed
    counts = plan.source_counts(1000)
    assert all(abs(c / sum(counts) - s["share_planned"]) < 0.02 for c, s in zip(counts, sources)), (counts, sources)


def assert_trained(run: Path, proc, sections: dict, options: tuple[str, ...], version: int, world: int) -> None:
    """A smoke run trained every step, checkpointed, exported, and each of ``options`` acted."""
    distill = any("distill" in option for option in options)
    bars = 2 if distill else 1  # distill: the teacher's too
    assert proc.stderr.count("Loading weights:   0%") == bars, proc.stderr[-3000:]  # rank 0's bar alone
    assert "deprecated" not in proc.stderr, proc.stderr[-3000:]  # Accelerate calls FSDP1's sharding_strategy so
    steps = losses(run)
    assert sorted(steps) == list(range(1, STEPS + 1))
    grpo = any(name in option for option in options
               for name in ("grpo", "rloo", "distill_online", "acting", "workers"))  # online
    assert all(loss == loss and (0 < loss or grpo) and abs(loss) < 20  # GRPO's and RLOO's loss may be <= 0
               for loss, _ in steps.values()), steps
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]
    weights = exported(run)
    report = startup(run)
    summary = json.loads((run / "summary.json").read_text())
    assert report["distributed_type"] == "FSDP" and report["fsdp_version"] == version
    assert (report["checkpointed_layers"] > 0) == bool(sections["fsdp"].get("activation_checkpointing"))
    if any("lora" in option for option in options):
        assert "adapter_model.safetensors" in weights
    else:
        assert "model.safetensors" in weights
    if any(option.startswith("qlora") for option in options):
        assert report["quantized_base"]["sharded"], report  # a DTensor on one rank too (single_process: fsdp)
    if "packing" in sections.get("plugins", []) and (sections.get("packing", {}).get("scope") == "micro_batch" or
                                                     sections["data"].get("format") in ("preference", "unpaired", "prompt")):
        said = summary["data"]["padding"]  # each micro-batch's sequences packed: measured on the first steps'
        found = re.fullmatch(r"padding (\d+\.\d)% -> (\d+\.\d)% of positions \((\d+) of \d+ micro-batches packed .*\)",
                             said)
        assert ("sampled completions packed" in said if grpo else  # sdpa: each packed sequence attended on its own
                found and float(found[2]) <= float(found[1]) and int(found[3]) > 0), said
    elif any("packing" in option for option in options):
        packed = summary["data"]["padding"]
        assert "samples packed into" in packed and int(packed.split("into ")[1].split()[0]) < 1000, packed
    if "mixture" in options:
        sources = summary["data"]["sources"]
        assert [s["share_planned"] for s in sources] == [0.75, 0.25], sources
        if options == ("mixture",):
            assert [s["rows"] for s in sources] == [1000, 64], sources
        assert_mixture_shares(sources, sections["train"], world)
    if "compile" in options:
        assert max(m.get("compile_graphs", 0) for m in read_metrics(run)) > 0
    if "async_save" in options:  # each checkpoint complete once, written while training went on
        assert report["checkpoint_saves"] == "asynchronous"
        assert [m["checkpoint_step"] for m in read_metrics(run) if "save_write_s" in m] == [2, 4]
    if grpo:  # completions sampled at the first step of each round (3 steps each)
        assert [c["step"] for c in read_completions(run)] == [1, 1, 4, 4]
    if "grpo_masked" in options:  # every completion cut at max_new_tokens: nothing left to train on
        assert all(len(c["completion_ids"]) == 4 for c in read_completions(run))
        assert all(loss == 0 and norm == 0 for loss, norm in steps.values()), steps
    if "lora_rloo" in options:  # the KL penalty: 0 at the first round (the adapters' B is 0), then not
        kl = [m["kl"] for m in read_metrics(run) if "loss" in m]
        assert kl[0] == 0 and kl[3] != 0 and all(0 <= m["clip_ratio"] <= 1 for m in read_metrics(run) if "loss" in m)
    if "distill_online" in options and "acting" in options:  # lmbda 1: every round sampled
        assert [m["on_policy"] for m in read_metrics(run) if "loss" in m] == [1, 1, 1, 1]
    elif "distill_online" in options:  # lmbda 0.5: the first round sampled, the second the rows' answers (JSON)
        assert [m["on_policy"] for m in read_metrics(run) if "loss" in m] == [1, 1, 1, 0]
        assert [c["completion"].startswith('{"name"') for c in read_completions(run)] == [False, False, True, True]
    if "workers" in options and "distill_online" not in options:  # (lmbda 0.5: round 1 is the rows' answers)
        # round 0 by version 0, round 1 by version 0 too (staleness 1), the weights published at each round
        metrics = [m for m in read_metrics(run) if "loss" in m]
        assert [m["generation/staleness"] for m in metrics] == [0, 0, 0, 1] and metrics[0]["generation/sync_bytes"] > 0
    if "moe" in options or "ep2" in options:  # the router watched on every step, its load-balancing loss added
        metrics = [m for m in read_metrics(run) if "loss" in m]
        assert all(1 <= m["router/imbalance"] <= 4 and m["router/aux_loss"] > 1 for m in metrics), metrics
        assert report["experts"] == {"experts": 8, "on_rank": 4 if "ep2" in options else 8, "top_k": 2, "layers": 2,
                                     "implementation": "grouped_mm", "aux_coef": 0.001}, report
    if "ep2" in options:  # each rank holds half of every layer's experts, FSDP2 shards the rest over both
        assert report["ep_size"] == 2 and "experts over expert parallel 2 x efsdp 1" in report["strategy"], report
    if "grpo_vespo" in options:  # the share of the tokens at or above the step's median entropy
        assert all(0.4 <= m["entropy_kept"] <= 0.75 for m in read_metrics(run) if "loss" in m), read_metrics(run)
    if any("reward_model" in option for option in options):
        assert_scores_as_it_evaluated(run, sections, world)
    if distill:  # the teacher's logits reached the loss; FSDP2 on 2 ranks shards the teacher too
        assert all(m["distill/divergence"] > 1e-4 for m in read_metrics(run) if "loss" in m)
        sharded = "loaded frozen, sharded over 2 ranks (FSDP2)" in proc.stdout + proc.stderr
        assert sharded == (world == 2 and version == 2), (proc.stdout + proc.stderr)[-3000:]
    if "acting" in options:  # each rollout's environment reset (its line after the prompt) and rewarded
        completions = read_completions(run)
        assert all(c["observation"] == " Answer briefly." for c in completions)
        if "mixture" not in options:  # the rows of the tool prompts' file: each its own reward
            rows = [json.loads(line) for line in Path(sections["data"]["path"]).read_text().splitlines()]
            assert [c["rewards"]["Notebook"] for c in completions] == pytest.approx(
                [len(rows[c["row"]]["answer"]["arguments"]["name"]) % 3 / 3 for c in completions])
        assert all(m["tools/turns"] == 1 and "rewards/Notebook/mean" in m for m in read_metrics(run) if "loss" in m)
    if any(option in ("agent", "dpo_tools", "grpo_tools", "acting") for option in options):  # the template chose
        assert "<tool_call>" in (run / "final" / "chat_template.jinja").read_text()
    assert_model_card(run, options, world)
    if "gguf" in options:
        from test_gguf import assert_loads_as_exported

        assert_loads_as_exported(run / "final", "q8_0")
        assert "llama.cpp: `llama-cli -m model-q8_0.gguf`; Ollama" in (run / "final" / "README.md").read_text()
    if "size_wrap" in options:  # units of the policy's own (the MLPs of the tiny model), besides the root
        assert report["wrapped_units"] >= 3, report
    if "tp2" in options:  # the decoder layers split, the embedding whole on both (one data-parallel rank)
        assert report["tp_size"] == 2 and "over dp_shard 1 x tensor parallel 2" in report["strategy"], report
        assert report["param_bytes_this_rank"] < report["param_bytes_full_model"], report
    elif "sp2" in options:  # every row's positions split, the weights sharded over both (FSDP2)
        assert report["sp_size"] == 2 and "over dp 1 x sequence parallel 2" in report["strategy"], report
        assert report["param_bytes_this_rank"] < 0.75 * report["param_bytes_full_model"]
    elif "cp2" in options:  # every row's positions split around the ring, the weights sharded over both
        assert report["cp_size"] == 2 and "over dp 1 x context parallel 2" in report["strategy"], report
        assert report["param_bytes_this_rank"] < 0.75 * report["param_bytes_full_model"]
    elif world == 2 and sections["fsdp"].get("sharding_strategy") != "NO_SHARD":
        assert report["param_bytes_this_rank"] < 0.75 * report["param_bytes_full_model"]


def assert_model_card(run: Path, options: tuple[str, ...], world: int) -> None:
    """final/ has its model card, which huggingface_hub reads: the steps and tokens the run trained, its processes,
    the kind of folder (adapters or full weights)."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(run / "final" / "README.md")
    summary = json.loads((run / "summary.json").read_text())
    adapters = (run / "final" / "adapter_config.json").is_file()
    assert card.data.library_name == ("peft" if adapters else "transformers") and "hfsdp" in card.data.tags
    assert f"| optimizer steps | {STEPS} of {STEPS} |" in card.text
    assert f"| tokens trained on | {summary['tokens_seen']:,} |" in card.text
    assert f"| processes | {world}" in card.text
    assert ("trained adapters only" in card.text) == adapters
    scorer = any("reward_model" in option for option in options)
    assert ("AutoModelForSequenceClassification.from_pretrained" in card.text) == scorer
    assert card.data.pipeline_tag == ("text-classification" if scorer else "text-generation")


def assert_scores_as_it_evaluated(run: Path, sections: dict, world: int) -> None:
    """The reward model's export loads as a sequence-classification model (nothing missing, one output, the pad
    token set) and scores the eval pairs as the run's final eval did: the same mean margin and extreme rewards."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hfsdp.builtin.preference import tokenize_pair
    from hfsdp.config.schema import DataConfig

    model, info = AutoModelForSequenceClassification.from_pretrained(run / "final", output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    data = DataConfig(**{**sections["data"], "format": "preference"})
    pairs = world * sections["train"]["per_device_batch_size"]  # the first eval batch of each rank (max_eval_batches 1)
    assert sections["train"]["max_eval_batches"] == 1
    rows = [json.loads(line) for line in Path(data.eval_path).read_text().splitlines()[:pairs]]
    rewards = []
    with torch.no_grad():
        for row in rows:
            ids = tokenize_pair(row["prompt"], row["chosen"], row["rejected"], tokenizer, data)
            rewards.append([float(model(input_ids=torch.tensor([ids[k][:data.max_seq_len]])).logits)
                            for k in ("input_ids", "rejected_input_ids")])
    final = [m for m in read_metrics(run) if "eval_rewards/margins" in m][-1]
    assert final["eval_rewards/margins"] == pytest.approx(sum(c - r for c, r in rewards) / pairs, rel=1e-4, abs=1e-6)
    assert final["eval_rewards/min"] == pytest.approx(min(min(p) for p in rewards), rel=1e-4, abs=1e-6)
    assert final["eval_rewards/max"] == pytest.approx(max(max(p) for p in rewards), rel=1e-4, abs=1e-6)
    # `hfsdp export` of the last checkpoint writes the same reward model (the checkpoint's model/ holds the causal
    # LM's config: the plugin's export writes the sequence-classification one)
    out = run.parent / "exported-step-4"
    run_cli("export", str(run / "checkpoints" / f"step-{STEPS}"), str(out), env=RUN_ENV)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    from safetensors.torch import load_file

    got, want = load_file(out / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def refused_in_process(sections: dict, world: int, tmp_path: Path) -> str:
    """What hfsdp refuses of a config before anything loads, asked in this process: its validation and the rule
    table's phases of the config, its data, the world of ``world`` ranks and the model's config (the CLI's
    load_config and enforce), and the run decided for them (decide); the message, or "" where none refuses (a
    refusal made later, from the data, is then for the CLI run to show)."""
    import sys

    from hfsdp.config.files import load_config
    from hfsdp.errors import UserError
    from hfsdp.layout.degrees import World
    from hfsdp.model import loading
    from hfsdp.rules.table import Facts, enforce
    from hfsdp.setup.decide import decide

    rewards = RUN_ENV["PYTHONPATH"].split(os.pathsep)[0]
    sys.path.insert(0, rewards)  # GRPO's reward function, as the runs see it
    try:
        config, host = load_config(str(tiny_config(tmp_path, **sections)))
        launched = World(rank=0, size=world, local_size=world, on_cpu=True)
        enforce(config, Facts(host, launched, **loading.model_facts(config.model, CACHE_DIR)),
                ("config", "data", "world", "model"))
        decide(config, launched, None)
    except UserError as refused:
        return str(refused)
    finally:
        sys.path.remove(rewards)
    return ""


def end_to_end_refusals(full: bool) -> set:
    """The refused smoke cell or pair that shows each refusal through the CLI (the first of its reason, cells before
    pairs): the others of the same reason are asserted in process (:func:`refused_in_process`)."""
    first: dict[str, object] = {}
    for cell in SMOKE if full else CI_SMOKE:
        if cell in REFUSED:
            first.setdefault(REFUSED[cell], cell)
    for pair in ALL_PAIRS if full else CI_PAIRS:
        if frozenset(pair) in REFUSED_PAIRS:
            first.setdefault(REFUSED_PAIRS[frozenset(pair)], pair)
    return set(first.values())


def assert_refused_before_loading(runs, key: str, world: int, sections: dict, reason: str, shown: bool,
                                  tmp_path: Path) -> None:
    """Refused with ``reason`` before any weight loads: in this process where another cell or pair shows the same
    refusal through the CLI and the refusal is the config's own (validation or the decided run); else through the
    CLI (:func:`assert_refused`)."""
    if not shown:
        said = refused_in_process(sections, world, tmp_path)
        if said:
            assert reason in said, said
            return
    run, proc = runs.run(key, world, sections, check=False)
    assert_refused(proc, run, world, reason)


def test_smoke(runs, smoke_cell, request, tmp_path):
    version, world, option = smoke_cell
    if (version, world, option) in REFUSED:
        shown = smoke_cell in end_to_end_refusals(request.config.getoption("full_matrix"))
        assert_refused_before_loading(runs, f"fsdp{version}-x{world}-{option}", world,
                                      smoke_sections(version, world, option), REFUSED[smoke_cell], shown, tmp_path)
        return
    run, proc = smoke_run(runs, version, world, option)
    assert_trained(run, proc, smoke_sections(version, world, option), (option,), version, world)


def test_fsdp1_computes_what_fsdp2_computes(runs, version_cell):
    _, world, option = version_cell
    one, _ = smoke_run(runs, 1, world, option)
    two, _ = smoke_run(runs, 2, world, option)
    a, b = losses(one), losses(two)
    for step in range(1, STEPS + 1):
        assert a[step][0] == pytest.approx(b[step][0], rel=LOSS_REL.get(option, DEFAULT_LOSS_REL)), (step, a, b)
        assert a[step][1] == pytest.approx(b[step][1], rel=GRAD_REL.get(option, DEFAULT_GRAD_REL)), (step, a, b)


def test_two_ranks_of_one_pair_each_compute_what_one_process_of_two_pairs_computes(runs):
    """ORPO's NLL term is a token mean over the global batch (its tokens summed over the ranks before the
    forwards): 2 ranks of 1 pair each give the losses, NLL, metrics and evals of the one-process smoke run."""
    one, _ = smoke_run(runs, 2, 1, "orpo")
    sections = _merge(smoke_sections(2, 2, "orpo"), {"train": {"per_device_batch_size": 1}})
    two, _ = runs.run("fsdp2-x2-orpo-1pair", 2, sections)
    a, b = read_metrics(one), read_metrics(two)
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    compared = 0
    for x, y in zip(a, b):
        for key in ("loss", "nll_loss", "rewards/margins", "log_odds_ratio", "eval_loss", "eval_nll_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (key, x, y)  # margins near 0
                compared += 1
        if "grad_norm" in x:  # float32 sums of other orders over the shards
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3), (x, y)
    assert compared >= 4 * STEPS


def test_two_ranks_compute_what_one_process_computes_for_the_reward_model(runs):
    """The reward model on 2 ranks of 2 pairs each gives the losses, metrics (the extreme rewards over both ranks)
    and evals of one process of 4 pairs (within :func:`compare_reward_model_metrics`' bounds)."""
    two, _ = smoke_run(runs, 2, 2, "reward_model")
    sections = _merge(smoke_sections(2, 1, "reward_model"), {"train": {"per_device_batch_size": 4}})
    one, _ = runs.run("fsdp2-x1-reward_model-4pairs", 1, sections)
    assert compare_reward_model_metrics(read_metrics(one), read_metrics(two)) >= 8 * 3


def compare_reward_model_metrics(a: list[dict], b: list[dict]) -> int:
    """Two reward-model runs' metrics ``a`` and ``b`` of the same steps computed in other float32 orders (2 ranks or
    one process, packed or not). The loss is the same for every reward shifted by one constant, so nothing holds the
    rewards' common level but the small centring term: Adam's per-element steps turn float32 noise in that
    direction's tiny gradient into a shift of every reward of a step alike (measured: 8e-6 at step 3, 1.5e-5 at step
    4, with lr 3e-3, 1 process against 2 ranks). The rewards are compared as their distances from the step's mean
    reward (within 1e-5: a CI rehearsal measured 3.5e-6 for rewards/min at step 2, where an earlier machine gave
    under 1e-6), their level within 1e-3 (this machine: 4.0e-4 at step 3, whose gradient norm is 0.044, where Adam's
    normalised steps amplify the noise most); the loss, margins and accuracy within 1e-4. Steps 1 to 3 and their
    evals are compared: step 3's Adam update on a gradient of norm 0.044 turns that noise into a step 4 2e-3 apart in
    gradient norm on this machine. Returns how many values it compared."""
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    levels = ("rewards/chosen", "rewards/rejected", "rewards/mean", "rewards/min", "rewards/max")
    compared = 0
    for x, y in zip(a, b):
        if x["step"] > 3:  # after step 3's update on a gradient of norm 0.044: 2e-3 apart in grad norm here
            continue
        for key in x:
            if key.removeprefix("eval_") in levels:
                mean = key.replace(key.removeprefix("eval_"), "rewards/mean")
                assert y[key] - y[mean] == pytest.approx(x[key] - x[mean], abs=1e-5), (key, x, y)
                assert y[key] == pytest.approx(x[key], abs=1e-3), (key, x, y)
                compared += 1
            elif key.startswith(("loss", "rewards/", "eval_loss", "eval_rewards/")):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (key, x, y)  # margins near 0: 2.6e-6
                compared += 1
        if "grad_norm" in x:  # float32 sums of other orders over the shards
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3), (x, y)
    return compared


def test_two_ranks_compute_what_one_process_computes_for_kto(runs):
    """KTO on 2 ranks of 2 rows each gives the losses, metrics (the KL estimate a mean over both ranks' KL rows) and
    evals of one process of 4 rows: the KL rows are the completions rotated within chunks of the global batch, the
    same rows on both. The eval's KL rows too (chunks of the global batch in the eval split's order)."""
    two, _ = smoke_run(runs, 2, 2, "kto")
    sections = _merge(smoke_sections(2, 1, "kto"), {"train": {"per_device_batch_size": 4}})
    one, _ = runs.run("fsdp2-x1-kto-4rows", 1, sections)
    a, b = read_metrics(one), read_metrics(two)
    assert compare_log_prob_metrics(a, b, ("loss", "rewards/", "logps/", "kl")) >= 5 * STEPS
    assert all(m["kl"] > 0 for m in a if "kl" in m and m["step"] > 1), a  # compared above 0, not clamped


def compare_log_prob_metrics(a: list[dict], b: list[dict], names: tuple[str, ...], left_out: tuple[str, ...] = (),
                             beta: float = 0.1, logps_rel: float = 4e-7) -> int:
    """One process's metrics ``a`` and 2 ranks' ``b`` of an objective made of log-prob differences: the same names
    each step, those starting with ``names`` (and not in ``left_out``; evals' too) equal, the gradient norms within
    float32 sums of other orders. Returns how many values it compared.

    Rewards and KL are differences of float32 log-probs of hundreds (the reference's computed in batches of other
    padding on 2 ranks): within ``logps_rel`` (4e-7) of those log-probs (about 3 float32 ulps for each of the up to four sums in a
    margin; times ``beta`` for rewards: DPO's and KTO's 0.1). A CI machine measured 1.1e-7 for KTO's
    rewards/margins."""
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    compared = 0
    for x, y in zip(a, b):
        logps = max((abs(v) for k, v in x.items() if "logps/" in k), default=0.0)
        for key in x:
            name = key.removeprefix("eval_")
            if name.startswith(names) and name not in left_out:
                near = logps_rel * logps * (beta if name.startswith("rewards/") else 1.0)
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=max(near, 1e-6)), (key, x, y)
                compared += 1
        if "grad_norm" in x:  # float32 sums of other orders over the shards
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3), (x, y)
    return compared


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("option", list(PACKED_FROM))
def test_packed_micro_batches_compute_the_unpacked_steps(runs, option, world):
    """Each objective with its micro-batches packed trains on the rows its unpacked run trains on, each step, with
    the same per-sequence log-probs (float32 sums of other orders: other matrix shapes): the losses, metrics and
    evals of the unpacked run, as 2 ranks give those of one process (:func:`compare_log_prob_metrics`; the reward
    model's: :func:`compare_reward_model_metrics`), GRPO the same completions; with less padding each step. The
    accuracy is left out: at step 1 the policy is the reference and a pair's margin is float32 noise (the reference's
    log-probs computed in micro-batches of other padding), whose sign each layout draws anew."""
    packed, _ = smoke_run(runs, 2, world, option)
    plain, _ = smoke_run(runs, 2, world, PACKED_FROM[option])
    a, b = read_metrics(plain), read_metrics(packed)
    if option == "packing_reward_model":
        assert compare_reward_model_metrics(a, b) >= 8 * 3
    else:
        names = ("loss", "rewards/", "logps/", "nll_loss", "log_odds", "kl", "distill/", "entropy", "reward")
        beta = {"lora_packing_simpo": 2.0, "packing_ipo": 0.5}.get(option, 0.1)  # SimPO's default; IPO's above
        # IPO pulls each log-ratio to 1 / (2 beta) = 1, the rewards up to 7 by step 4 (DPO's: under 1): three Adam
        # steps on float32 noise leave its step-4 eval rewards 1.0e-6 of the log-probs apart on 2 ranks
        rel = 1.5e-6 if option == "packing_ipo" else 4e-7
        assert compare_log_prob_metrics(a, b, names, left_out=("rewards/accuracy",), beta=beta,
                                        logps_rel=rel) >= 2 * STEPS
    steps = [(x["padding"], y["padding"]) for x, y in zip(a, b) if "padding" in x]
    assert len(steps) == STEPS and all(y <= x for x, y in steps), steps
    if option == "packing_grpo":
        assert read_completions(packed) == read_completions(plain)


@pytest.mark.parametrize("option", ["dpo_tools", "grpo_tools"])
def test_two_ranks_compute_what_one_process_computes_on_tool_conversations(runs, option):
    """DPO on tool conversations and GRPO with a tools column: 2 ranks of 2 rows each give the losses, metrics and
    (GRPO) completions of one process of 4 rows."""
    two, _ = smoke_run(runs, 2, 2, option)
    sections = _merge(smoke_sections(2, 1, option), {"train": {"per_device_batch_size": 4}})
    one, _ = runs.run(f"fsdp2-x1-{option}-4rows", 1, sections)
    a, b = read_metrics(one), read_metrics(two)
    # DPO's accuracy counts margins of float32 rounding's size at step 1: left out
    assert compare_log_prob_metrics(a, b, ("loss", "rewards/", "reward", "logps/"), ("rewards/accuracy",)) >= 2 * STEPS
    if option == "grpo_tools":
        ids = [[c["completion_ids"] for c in read_completions(run)] for run in (one, two)]
        assert ids[0] == ids[1]


def test_options_act(runs):
    """Each option changes the run it is added to (a matrix of options that silently did nothing would pass)."""
    base = losses(smoke_run(runs, 2, 2, "base")[0])
    for option in ("packing", "lora", "bf16", "dpo", "orpo", "lora_simpo", "reward_model", "mixture", "grpo",
                   "distill"):
        changed = losses(smoke_run(runs, 2, 2, option)[0])
        assert changed[2][0] != base[2][0], option
    # accumulation and checkpointing compute the same steps: same losses, other micro-batches / recomputation
    for option in ("accumulation", "checkpointing", "plain_loss", "compile"):
        same = losses(smoke_run(runs, 2, 2, option)[0])
        assert same[STEPS][0] == pytest.approx(base[STEPS][0], rel=1e-4), option
    # schedule-free's first step is AdamW's (Adam's first normalised step, no average yet): compared at the last
    for option in ("muon", "schedule_free"):
        assert losses(smoke_run(runs, 2, 2, option)[0])[STEPS][0] != base[STEPS][0], option


def test_plan_counts_the_teacher_each_rank_holds(runs):
    """``hfsdp plan`` of a distillation run adds the frozen teacher to each row (its ``frozen`` bytes): on 2 FSDP2
    ranks the teacher's parameters rank 0 holds (as many as the run said it held), on one process all of them, and
    in both its logits over the micro-batch; every rank loads the teacher whole (host RAM at load)."""
    run, proc = smoke_run(runs, 2, 2, "distill")
    said = re.search(r"sharded over 2 ranks \(FSDP2\): ([\d,]+) of its ([\d,]+) parameters on rank 0",
                     proc.stdout + proc.stderr)
    assert said, (proc.stdout + proc.stderr)[-3000:]
    mine, whole = (int(n.replace(",", "")) for n in said.groups())
    plan = json.loads(run_cli("plan", str(run.parent / "config.yaml"), "--nproc", "1,2", "--strategies",
                              "FULL_SHARD", "--json", env=RUN_ENV).stdout)
    rows = {r["world"]: r for r in plan["rows"]}
    config = yaml.safe_load((run.parent / "config.yaml").read_text())
    vocab = json.loads((tiny_teacher_folder() / "config.json").read_text())["vocab_size"]
    logits = config["train"]["per_device_batch_size"] * config["data"]["max_seq_len"] * vocab * 4  # float32
    assert rows[2]["frozen"] == 4 * mine + logits and rows[1]["frozen"] == 4 * whole + logits, rows
    assert rows[2]["host_load_per_node"] == 2 * 4 * (plan["parameters"] + whole), rows  # float32 student + teacher


# Pairs (issue 34): each feature here meets each other one, the pairs generated from this table, on 2 ranks (FSDP2;
# FSDP1 when fsdp1 is one of the pair). A feature names the parts of hfsdp it changes: pairs whose features share a
# part run in CI, and those that meet in a resumed part are resumed; the others, which share no code, run with
# ``pytest --full-matrix``. A feature that lands adds a row here and so meets every other one.
FEATURES = {
    # first: its data is that of the format the other feature chose (with_tools), before a mixture is made of it
    "agent": {"rows"},                          # tool conversations, masked by a template's generation markers
    # second: rollouts that act on the tool prompts (turns of calls, an environment each, tool results masked), before
    # a mixture is made of them
    "acting": {"rows", "loss"},
    # third: the online objective's rounds sampled by a generation process from the published full parameters
    "workers": {"rows", "params"},
    "checkpointing": {"layers"},                # each decoder layer in a CheckpointWrapper
    "compile": {"layers", "attention"},         # each decoder layer compiled (Inductor)
    "size_wrap": {"layers", "units"},           # FSDP units of its own policy
    "fsdp1": {"units", "params", "model_state", "optim_state"},  # flat parameters, ShardedTensor state dicts
    "lora": {"params", "model_state"},          # adapters trained and exported
    "qlora": {"params", "layers", "model_state"},  # a 4-bit Linear in every layer, probed after sharding
    "packing": {"rows", "attention"},           # rows of several samples, position_ids
    "mixture": {"rows"},                        # rows of several sources
    "dpo": {"rows", "loss"},                    # preference rows, two completions a row
    "async_save": {"model_state", "optim_state"},  # checkpoints staged, then written in the background
    "grpo": {"layers", "rows", "loss"},         # generation through every layer, rounds of completions
    # RLOO's own code is its advantages and loss: its sampling and rounds are GRPO's (the pairs of "grpo")
    "rloo": {"loss"},
    # on-policy distillation's own code is its loss (a teacher's, distill's): its sampling is GRPO's
    "distill_online": {"loss"},
    "muon": {"params", "optim_state"},          # whole-matrix updates of the 2-D weights; AdamW for the rest
    "schedule_free": {"optim_state"},           # two weight sequences: the averaged one evaluated, saved, exported
    "tp2": {"layers", "params", "model_state", "optim_state"},  # split projections: 2-D DTensors, their states
    "sp2": {"rows", "attention", "loss"},       # each row's positions split, heads exchanged, the loss's counts
    "cp2": {"rows", "attention", "loss"},       # each row's positions split, keys and values around a ring
    "tiled_mlp": {"layers"},                    # each layer's MLP in checkpointed tiles
    "moe": {"layers", "params", "loss"},        # experts' 3-D weights, the router's loss added to the step's
    "ep2": {"layers", "params", "model_state", "optim_state"},  # experts split: DTensors on a 2-D mesh, their states
    "vlm": {"rows", "units", "params"},         # image rows and pixel inputs, units by part, the tower frozen
}
PAIR_ONLY = {"fsdp1": {"fsdp": {"version": 1}}}  # features that are not an option of the smoke matrix
# In pairs, compile runs dynamo's capture and AOTAutograd (backend aot_eager) around the other feature's code, where
# a pairing breaks, without Inductor's C++ builds (a minute or two a pair on CPU); Inductor itself runs in the
# smoke and resume cells and in tests/test_compile.py.
PAIR_OPTIONS = {**OPTIONS, **PAIR_ONLY, "compile": {"train": {"compile": {"backend": "aot_eager"}}}}
# What a pair cannot do, refused before any weight loads with this reason (the first three as in REFUSED).
REFUSED_PAIRS = {
    frozenset(("compile", "fsdp1")): "train.compile: FSDP1 flattens each unit's parameters",
    frozenset(("qlora", "fsdp1")): "QLoRA runs under FSDP2 only",
    frozenset(("async_save", "fsdp1")): "train.async_save: FSDP1's sharded state dict holds ShardedTensors",
    frozenset(("dpo", "grpo")): "dpo trains on preference rows (prompt, chosen, rejected), not 'prompt'",
    frozenset(("dpo", "rloo")): "dpo trains on preference rows (prompt, chosen, rejected), not 'prompt'",
    frozenset(("grpo", "rloo")): "two plugins replace the training objective: grpo, rloo",
    frozenset(("dpo", "distill_online")): "dpo trains on preference rows (prompt, chosen, rejected), not 'prompt'",
    frozenset(("grpo", "distill_online")): "two plugins replace the training objective: grpo, distill_online",
    frozenset(("rloo", "distill_online")): "two plugins replace the training objective: rloo, distill_online",
    frozenset(("lora", "distill_online")): "distill_online is not combined with lora yet",
    frozenset(("qlora", "distill_online")): "distill_online is not combined with lora yet",
    frozenset(("tp2", "distill_online")): "(a plugin's objective) is not composed with tensor parallelism yet",
    frozenset(("tp2", "rloo")): "(a plugin's objective) is not composed with tensor parallelism yet",
    frozenset(("muon", "fsdp1")): "muon cannot run under FSDP1",
    frozenset(("tp2", "fsdp1")): "parallel.tp_size 2 composes with FSDP2 only",
    frozenset(("tp2", "compile")): "torch 2.13 cannot yet trace the split blocks",
    frozenset(("tp2", "size_wrap")): "the size policy is not composed with tensor parallelism",
    frozenset(("tp2", "lora")): "LoRA's adapters are not split by the tensor-parallel plan",
    frozenset(("tp2", "qlora")): "bitsandbytes' 4-bit Linears cannot be split",
    frozenset(("tp2", "dpo")): "(a plugin's objective) is not composed with tensor parallelism yet",
    frozenset(("tp2", "grpo")): "(a plugin's objective) is not composed with tensor parallelism yet",
    frozenset(("sp2", "compile")): "compiled blocks with the all-to-all inside are not tried yet",
    frozenset(("sp2", "tp2")): "tensor x sequence parallelism is not built yet",
    **{frozenset(("sp2", name)): "(a plugin's objective) is not composed with sequence parallelism yet"
       for name in ("dpo", "grpo", "rloo", "distill_online", "acting")},
    frozenset(("dpo", "acting")): "dpo trains on preference rows (prompt, chosen, rejected), not 'prompt'",
    frozenset(("tp2", "acting")): "(a plugin's objective) is not composed with tensor parallelism yet",
    frozenset(("dpo", "workers")): "dpo trains on preference rows (prompt, chosen, rejected), not 'prompt'",
    frozenset(("tp2", "workers")): "(a plugin's objective) is not composed with tensor parallelism yet",
    frozenset(("sp2", "workers")): "(a plugin's objective) is not composed with sequence parallelism yet",
    frozenset(("acting", "workers")): "the workers engine samples single-turn completions",
    frozenset(("qlora", "workers")): "the generation processes hold a full-precision copy of the policy",
    frozenset(("tp2", "moe")): "qwen3_moe's tensor-parallel plan uses replicated_with_grad_allreduce, which hfsdp "
                               "does not apply yet",
    frozenset(("ep2", "fsdp1")): "expert parallelism needs FSDP2",
    frozenset(("ep2", "compile")): "compiled blocks with the token exchange inside",
    frozenset(("ep2", "size_wrap")): "the size policy is not composed with expert parallelism",
    frozenset(("ep2", "qlora")): "quantized experts are not split by expert parallelism",
    frozenset(("ep2", "tp2")): "tensor x expert parallelism is not built yet",
    frozenset(("ep2", "sp2")): "sequence x expert parallelism is not built yet",
    frozenset(("vlm", "distill_online")): "not with distill_online",
    frozenset(("vlm", "acting")): "with single-turn completions so far",
    frozenset(("vlm", "workers")): "sampling inline so far",
    frozenset(("vlm", "packing")): "trains without packing so far",
    frozenset(("vlm", "qlora")): "without 4-bit quantization so far",
    frozenset(("vlm", "tp2")): "trains without tensor parallelism so far",
    frozenset(("vlm", "sp2")): "trains without sequence parallelism so far",
    frozenset(("cp2", "compile")): "compiled blocks with the ring's passes inside are not tried yet",
    frozenset(("cp2", "tp2")): "tensor x context (ring attention) parallelism is not built yet",
    **{frozenset(("cp2", name)): "(a plugin's objective) is not composed with context parallelism yet"
       for name in ("dpo", "grpo", "rloo", "distill_online", "acting", "workers")},
    frozenset(("cp2", "sp2")): "cp_size 2 x sp_size 2 is 4 ranks a group, which does not divide the world size 2",
    frozenset(("ep2", "cp2")): "context x expert parallelism is not built yet",
    frozenset(("vlm", "cp2")): "trains without context parallelism so far",
    frozenset(("tiled_mlp", "compile")): "compiled blocks with checkpointed MLP tiles inside are not tried yet",
    frozenset(("tiled_mlp", "moe")): "is a mixture of experts, whose MLP (its router and experts) is not tiled",
    frozenset(("tiled_mlp", "ep2")): "is a mixture of experts, whose MLP (its router and experts) is not tiled",
    frozenset(("vlm", "ep2")): "trains without expert parallelism so far",
}


def pair_sections(*features: str) -> dict:
    """The smoke run's sections (FSDP2, 2 ranks) with ``features`` (none: the base run)."""
    return compose(smoke_sections(2, 2, "base"), *(PAIR_OPTIONS[name] for name in features))


def _pairs() -> list[tuple[str, str]]:
    """Every pair of :data:`FEATURES` but those where one feature holds the other (qlora is lora on a 4-bit base)."""
    return [(a, b) for a, b in itertools.combinations(FEATURES, 2)
            if pair_sections(a, b) not in (pair_sections(a), pair_sections(b))]


ALL_PAIRS = _pairs()
# compile's pairs cost 1 to 2.3 minutes each of dynamo's tracing on CI's 2 cores (the CI rehearsals of
# 2026-12-03): they run with --full-matrix; compile itself runs on 2 ranks, and with activation checkpointing and
# packing, in tests/test_compile.py (and in the smoke and resume cells with --full-matrix).
FULL_MATRIX_PAIRS = {frozenset(("compile", other)) for other in ("checkpointing", "qlora", "size_wrap", "packing",
                                                                  "grpo")}
# The workers engine meets the rows' options and the parameters' in CI through packing (the trainer's old log-probs
# of packed rows against the sampler's unpacked ones) and FSDP1 (its smoke cell: the full parameters summoned); its
# other pairs (LoRA on 1 and 2 ranks: tests/test_generation_engine.py) with --full-matrix.
FULL_MATRIX_PAIRS |= {frozenset(("workers", other)) for other in ("agent", "mixture", "fsdp1", "lora", "muon")}
# A mixture of experts meets in CI the options that change its experts' weights (FSDP1 flattens them, LoRA freezes
# them) and recomputes its layers (checkpointing: a recomputed layer's tokens not counted twice); its other pairs
# with --full-matrix.
FULL_MATRIX_PAIRS |= {frozenset(("moe", other)) for other in FEATURES if other not in ("moe", "checkpointing",
                                                                                       "fsdp1", "lora")}
# Expert parallelism meets in CI what recomputes its layers (each exchange again in backward) and LoRA (frozen
# split experts); its other pairs, its refusals aside, with --full-matrix.
FULL_MATRIX_PAIRS |= {frozenset(("ep2", other)) for other in FEATURES if other not in ("ep2", "checkpointing", "lora")
                      and frozenset(("ep2", other)) not in REFUSED_PAIRS}
# A vision-language model meets in CI LoRA (peft's default targets on its projector); its other pairs that train
# (tool conversations, the other units and optimizers, a mixture of image rows, FSDP1: SmolVLM's in
# tests/test_vision.py) with --full-matrix.
FULL_MATRIX_PAIRS |= {frozenset(("vlm", other)) for other in FEATURES if other not in ("vlm", "lora")
                      and frozenset(("vlm", other)) not in REFUSED_PAIRS}
# Context parallelism meets in CI packed rows (each sequence attends within itself around the ring); its other pairs
# (its refusals named in tests/test_sequence_parallel.py's rules too) with --full-matrix.
FULL_MATRIX_PAIRS |= {frozenset(("cp2", other)) for other in FEATURES if other not in ("cp2", "packing")}
# The tiled MLP meets activation checkpointing in CI in tests/test_tiled_mlp.py; its pairs with --full-matrix.
FULL_MATRIX_PAIRS |= {frozenset(("tiled_mlp", other)) for other in FEATURES if other != "tiled_mlp"}
CI_PAIRS = [(a, b) for a, b in ALL_PAIRS if FEATURES[a] & FEATURES[b] and frozenset((a, b)) not in FULL_MATRIX_PAIRS]


# Features that compute the steps of the run without them (recomputed, compiled, other units, saved otherwise).
SAME_STEPS = ("checkpointing", "compile", "size_wrap", "async_save")


# The parts a resume restores (state dicts) or replays (the rows of each step): pairs with a feature that changes
# one of them are resumed; the others resume as their features do alone.
RESUMED_PARTS = {"model_state", "optim_state", "rows"}


def pytest_generate_tests(metafunc):
    """CI's tier of each matrix, or with ``pytest --full-matrix`` all of it: every smoke and resume cell, every pair,
    and the resume of every pair with a feature that changes a resumed part (CI's: pairs that meet in one)."""
    full = metafunc.config.getoption("full_matrix")
    pairs = ALL_PAIRS if full else CI_PAIRS
    # CI resumes tensor parallelism in its smoke cell and in tests/test_tensor_parallel.py (4 ranks, FULL_STATE_DICT,
    # other dp ranks); its pairs' resumes run with --full-matrix
    resumed = [(a, b) for a, b in pairs if frozenset((a, b)) not in REFUSED_PAIRS
               and RESUMED_PARTS & ((FEATURES[a] | FEATURES[b]) if full else (FEATURES[a] & FEATURES[b]))
               and (full or "tp2" not in (a, b))]
    smoke = SMOKE if full else CI_SMOKE
    cells = {"smoke_cell": smoke,
             "version_cell": [(v, w, o) for v, w, o in smoke if v == 1 and (1, w, o) not in REFUSED],
             "resume_cell": RESUME if full else CI_RESUME}
    for name, which in cells.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, which, ids=[f"fsdp{v}-x{w}-{o}" for v, w, o in which])
    for name, which in (("pair", pairs), ("resumed_pair", resumed)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, which, ids=[f"{a}+{b}" for a, b in which])


def pair_run(runs: RunRegistry, pair: tuple[str, str]):
    return runs.run("+".join(pair), 2, pair_sections(*pair), check=frozenset(pair) not in REFUSED_PAIRS)


def test_pair(runs, pair, request, tmp_path):
    if frozenset(pair) in REFUSED_PAIRS:
        shown = pair in end_to_end_refusals(request.config.getoption("full_matrix"))
        assert_refused_before_loading(runs, "+".join(pair), 2, pair_sections(*pair), REFUSED_PAIRS[frozenset(pair)],
                                      shown, tmp_path)
        return
    run, proc = pair_run(runs, pair)
    sections = pair_sections(*pair)
    assert_trained(run, proc, sections, pair, sections["fsdp"]["version"], 2)
    same = [f for f in pair if f in SAME_STEPS]
    if same:  # the steps of the pair without it: the other feature alone, or the base run
        rest = [f for f in pair if f != same[0]]
        alone, _ = runs.run("+".join(rest) or "base", 2, pair_sections(*rest))
        a, b = losses(run), losses(alone)
        for step in range(1, STEPS + 1):
            assert a[step][0] == pytest.approx(b[step][0], rel=1e-4), (step, a, b)


# Pairs whose resume gives the same steps, but not bit for bit, and why.
INEXACT_RESUMES = {
    frozenset(("compile", "grpo")): "Inductor recompiles a block with dynamic shapes once it has seen a second "
                                    "sequence length (generation sees many), so a resumed process, which has seen "
                                    "other lengths, runs other kernels: the near-zero loss of a round's first step "
                                    "(4.17e-7) came out 4.06e-7",
}


def test_pair_resumes_exactly(runs, resumed_pair, tmp_path):
    run, _ = pair_run(runs, resumed_pair)
    resumed = resume(tmp_path, run, 2)
    if frozenset(resumed_pair) in INEXACT_RESUMES:
        a, b = losses(resumed), losses(run)
        assert sorted(a) == [3, 4]
        for step in (3, 4):
            assert a[step] == pytest.approx(b[step], rel=1e-5, abs=1e-7), (step, a, b)
        return
    assert_resumed_exactly(resumed, run)


def resume(folder: Path, uninterrupted: Path, world: int) -> Path:
    """A copy of ``uninterrupted``'s step-2 checkpoint resumed to step 4 under ``folder``: the calling test's own
    (``tmp_path``, gone once it passes), since no other test reads a resumed run; the run registry's runs are kept
    for the whole session, and the suite's disk use is theirs."""
    return resume_from(folder, uninterrupted, world, step=2)


def resume_from(folder: Path, uninterrupted: Path, world: int, step: int, changes: dict | None = None) -> Path:
    """A copy of ``uninterrupted``'s checkpoint of ``step`` resumed to its last step in ``folder``, its config's
    sections with ``changes`` merged over them (:func:`_merge`)."""
    target = folder / "run" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints" / f"step-{step}", target / f"step-{step}")
    config = _merge(yaml.safe_load((uninterrupted / "config.yaml").read_text()), changes or {})
    config["train"]["output_dir"] = str(folder / "run")
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    args = ("train", str(folder / "config.yaml"), "--resume")
    proc = run_cli(*args, env=RUN_ENV) if world == 1 else run_torchrun(world, *args, env=RUN_ENV)
    assert f"resumed from {target / f'step-{step}'} at step {step}" in proc.stdout + proc.stderr
    assert "UserWarning" not in proc.stderr, proc.stderr[-3000:]  # FSDP1's load printed torch's deprecations
    return folder / "run"


def assert_resumed_exactly(resumed: Path, uninterrupted: Path) -> None:
    import torch

    a, b = losses(resumed), losses(uninterrupted)
    assert sorted(a) == [3, 4]
    for step in (3, 4):
        assert a[step] == b[step], (step, a, b)  # loss and grad norm, bit for bit
    got, want = exported(resumed), exported(uninterrupted)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for key, tensor in want[name].items():
            assert torch.equal(got[name][key], tensor), (name, key)


# async_save resumes exactly on 2 ranks in test_reliability.py (the same combination, resumed after a kill -9 of
# rank 1 mid-write: test_async_kill_9_of_rank_1_mid_background_write_then_the_resume_is_bit_exact_on_two_ranks),
# so it is not run again here.
RESUME = ([(v, w, o) for v in (1, 2) for w in (1, 2)
           for o in ("base", "full_state_dict", "lora", "lora_full_state_dict") if (v, w, o) not in REFUSED]
          + [(2, 2, o) for o in ("packing", "checkpointing", "bf16", "accumulation", "shard_grad_op",
                                      "size_wrap", "plain_loss", "compile", "dpo", "orpo", "lora_simpo", "reward_model",
                                      "kto", "mixture", "grpo", "muon", "schedule_free", "distill", "adamw_8bit",
                                      "adafactor", "qlora_adamw_8bit", "tp2", "sp2", "cp2", "agent", "dpo_tools",
                                      "grpo_tools", "acting", "workers", "moe", "ep2", "vlm", "vlm_dpo", "vlm_grpo",
                                      "rloo", "lora_rloo", "distill_online", *GRPO_LOSS_OPTIONS,
                                      *PACKED_OPTIONS)]
          # FSDP1's load left a stale gathered root (hfsdp.parallel.accelerator.fsdp1_drop_stale_gathers)
          + [(1, 2, "schedule_free")]
          + [(2, 2, "qlora"), (2, 1, "qlora_checkpointing")])  # 2 ranks: test_pair_resumes_exactly[checkpointing+qlora]
# CI's tier: one process resumes the base run and LoRA (FSDP1: the base run), a full state dict on 2 ranks; the
# full-logits loss and ORPO resume as the base run and SimPO do, the reward model (its head a parameter like the
# others, rebuilt from the seed before the checkpoint loads) as the base run; FSDP1's schedule-free run resumes in
# CI as the pair schedule_free+fsdp1 (test_pair_resumes_exactly), 8-bit AdamW in tests/test_optimizers.py.
CI_RESUME = [(v, w, o) for v, w, o in RESUME
             if not (w == 1 and o not in ("base", "lora", "qlora_checkpointing"))
             and o not in ("plain_loss", "orpo", "reward_model", "kto", "agent", "dpo_tools", "grpo_tools",
                           "vlm_dpo", "vlm_grpo",  # (tests/test_vision.py resumes them on 2 ranks)
                           "cp2")  # (CI resumes the ring as the pair packing+cp2)
             # packed micro-batches are a pure function of the step's rows: CI resumes packing+dpo and packing+grpo
             # (the pairs, the same runs as packing_dpo and packing_grpo), the other objectives with --full-matrix
             and o not in PACKED_OPTIONS
             and o not in CI_ELSEWHERE
             and (v, o) != (1, "schedule_free") and (o not in GRPO_LOSS_OPTIONS or o == "lora_grpo_cispo")]


@pytest.mark.parametrize("saved, resumed_as", [("ep2", "moe"), ("moe", "ep2")])
def test_a_checkpoint_resumes_at_another_expert_parallel_size(runs, tmp_path, saved, resumed_as):
    """The experts' weights and optimizer states are saved as DTensors of the whole experts (DCP reshards them): the
    step-2 checkpoint of the ep 2 run resumes at ep 1 and trains steps 3 and 4 as the ep 1 run did, and the other
    way round (float32 sums of other orders apart)."""
    import torch

    run, _ = smoke_run(runs, 2, 2, saved)
    other, _ = smoke_run(runs, 2, 2, resumed_as)
    resumed = resume_from(tmp_path, run, 2, step=2, changes={"parallel": {"ep_size": 2 if resumed_as == "ep2" else 1}})
    a, b = losses(resumed), losses(other)
    assert sorted(a) == [3, 4]
    for step in (3, 4):
        assert a[step] == pytest.approx(b[step], rel=1e-5), (step, a, b)
    got, want = exported(resumed)["model.safetensors"], exported(other)["model.safetensors"]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_resume_is_exact(runs, resume_cell, tmp_path):
    version, world, option = resume_cell
    run, _ = smoke_run(runs, version, world, option)
    resumed = resume(tmp_path, run, world)
    assert_resumed_exactly(resumed, run)
    if any(name in option for name in ("grpo", "rloo", "distill_online")):  # step 3 trained on the restored
        # round's completions; step 4 sampled the same ones
        assert read_completions(resumed) == [c for c in read_completions(run) if c["step"] == 4]


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_resume_is_exact_fsdp2(runs, name, tmp_path):
    world, fsdp = EXTRA[name]
    sections = _merge({"train": TRAIN, "fsdp": {"version": 2, **fsdp}},
                      {"train": {"per_device_batch_size": 1}} if world == 4 else {})
    run, _ = runs.run(f"fsdp2-x{world}-{name}", world, sections)
    assert_resumed_exactly(resume(tmp_path, run, world), run)


def test_a_changed_optimizer_state_is_refused_on_resume(runs, tmp_path):
    """The check after loading: a checkpoint whose optimizer moments are not what the run had when it saved them
    (here: Adam's first moments doubled in the FULL optimizer file) is refused on every rank, before a step."""
    import torch

    run, _ = smoke_run(runs, 2, 2, "full_state_dict")
    folder = tmp_path / "tampered"
    shutil.copytree(run / "checkpoints" / "step-2", folder / "run" / "checkpoints" / "step-2")
    optimizer_file = folder / "run" / "checkpoints" / "step-2" / "optimizer.bin"
    state = torch.load(optimizer_file, weights_only=True)
    for per_param in state["state"].values():
        per_param["exp_avg"] = per_param["exp_avg"] * 2
    torch.save(state, optimizer_file)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["output_dir"] = str(folder / "run")
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = run_torchrun(2, "train", str(folder / "config.yaml"), "--resume", check=False)
    assert proc.returncode != 0
    errors = rank_errors(proc)  # the same on each rank, said once
    assert len(errors) == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert all("the optimizer state restored from" in e and "exp_avg sums to" in e for e in errors), errors
    assert "exp_avg_sq" not in errors[0].split("exp_avg sums to")[1].split(";")[0]
    assert not (folder / "run" / "metrics.jsonl").exists()  # refused before the first step
