"""Agents that act (issue 69): GRPO, RLOO and on-policy distillation rollouts that call tools between their turns, as
TRL 1.16's ``GRPOTrainer`` does with ``tools=`` and ``environment_factory=``, the calls run in worker processes.

The model is the shrunk SmolLM2 taught to call ``lookup_contact`` (a fine-tuning of the bundled tool conversations,
made once a session: :func:`tool_caller`), so that its rollouts really call the tool, read its result and answer.
The tools are ``tests/agent_tools/contacts.py``. The runtime's hostile cases are tests/test_agent_runtime.py and
tests/test_agent_sandbox.py; TRL's own loop against these rollouts is tests/test_agents_trl.py
(benchmarks/trl_grpo.py ``--agent tools`` and ``--agent environment``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PRESET_DATA, REPO, base_env, read_completions, read_metrics, run_cli, run_torchrun, tiny_config

TOOLS = REPO / "tests" / "agent_tools"
FAULTS = REPO / "tests" / "fault_plugin"
STEPS = 3


def smol_tokenizer():
    from hfsdp.config.schema import ModelConfig
    from hfsdp.model import chat_template
    from hfsdp.model.loading import tokenizer_of

    from conftest import CACHE_DIR

    tokenizer = tokenizer_of(ModelConfig(name_or_path="smollm2-tiny"), CACHE_DIR)
    chat_template.use(tokenizer, "chatml_tools")
    return tokenizer


# ---- the pieces, without a run

def test_the_tool_results_tokens_are_trls_suffix():
    """The tokens after a turn of tool calls (the results and the next generation prompt) are what TRL's
    ``_get_tool_suffix_ids`` gives, with one result and with two."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    from hfsdp.builtin.agent.turns import tool_suffix_ids

    tokenizer = smol_tokenizer()
    host = SimpleNamespace(processing_class=tokenizer, _tokenizer=tokenizer, _is_vlm=False, chat_template=None,
                           chat_template_kwargs={})
    for results in ([{"role": "tool", "name": "lookup_contact", "content": '{"age": 3}'}],
                    [{"role": "tool", "name": "a", "content": "x"}, {"role": "tool", "name": "b", "content": "{'error': 'y'}"}]):
        ours = tool_suffix_ids(tokenizer, results)
        assert ours == trl.GRPOTrainer._get_tool_suffix_ids(host, results)
        assert tokenizer.decode(ours).endswith("<|im_start|>assistant\n")


def test_a_turns_results_come_in_trls_order_synchronous_calls_first():
    from hfsdp.builtin.agent.turns import ordered_calls

    calls = [{"type": "function", "function": {"name": n, "arguments": {"k": i}}} for i, n in enumerate("abca")]
    assert ordered_calls(calls, frozenset({"a"})) == [("b", {"k": 1}), ("c", {"k": 2}), ("a", {"k": 0}),
                                                      ("a", {"k": 3})]
    assert ordered_calls(calls, frozenset()) == [("a", {"k": 0}), ("b", {"k": 1}), ("c", {"k": 2}), ("a", {"k": 3})]


# ---- refusals, before any weight loads

