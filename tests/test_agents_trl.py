"""Agents that act (issue 69) against TRL 1.16's ``GRPOTrainer`` with ``tools=`` and ``environment_factory=``
(benchmarks/trl_grpo.py ``--agent``): hfsdp trains GRPO with the tool function (or an environment whose
``get_reward`` is a reward), then TRL trains the same model on the same prompts, its generation replaying hfsdp's
sampled turns while its own loop runs the calls, appends their results and builds its ``tool_mask``. The rollouts
must come out token for token hfsdp's (completion ids, tool mask, conversations), the rewards equal, and each step's
loss and gradient norm within 1e-6 relative on the first step (the same weights) and 2e-6 on the later ones (each
side's float32 AdamW updates round apart: the drift the real model shows in docs/benchmarks.md's TRL GRPO section).
The model is the shrunk SmolLM2 taught to call the tool (tests/test_agents.py's, made once a session; the
benchmark's ``make_caller`` makes the same)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, base_env

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def bench(run_registry):
    pytest.importorskip("trl")
    from test_agents import tool_caller

    with pytest.MonkeyPatch.context() as patch:
        for path in (REPO / "benchmarks", REPO / "tests" / "agent_tools"):
            patch.syspath_prepend(str(path))
        for key, value in base_env().items():
            patch.setenv(key, value)
        import trl_grpo

        model = tool_caller(run_registry)
        yield trl_grpo, model


def pytest_generate_tests(metafunc):
    """CI runs the environment (its tool methods, its get_reward a reward column: TRL's whole tool loop and the
    environment's part of it); ``--full-matrix`` the plain tool function too, to keep CI inside its 35 minutes."""
    if "agent" in metafunc.fixturenames:
        full = metafunc.config.getoption("full_matrix")
        metafunc.parametrize("agent", ["tools", "environment"] if full else ["environment"])


def test_trls_tool_loop_on_hfsdps_turns_makes_the_same_rollouts_rewards_losses_and_gradients(agent, bench, tmp_path):
    trl_grpo, model = bench
    from hfsdp.rules.table import load_checked

    overrides = [*trl_grpo.fixed_overrides(STEPS), *trl_grpo.agent_overrides(agent, str(model)),
                 "grpo.log_completions=100000"]
    cfg, host = load_checked("grpo", overrides)
    section = trl_grpo.run_section(cfg)
    rows: dict = {}
    ours, rounds, _ = trl_grpo.run_hfsdp("grpo", overrides, tmp_path / "run", cfg.plugins, rows,
                                         (str(trl_grpo.AGENT_TOOLS), str(Path(trl_grpo.__file__).parent)))
    theirs = trl_grpo.run_trl(cfg, host, STEPS, rounds, None, rows)
    checks = theirs["agent"]
    assert checks["mismatches"] == []
    assert checks["completions"] == STEPS * cfg.train.per_device_batch_size
    assert checks["acted"] >= checks["completions"] // 4 and checks["tool_tokens"] > 0  # real calls, real results
    assert all(diff == 0 for diff in checks["rewards"].values()), checks["rewards"]
    assert len(checks["rewards"]) == len(section.rewards) + (agent == "environment")  # get_reward: one more
    if agent == "environment":
        assert "QuietContacts" in checks["rewards"] and section.environment == "contacts:QuietContacts"
    assert len(ours) == len(theirs["losses"]) == len(theirs["float64_norms"]) == STEPS
    for step, (m, loss, norm) in enumerate(zip(ours, theirs["losses"], theirs["float64_norms"]), start=1):
        tolerance = 1e-6 if step == 1 else 2e-6
        assert m["loss"] == pytest.approx(loss, rel=tolerance, abs=1e-7), (step, m["loss"], loss)
        assert m["grad_norm"] == pytest.approx(norm, rel=tolerance), (step, m["grad_norm"], norm)
        assert m["grad_norm"] > 0
