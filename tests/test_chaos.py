"""Chaos on 2 ranks for every stateful feature (issue 53): the whole job (torchrun and both ranks) killed with SIGKILL
at seeded random moments (start-up, steps, GRPO's sampling, saves, async writes, the export), started again with
the same ``--resume`` command line until the run finishes (tests/chaos.py); the run then holds every step once with
the uninterrupted run's losses and gradient norms, and exports its weights, bit for bit.

The uninterrupted run is the smoke matrix's options combined (tests/test_combinations.py: a checkpoint every 2 steps)
over 8 steps; the chaos run checkpoints every step (a ``RESUMABLE_CHANGES`` key), so that most kills have progress to
lose. A failure names its seed: the same kills
(steps and delays; the wall-clock moments vary with the machine) come back with it. CI runs GRPO with async saves and
tensor parallelism with schedule-free AdamW; ``--full-matrix`` the rest.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from chaos import FAULT_PLUGIN, LAST, campaign, schedule
from conftest import REPO, base_env, read_metrics, tiny_config
from test_combinations import _merge, compose, exported, losses, OPTIONS, smoke_sections

# feature -> the smoke matrix's options it combines (each a key of OPTIONS), and its seed
CHAOS = {
    "grpo+async_save": (("grpo", "async_save"), 53_01),
    "tp2+schedule_free": (("tp2", "schedule_free"), 53_02),
    "lora+grpo+muon": (("lora", "grpo", "muon"), 53_03),
    "dpo+adamw_8bit": (("dpo", "adamw_8bit"), 53_04),
    "kto+adafactor": (("kto", "adafactor"), 53_05),
    "mixture+packing+sgd": (("mixture", "packing", "sgd"), 53_06),
    "rloo+async_save": (("rloo", "async_save"), 53_07),
    "distill_online": (("distill_online",), 53_08),
    "acting+lora": (("acting", "lora"), 69_01),  # rollouts that act: kills inside their turns and tool calls
    # sampling beside the trainer (max_staleness 1): kills with a round in flight in the generation process
    "workers+lora+async_save": (("workers", "lora", "async_save"), 70_01),
}
# (tp2+schedule_free, 108 s of CI's 2 cores on 2026-12-07, runs with --full-matrix: CI kept to its budget)
CI = ("grpo+async_save",)
KILLS = 5
STEPS = 8
EXTRA_OPTIONS = {"sgd": {"train": {"optimizer": "sgd", "optimizer_args": {"momentum": 0.9}}}}


def sections_of(options: tuple[str, ...]) -> dict:
    """The smoke matrix's sections (FSDP2, 2 ranks) with ``options`` composed in order."""
    base = _merge(smoke_sections(2, 2, "base"), {"train": {"max_steps": STEPS}})
    return compose(base, *(EXTRA_OPTIONS.get(o) or OPTIONS[o] for o in options))


def pytest_generate_tests(metafunc):
    if "feature" in metafunc.fixturenames:
        full = metafunc.config.getoption("full_matrix")
        metafunc.parametrize("feature", [f for f in CHAOS if full or f in CI])


@pytest.mark.slow
def test_killed_at_random_moments_the_run_ends_with_the_uninterrupted_runs_losses_and_weights(run_registry, feature,
                                                                                               tmp_path):
    options, seed = CHAOS[feature]
    sections = sections_of(options)
    reference, _ = run_registry.run(f"chaos-reference-{feature}", 2, sections)

    folder = tmp_path / "chaos"
    folder.mkdir()
    chaos = _merge(sections, {"plugins": ["hfsdp_faults"], "train": {"save_every": 1}})
    config = tiny_config(folder, **chaos)
    env = base_env(PYTHONPATH=os.pathsep.join([str(FAULT_PLUGIN), str(REPO / "tests" / "reward_plugin")]))
    kills = schedule(seed, KILLS)
    done = campaign(2, config, folder / "run", STEPS, kills, env, tmp_path / "logs")
    said = f"seed {seed}, kills {kills}: {done.describe()}"
    assert len(done.kills) >= 2, said  # kills that interrupted something (the others came after the run ended)

    run = folder / "run"
    records = [m["step"] for m in read_metrics(run) if "loss" in m]
    assert records == list(range(1, STEPS + 1)), (records, said)  # every step once, in order
    assert losses(run) == losses(reference), said  # losses and gradient norms, bit for bit
    got, want = exported(run), exported(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for key, tensor in want[name].items():
            assert torch.equal(got[name][key], tensor), (name, key, said)
    assert not list((run / "checkpoints").glob(".tmp-*")) and not list(run.glob(".final.tmp-*")), said
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["save_every"] == 1


def test_a_schedule_is_a_function_of_its_seed_and_reaches_every_phase():
    assert schedule(1, 6) == schedule(1, 6) != schedule(2, 6)
    kills = schedule(7, KILLS)
    assert kills[0].after_steps == 0 and kills[-1].after_steps == LAST  # the start-up, after the last step
    assert {k.after_steps for k in kills[1:-1]} <= {1, 2} and len(kills) == KILLS
    assert all(0 <= k.delay_s <= 10 for k in kills)