def test_tools_and_environments_trl_cannot_use_are_refused_by_key_with_the_fix(tmp_path):
    """``hfsdp validate``: every problem at once, each under its config key: a module that does not import, a
    function without type hints (TRL's schema needs them), an environment without ``reset``, a tool method named as
    a standalone tool, an environment that needs constructor arguments; exit 2, one screen."""
    config = agent_config(tmp_path, "smollm2-tiny", 1, grpo={
        "tools": ["contacts:lookup_contact", "nope_not_a_module:run", "json:dumps"],
        "environment": {"counter": "collections:Counter", "contacts": "contacts:Contacts",
                        "needs": "argparse:Action"}})
    proc = run_cli("validate", str(config), env=base_env(PYTHONPATH=str(TOOLS)), check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said and said.count("\n") < 30, said
    for key, text in (("grpo.tools[1]", "cannot import module 'nope_not_a_module'"),
                      ("grpo.tools[2]", "Argument obj is missing a type hint"),
                      ("grpo.environment.counter", "has no reset method: define reset(self, **row)"),
                      ("grpo.environment.contacts", "has a method lookup_contact, a name grpo.tools[0] gives"),
                      ("grpo.environment.needs", "an environment is made with no arguments")):
        assert f"{key}: " in said and text in said, (key, said)
    assert "grpo.tools[0]:" not in said  # the good one


def test_a_template_that_cannot_render_tool_results_and_rows_without_their_environment_are_refused(tmp_path):
    """Refused by ``train`` before the weights load: a chat template that does not render a tool call and its
    result (the model phase: the fix names the template to use), and, with an ``environment`` mapping, rows that
    do not name theirs (as the rows are read)."""
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Who is {n}?"}]}) + "\n"
                            for n in ("Ada", "Bo", "Cy", "Di")))
    config = agent_config(tmp_path / "template", "smollm2-tiny", 1, data={"chat_template": str(plain),
                                                                            "path": str(rows), "eval_path": None})
    proc = run_cli("train", str(config), env=base_env(PYTHONPATH=str(TOOLS)), check=False)
    assert proc.returncode == 2 and "grpo.tools: rollouts that call tools" in proc.stderr, proc.stderr[-2000:]
    assert "chatml_tools" in proc.stderr and "Loading weights" not in proc.stderr
    config = agent_config(tmp_path / "mapping", "smollm2-tiny", 1, grpo={
        "tools": [], "environment": {"contacts": "contacts:Contacts"}}, data={"path": str(rows), "eval_path": None})
    proc = run_cli("train", str(config), env=base_env(PYTHONPATH=str(TOOLS)), check=False)
    assert proc.returncode == 2 and "Loading weights" not in proc.stderr, proc.stderr[-2000:]
    assert ("grpo.environment is a mapping (contacts), and training row 0 (counting from 0) has no environment "
            "column") in proc.stderr


# ---- runs

CALLER = {"data": {"format": "chat", "chat_template": "chatml_tools", "max_seq_len": 384,
                   "path": str(PRESET_DATA / "contacts_tools_train.jsonl"), "eval_path": None},
          "train": {"max_steps": 240, "per_device_batch_size": 8, "lr_scheduler": "constant", "log_every": 40,
                    "save_every": None}}


def tool_caller(run_registry) -> Path:
    """The shrunk SmolLM2 fine-tuned on the bundled tool conversations (240 steps), made once a session for this
    module and tests/test_agents_trl.py: most of its first turns are a well-formed ``lookup_contact`` call (59 of 64
    sampled at temperature 1, when this was written)."""
    return run_registry.run("tool-caller", 1, CALLER)[0] / "final"


@pytest.fixture(scope="module")
def caller(run_registry) -> Path:
    return tool_caller(run_registry)


