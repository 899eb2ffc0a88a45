"""What hfsdp adds to FSDP's own collectives in a training step on 2 ranks, counted and pinned (issue 56).

Every collective hfsdp issues per step is paid on every device of every job, so each one here is a decision: the
test-only plugin ``tests/fault_plugin/hfsdp_collectives.py`` counts, on real 2-rank gloo runs of the shrunk SmolLM2,
every ``torch.distributed`` collective a step issues that is not FSDP's own (all-gathers and reduce-scatters, which a
bare FSDP loop issues too), by the hfsdp function that issued it. A step of steady state (step 3 of 3: no eval, no
save) must issue exactly the collectives listed below; adding one fails here until it is listed with its reason.
"""

from __future__ import annotations

import json

import pytest

from conftest import PRESET_DATA, REPO, base_env, run_torchrun, tiny_config, tiny_teacher_folder

pytestmark = pytest.mark.slow

ENV = base_env(PYTHONPATH=f"{REPO / 'tests' / 'fault_plugin'}:{REPO / 'tests' / 'reward_plugin'}")

# Every objective's step: the global batch's counts (the loss is divided by them; summed while the first forward
# runs), the gradient norm's squares with the loss sum and the objective's metric sums (one all-reduce:
# Objective.step_sums), and the end of step's flags (a background save written on every rank, a stop signal on any
# rank) in one all-reduce.
STEP = {"run.step:train_step > all_reduce": 2, "checkpoint.store:poll > all_reduce": 1}
EXPECTED = {
    "sft": STEP,
    "dpo": STEP,
    # KTO: each micro-step's KL estimate (summed over the ranks before its loss, as TRL's: 2 micro-steps here)
    "kto": {**STEP, "builtin.kto.loss:kl_estimate > all_reduce": 2},
    "distill": STEP,  # the frozen teacher's forwards gather its shards as FSDP's own collectives
    # GRPO (a new round each step): every rank's completions and rewards gathered, and the lock-step of sampling
    # (one all-reduce before each decode step: max_new_tokens 4, the first token drawn from the prefill)
    "grpo": {**STEP,
             "builtin.online.objective:_generate > all_gather_object": 1,
             "builtin.online.scoring:gathered > all_gather_object": 1,
             "builtin.online.sampling:decode > all_reduce": 3},
}
DATA = {"sft": {"format": "chat", "path": str(PRESET_DATA / "contacts_train.jsonl")},
        "dpo": {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl")},
        "kto": {"format": "unpaired", "path": str(PRESET_DATA / "contacts_unpaired_train.jsonl")},
        "grpo": {"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl")},
        "distill": {"format": "chat", "path": str(PRESET_DATA / "contacts_train.jsonl")}}


@pytest.mark.parametrize("objective", EXPECTED)
def test_a_step_on_2_ranks_issues_only_the_listed_collectives_beyond_fsdps(tmp_path, objective):
    sections = {"plugins": ([] if objective == "sft" else [objective]) + ["hfsdp_collectives"],
                "data": {**DATA[objective], "max_seq_len": 96, "eval_path": None},
                "train": {"max_steps": 3, "gradient_accumulation_steps": 2, "eval_at_start": False,
                          "export_final": False}}
    if objective == "distill":
        sections["distill"] = {"teacher": str(tiny_teacher_folder()), "loss": "jsd"}
    if objective == "grpo":
        sections["grpo"] = {"num_generations": 2, "max_new_tokens": 4,
                            "rewards": [{"name": "grpo_test_rewards:letters"}]}
    run_torchrun(2, "train", str(tiny_config(tmp_path, **sections)), env=ENV)
    steps = {rank: [json.loads(line) for line in
                    (tmp_path / "run" / f"collectives_rank{rank}.jsonl").read_text().splitlines()]
             for rank in (0, 1)}
    assert [s["step"] for s in steps[0]] == [1, 2, 3]
    last = steps[0][-1]
    assert last["fsdp"] > 0, "the counter saw none of FSDP's own collectives: it counts nothing"
    assert last["hfsdp"] == EXPECTED[objective]
    assert {k: v for k, v in steps[1][-1].items() if k != "hfsdp_s"} == {k: v for k, v in last.items() if k != "hfsdp_s"}
    assert set(steps[1][-1]["hfsdp_s"]) == set(last["hfsdp"])  # every rank issues the same collectives, each timed