def agent_config(folder: Path, model: Path | str, world: int, grpo: dict | None = None, train: dict | None = None,
                 plugins: tuple[str, ...] = (), data: dict | None = None, **fsdp) -> Path:
    """GRPO of ``model`` on the bundled tool prompts, 8 completions (4 prompts of 2) a step on 1, 2 or 4 ranks,
    calling ``contacts:lookup_contact``; a round every 2 steps (steps 1 and 3 sample)."""
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_config(
        folder, model={"name_or_path": str(model)}, plugins=["grpo", *plugins],
        data={"format": "prompt", "chat_template": "chatml_tools", "max_seq_len": 384, "max_eval_samples": 4,
              "path": str(PRESET_DATA / "contacts_tools_prompts_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_tools_prompts_eval.jsonl"), **(data or {})},
        grpo={"num_generations": 2, "max_new_tokens": 128, "log_completions": 16, "num_iterations": 2,
              "tools": ["contacts:lookup_contact"],
              "rewards": [{"name": "tool_call"}, {"name": "contacts:answered"},
                                                        {"name": "contacts:looked_up"}], "max_tool_calling_iterations": 2,
              "tool_timeout_s": 20, **(grpo or {})},
        train={"max_steps": STEPS, "per_device_batch_size": 8 // max(world, 2), "learning_rate": 1e-3,
               "gradient_accumulation_steps": max(2 // world, 1), "lr_scheduler": "constant",
               "collective_timeout_s": 120, **(train or {})},
        fsdp=fsdp)


def train(config: Path, world: int, *args: str, env: dict | None = None, check: bool = True):
    env = env or base_env(PYTHONPATH=str(TOOLS))
    if world == 1:
        return run_cli("train", str(config), *args, env=env, check=check)
    return run_torchrun(world, "train", str(config), *args, env=env, check=check)


# The module's runs: (world, fsdp section) by name; x4 and x2_fsdp1 are compared with --full-matrix only.
RUNS = {"x1": (1, {}), "x2": (2, {}), "x4": (4, {}), "x2_fsdp1": (2, {"version": 1})}


class Runs(dict):
    """The run folders of :data:`RUNS`, each trained the first time a test asks for it."""

    def __init__(self, caller: Path, root: Path):
        super().__init__()
        self.caller, self.root = caller, root

    def __missing__(self, name: str) -> Path:
        world, fsdp = RUNS[name]
        proc = train(agent_config(self.root / name, self.caller, world, **fsdp), world)
        (self.root / name / "console.txt").write_text(proc.stdout + proc.stderr)
        self[name] = self.root / name / "run"
        return self[name]


@pytest.fixture(scope="module")
def runs(caller, tmp_path_factory) -> Runs:
    return Runs(caller, tmp_path_factory.mktemp("agents"))


def pytest_generate_tests(metafunc):
    """CI compares 2 ranks with one process; ``pytest --full-matrix`` also 4 ranks and FSDP1."""
    if "ranks_run" in metafunc.fixturenames:
        names = [n for n in RUNS if n != "x1"] if metafunc.config.getoption("full_matrix") else ["x2"]
        metafunc.parametrize("ranks_run", names)


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


@pytest.mark.slow
def test_rollouts_call_the_tool_read_its_result_and_only_the_sampled_tokens_train(runs, monkeypatch):
    """A rollout's conversation in completions.jsonl: the assistant's call, the tool's real result (the contact's
    record, or the error TRL would give the model), the answer after it; the tool mask is 0 exactly on the result's
    tokens (the template's suffix) and 1 on what the model sampled; the metrics count the calls."""
    from hfsdp.builtin.agent.turns import tool_suffix_ids

    monkeypatch.syspath_prepend(str(TOOLS))
    import contacts

    tokenizer = smol_tokenizer()
    lines = read_completions(runs["x1"])
    acted = [line for line in lines if any(m["role"] == "tool" for m in line["messages"])]
    assert len(acted) >= len(lines) // 3, [line["completion"] for line in lines]  # 10 of 24 when this was written
    for line in acted:
        messages, mask, ids = line["messages"], line["tool_mask"], line["completion_ids"]
        assert messages[0]["role"] == "assistant" and messages[0]["tool_calls"]
        call = messages[0]["tool_calls"][0]["function"]
        result = messages[1]
        assert result["role"] == "tool" and result["name"] == call["name"]
        name = call["arguments"].get("name")
        want = (json.dumps(contacts.CONTACTS[name]) if name in contacts.CONTACTS
                else str({"error": str(KeyError(f"no contact named {name!r}"))}))
        assert result["content"] == want
        assert len(mask) == len(ids) and mask[0] == 1
        first = mask.index(0)
        suffix = tool_suffix_ids(tokenizer, [m for m in messages[1:] if m["role"] == "tool"][:len(
            messages[0]["tool_calls"])])
        assert ids[first:first + len(suffix)] == suffix and mask[first:first + len(suffix)] == [0] * len(suffix)
        assert all(mask[first + len(suffix):first + len(suffix) + 1])
    metrics = steps(runs["x1"])
    shown = (runs["x1"].parent / "console.txt").read_text()  # the progress bar: the share that answered from a result
    assert f"answered_from_result={metrics[3]['tools/answered_from_result']:.3f}" in shown, shown[-2000:]
    assert sorted(metrics) == [1, 2, 3] and all(m["tools/call_frequency"] > 0 and m["tools/turns"] > 1
                                                for m in metrics.values()), metrics


@pytest.mark.slow
def test_rollouts_that_act_are_token_identical_and_train_the_same_steps_on_any_number_of_ranks(runs, ranks_run):
    one, other = runs["x1"], runs[ranks_run]
    assert read_completions(other) == read_completions(one)
    a, b = steps(one), steps(other)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "reward", "completion_length", "tools/call_frequency", "tools/turns"):
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_two_ranks_killed_inside_a_multi_turn_round_resume_to_the_same_rollouts_and_steps(runs, caller, tmp_path):
    """Rank 1 is killed (kill -9) at the end of step 2, inside the first round (2 steps a round), whose rollouts
    called tools: the resume from step 1's checkpoint trains step 2 on the restored multi-turn rollouts (their
    tool masks), then samples round 2, every rollout and step those of one process."""
    config = agent_config(tmp_path, caller, 2, plugins=("hfsdp_faults",), train={"save_every": 1})
    path = os.pathsep.join([str(TOOLS), str(FAULTS)])
    killed = train(config, 2, env=base_env(PYTHONPATH=path, HFSDP_TEST_FAULTS="sigkill@2:1"), check=False)
    assert killed.returncode != 0 and "exitcode  : -9" in killed.stderr, killed.stderr[-3000:]
    assert {c["step"] for c in read_completions(tmp_path / "run")} == {1}
    train(config, 2, "--resume", env=base_env(PYTHONPATH=path))
    assert read_completions(tmp_path / "run") == read_completions(runs["x1"])
    a, b = steps(runs["x1"]), steps(tmp_path / "run")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert [b[step]["loss"], b[step]["grad_norm"]] == pytest.approx([a[step]["loss"], a[step]["grad_norm"]],
                                                                         rel=1e-5, abs=1e-7), step
    assert any(m["grad_norm"] > 0 for m in a.values())


@pytest.mark.slow
def test_environments_chosen_per_row_reset_per_rollout_see_its_calls_and_own_rewards_named_after_their_class(
        caller, tmp_path):
    """An ``environment`` mapping, rows alternating between ``Contacts`` (its reset appends " (Use the tool.)") and
    ``QuietContacts`` (appends nothing): each rollout's prompt is its row's with its environment's text after the
    last message, its calls reach its own instance (``get_reward``: the row's person among the names it looked up),
    and each class's reward is a column of its own, None on the other's rows, as TRL's."""
    rows = [json.loads(line) for line in (PRESET_DATA / "contacts_tools_prompts_train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["environment"] = ("loud", "quiet")[i % 2]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = agent_config(tmp_path, caller, 1, grpo={
        "tools": [], "environment": {"loud": "contacts:Contacts", "quiet": "contacts:QuietContacts"},
        "rewards": [{"name": "contacts:looked_up"}]}, train={"max_steps": 2},
        data={"path": str(data), "eval_path": str(data)})  # the eval rows too
    train(config, 1)
    lines = read_completions(tmp_path / "run")
    assert {rows[line["row"]]["environment"] for line in lines} == {"loud", "quiet"}
    acted = 0
    for line in lines:
        row = rows[line["row"]]
        loud = row["environment"] == "loud"
        assert line["observation"] == (" (Use the tool.)" if loud else None)
        assert line["prompt"] == row["prompt"]  # the row's, as it is
        messages = line["messages"]
        executed = [c["function"]["arguments"].get("name") for i, m in enumerate(messages[:-1])
                    if m.get("tool_calls") and messages[i + 1]["role"] == "tool" for c in m["tool_calls"]]
        acted += bool(executed)
        got = float(row["answer"]["arguments"]["name"] in executed)
        assert line["rewards"]["Contacts" if loud else "QuietContacts"] == got, line
        assert line["rewards"]["QuietContacts" if loud else "Contacts"] is None, line
    assert acted > 0
    metrics = read_metrics(tmp_path / "run")
    assert all("rewards/Contacts/mean" in m and "rewards/QuietContacts/mean" in m for m in metrics if "loss" in m)
    assert [sorted(k for k in m if "Contacts" in k) for m in metrics if "eval_reward" in m] == [
        ["eval_rewards/Contacts/mean", "eval_rewards/QuietContacts/mean"]] * 2
