"""Tool code cannot hurt the run: the hostile tools and environments of ``tests/agent_tools/hostile.py`` run through
:mod:`hfsdp.builtin.agent.runtime` (:func:`describe`, :class:`ToolWorkers`), in processes of their own. A call that
raises, hangs, spins, allocates 50 GB, segfaults, exits, kills itself, returns 2 MiB or forks becomes TRL's
``str({"error": ...})`` text with its failure kind, the process is replaced, the next call of the round works, and
the texts are the same on every run; an environment's state comes back after a crash (replayed) or is lost; a reset
or reward that fails stops the run naming the environment; describe refuses what TRL could not use, by config key;
close() leaves no process; the training process never imports the tools' module.

Small limits keep each test within a few seconds (a 2 s call timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfsdp.builtin.agent.runtime import FAILURES, Limits, RolloutError, ToolsetError, ToolWorkers, describe

TOOLS = Path(__file__).resolve().parent / "agent_tools"
LIMITS = Limits(timeout_s=2, memory_mb=512, cpu_s=1)
SECTION = "grpo"
HOSTILE = ["echo", "add", "raises", "hangs", "spins", "hogs", "hogs_slowly", "segfaults", "exits", "kills_itself",
           "floods", "spawns", "forks_then_exits", "exits_after_returning", "async_echo", "async_hangs", "async_blocks",
           "async_raises"]


@pytest.fixture(scope="module", autouse=True)
def tools_on_path():
    """tests/agent_tools on sys.path (a tool process gets the trainer's sys.path); never imported here."""
    sys.path.insert(0, str(TOOLS))
    yield
    sys.path.remove(str(TOOLS))


@pytest.fixture(autouse=True)
def hostile_dir(tmp_path, monkeypatch):
    """$HOSTILE_DIR: the counts that outlive a tool process (the tool processes inherit it)."""
    folder = tmp_path / "state"
    folder.mkdir()
    monkeypatch.setenv("HOSTILE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def toolset():
    return describe([f"hostile:{name}" for name in HOSTILE], None, LIMITS, SECTION)


def error(message: str) -> str:
    return str({"error": message})


def stopped(after: str = "its process was stopped") -> str:
    return error(f"the call did not return within 2 s (grpo.tool_timeout_s); {after}")


def crashed(how: str) -> str:
    return error(f"the call crashed: its process ended ({how})")


MEMORY = error("the call ran out of memory: a tool process may use 512 MB (grpo.tool_memory_mb)")
ZERO = dict.fromkeys(("calls", "failures", "timeouts", "crashes", "replaced", "lost"), 0)

# (tool, arguments, the tool message's text, failure, stats beyond calls and failures)
CASES = {
    "raises": ("raises", {"value": 3}, error("bad value 3"), "raised", {}),
    "bad_arguments": ("add", {"a": 1}, error("add() missing 1 required positional argument: 'b'"), "raised", {}),
    "unknown_tool": ("nope", {}, "{'error': 'Tool nope not found.'}", "unknown_tool", {}),
    "hangs": ("hangs", {}, stopped(), "timeout", {"timeouts": 1, "replaced": 1}),
    "allocates_50_gb": ("hogs", {}, MEMORY, "memory", {}),
    "allocates_64_mb_at_a_time": ("hogs_slowly", {}, MEMORY, "memory", {}),
    "segfaults": ("segfaults", {}, crashed("signal SIGSEGV"), "crashed", {"crashes": 1, "replaced": 1}),
    "os_exit": ("exits", {}, crashed("exit code 3"), "crashed", {"crashes": 1, "replaced": 1}),
    "sigkill_of_itself": ("kills_itself", {}, crashed("signal SIGKILL"), "crashed", {"crashes": 1, "replaced": 1}),
    "returns_2_mib": ("floods", {}, error("the result is 2097152 bytes long, over the limit of 1048576 bytes (1 MiB); "
                                          "return less"), "too_long", {}),
    "async_raises": ("async_raises", {"value": 2}, error("async bad value 2"), "raised", {}),
    "async_hangs": ("async_hangs", {}, stopped("it was cancelled"), "timeout", {}),
    "async_blocks_its_loop": ("async_blocks", {}, stopped(), "timeout", {"timeouts": 1, "replaced": 1}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_hostile_call_is_trls_error_text_and_the_next_call_of_the_round_works(toolset, case):
    tool, arguments, text, failure, stats = CASES[case]
    assert failure in FAILURES
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        assert workers.open([(None, {}), (None, {})]) == [None, None]
        first = workers._workers[0].proc.pid
        answers = workers.call([(0, tool, arguments), (0, "echo", {"text": "after"}), (1, "add", {"a": 1, "b": 2})])
        assert answers == [(text, failure), ("echo: after", None), ("3", None)]
        # The next turn of the round (a process is replaced when its rollout's next step comes: async calls run
        # last, so a process an async call ended is replaced here).
        assert workers.call([(0, "add", {"a": 2, "b": 2})]) == [("4", None)]
        assert workers.stats == {**ZERO, "calls": 4, "failures": 1, **stats}
        assert (workers._workers[0].proc.pid != first) == bool(stats.get("replaced"))


def test_a_busy_loop_is_stopped_by_the_cpu_limit(toolset):
    limits = Limits(timeout_s=8, memory_mb=512, cpu_s=1)  # RLIMIT_CPU counts whole seconds: 1 to 2 s of CPU
    with ToolWorkers(toolset, limits, SECTION, rank=0) as workers:
        workers.open([(None, {})])
        answers = workers.call([(0, "spins", {}), (0, "echo", {"text": "after"})])
        assert answers == [(error("the call used over 1 s of CPU time (grpo.tool_cpu_s); its process was stopped"),
                            "cpu"), ("echo: after", None)]
        assert workers.stats == {**ZERO, "calls": 2, "failures": 1, "crashes": 1, "replaced": 1}


def test_a_child_forked_by_a_crashing_tool_neither_hides_the_crash_nor_outlives_it(toolset, tmp_path):
    """The child holds the process's connection: the crash is read at once from the process's own end (not as a
    timeout), and the child goes with the process group."""
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        workers.open([(None, {})])
        started = time.monotonic()
        answers = workers.call([(0, "forks_then_exits", {"path": str(tmp_path / "child")}),
                                (0, "echo", {"text": "after"})])
        assert time.monotonic() - started < LIMITS.timeout_s
        assert answers == [(crashed("exit code 5"), "crashed"), ("echo: after", None)]
        assert workers.stats["timeouts"] == 0
        assert gone([int((tmp_path / "child").read_text())])


def test_a_process_that_ends_after_its_reply_is_replaced_before_the_next_call(toolset):
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        workers.open([(None, {})])
        assert workers.call([(0, "exits_after_returning", {})]) == [("bye", None)]
        proc = workers._workers[0].proc
        deadline = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.returncode == 4
        assert workers.call([(0, "echo", {"text": "after"})]) == [("echo: after", None)]
        assert workers.stats == {**ZERO, "calls": 2, "crashes": 1, "replaced": 1}


def hostile_round(toolset, tmp_path) -> tuple[list, dict, set[int]]:
    """Every quick hostile call of CASES, then a crash that leaves a child, in one round of 3 rollouts."""
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        workers.open([(None, {})] * 3)
        pids = {worker.proc.pid for worker in workers._workers}
        answers = []
        for name in ("raises", "bad_arguments", "unknown_tool", "allocates_50_gb", "segfaults", "os_exit",
                     "sigkill_of_itself", "returns_2_mib", "async_raises"):
            tool, arguments = CASES[name][:2]
            answers += workers.call([(0, tool, arguments), (1, "async_echo", {"text": name}), (2, "echo", {"text": name}),
                                     (1, "add", {"a": 1, "b": 1})])
            pids |= {worker.proc.pid for worker in workers._workers if worker is not None}
        answers += workers.call([(2, "forks_then_exits", {"path": str(tmp_path / "child")})])
        return answers, dict(workers.stats), pids


def test_the_same_hostile_calls_give_the_same_texts_on_every_run(toolset, tmp_path):
    first, first_stats, first_pids = hostile_round(toolset, tmp_path)
    second, second_stats, second_pids = hostile_round(toolset, tmp_path)
    assert first == second
    assert first_stats == second_stats == {**ZERO, "calls": 37, "failures": 10, "crashes": 4, "replaced": 3}
    texts = " ".join(text for text, _ in first + second)
    for pid in first_pids | second_pids | {os.getpid()}:
        assert str(pid) not in texts


def test_sync_calls_run_in_the_given_order_then_the_async_ones_together(tmp_path):
    toolset = describe(["hostile:async_echo"], "hostile:AsyncEnv", LIMITS, SECTION)
    assert toolset.asynchronous == {None: frozenset({"async_echo", "async_note"})}
    assert toolset.rewarded == {None: "AsyncEnv"}
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        assert workers.open([(None, {}), (None, {})]) == [None, None]
        answers = workers.call([(0, "async_note", {"text": "a"}), (0, "note", {"text": "b"}),
                                (1, "note", {"text": "x"}), (0, "async_echo", {"text": "c"}),
                                (0, "async_note", {"text": "d"}), (0, "note", {"text": "e"})])
        assert answers == [("async noted 3", None), ("noted 1", None), ("noted 1", None), ("async echo: c", None),
                           ("async noted 4", None), ("noted 2", None)]
        assert workers.rewards() == [4.0, 1.0]  # an async get_reward, awaited


def test_a_crash_replays_the_environment_so_later_calls_see_its_state(tmp_path):
    toolset = describe(["hostile:echo"], "hostile:Counter", LIMITS, SECTION)
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        assert workers.open([(None, {"start": 10}), (None, {"start": 0})]) == ["total 10", "total 0"]
        assert workers.call([(0, "increment", {"n": 1}), (0, "crashy_increment", {"n": 2}),
                             (1, "increment", {"n": 5})]) == [("total 11", None), ("total 13", None), ("total 5", None)]
        # crashy_increment's 2nd invocation ends its process; the new one replays reset, increment and the 1st
        # crashy_increment (its 3rd invocation: it returns), then runs the next call of the same turn.
        assert workers.call([(0, "crashy_increment", {"n": 3}), (0, "increment", {"n": 4}),
                             (1, "crash", {}), (1, "increment", {"n": 1})]) == [
            (crashed("exit code 7"), "crashed"), ("total 17", None),
            (crashed("signal SIGSEGV"), "crashed"), ("total 6", None)]
        assert workers.call([(0, "increment", {"n": 100})]) == [("total 117", None)]
        assert workers.rewards() == [117.0, 6.0]
        assert workers.stats == {**ZERO, "calls": 8, "failures": 2, "crashes": 2, "replaced": 2}
        # A new round resets the environment on the process that runs it.
        assert workers.open([(None, {"start": 1}), (None, {})]) == ["total 1", "total 0"]
        assert workers.rewards() == [1.0, 0.0]


def test_an_environment_whose_replay_differs_is_lost_until_the_next_round(tmp_path):
    toolset = describe([], {"drift": "hostile:Drifting", "count": "hostile:Counter"}, LIMITS, SECTION)
    lost = error("the environment was lost: its process ended on an earlier call, and its replayed calls gave other "
                 "results than the first time; its calls fail until the next round")
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        assert workers.open([("drift", {}), ("count", {"start": 2})]) == [None, "total 2"]
        assert workers.call([(0, "stamp", {}), (1, "increment", {"n": 1})]) == [("stamp 1", None), ("total 3", None)]
        assert workers.call([(0, "crash", {}), (0, "stamp", {}), (1, "increment", {"n": 1})]) == [
            (crashed("exit code 9"), "crashed"), (lost, "lost"), ("total 4", None)]
        assert workers.call([(0, "stamp", {})]) == [(lost, "lost")]
        assert workers.rewards() == [None, 4.0]  # a lost environment has no reward
        assert workers.stats == {**ZERO, "calls": 6, "failures": 3, "crashes": 1, "replaced": 1, "lost": 1}
        assert workers.open([("drift", {}), ("count", {})]) == [None, "total 0"]
        assert workers.call([(0, "stamp", {})]) == [("stamp 3", None)]  # (the replay was stamp 2)
        assert workers.rewards() == [1.0, 0.0]


def test_a_reset_that_raises_or_hangs_is_a_rollout_error_naming_the_environment():
    toolset = describe([], {"ok": "hostile:Counter", "broken": "hostile:BrokenReset", "stuck": "hostile:HangingReset"},
                       LIMITS, SECTION)
    with ToolWorkers(toolset, LIMITS, SECTION, rank=3) as workers:
        with pytest.raises(RolloutError) as raised:
            workers.open([("ok", {}), ("broken", {"a": 1})])
        assert str(raised.value).startswith(
            "grpo.environment.broken: rollout 1 on rank 3: hostile:BrokenReset.reset raised RuntimeError: no task for "
            "row ['a'] (at hostile.py:")
        with pytest.raises(RolloutError) as raised:
            workers.open([("stuck", {}), ("ok", {})])
        assert str(raised.value) == ("grpo.environment.stuck: rollout 0 on rank 3: hostile:HangingReset.reset did not "
                                     "return within 2 s (grpo.tool_timeout_s); its process was stopped")


def test_a_reward_that_is_nan_or_raises_is_a_rollout_error():
    toolset = describe([], {"nan": "hostile:NanReward", "raising": "hostile:RaisingReward"}, LIMITS, SECTION)
    assert toolset.rewarded == {"nan": "NanReward", "raising": "RaisingReward"}
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        workers.open([("raising", {}), ("nan", {})])
        with pytest.raises(RolloutError) as raised:
            workers.rewards()
        assert str(raised.value).startswith("grpo.environment.raising: rollout 0 on rank 0: hostile:RaisingReward."
                                            "get_reward raised ZeroDivisionError: no answer to score (at hostile.py:")
        workers.open([("nan", {})])
        with pytest.raises(RolloutError) as raised:
            workers.rewards()
        assert str(raised.value) == ("grpo.environment.nan: rollout 0 on rank 0: hostile:NanReward.get_reward "
                                     "returned float 'nan', not a finite number")


def test_describe_refuses_each_unusable_tool_and_environment_by_config_key():
    tools = ["no_such_module:f", "hostile:untyped", "hostile:undocumented", "hostile:echo", "hostile:echo",
             "hostile:NOT_CALLABLE", "hostile:missing", "calculator"]
    environments = {"a": "hostile:NoReset", "b": "hostile:NeedsArguments", "c": "hostile:ClashesWithEcho",
                    "d": "hostile:Counter", "e": "nope"}
    with pytest.raises(ToolsetError) as raised:
        describe(tools, environments, LIMITS, "rloo")
    schema = (". The tool's JSON schema is written from its type hints and docstring: give every argument a type hint, "
              "and the docstring a description and an Args: line for each argument")
    assert raised.value.problems == [
        ("rloo.tools[0]", "'no_such_module:f': cannot import module 'no_such_module' (No module named "
                          "'no_such_module'); check the name and that it is installed or on PYTHONPATH"),
        ("rloo.tools[1]", "'hostile:untyped': Argument x is missing a type hint in function untyped" + schema),
        ("rloo.tools[2]", "'hostile:undocumented': Cannot generate JSON schema for undocumented because the docstring "
                          "has no description for the argument 'x'" + schema),
        ("rloo.tools[4]", "'hostile:echo' is named echo, as rloo.tools[3] is: the model calls tools by name; rename one"),
        ("rloo.tools[5]", "'hostile:NOT_CALLABLE' is not callable (its type: int); name a function"),
        ("rloo.tools[6]", "'hostile:missing': module 'hostile' has no attribute 'missing'; name a function it defines"),
        ("rloo.tools[7]", "'calculator' is not one of hfsdp's (python); name one of them, or your own as module:function"),
        ("rloo.environment.a", "'hostile:NoReset' (NoReset) has no reset method: define reset(self, **row), which TRL "
                               "calls with the row's columns before each rollout (it may return an observation: text "
                               "appended to the prompt)"),
        ("rloo.environment.b", "'hostile:NeedsArguments()' raised TypeError: NeedsArguments.__init__() missing 1 "
                               "required positional argument: 'path'; an environment is made with no arguments (TRL's "
                               "environment_factory): give its __init__ arguments defaults"),
        ("rloo.environment.c", "'hostile:ClashesWithEcho' has a method echo, a name rloo.tools[3] gives a tool too: the "
                               "model calls tools by name; rename one"),
        ("rloo.environment.e", "'nope' is not one of hfsdp's (python); name one of them, or your own as module:Class"),
    ]
    assert str(raised.value).splitlines()[0] == f"rloo.tools[0]: {raised.value.problems[0][1]}"


def test_describe_stops_an_environment_whose_construction_hangs():
    with pytest.raises(ToolsetError) as raised:
        describe([], "hostile:HangingInit", LIMITS, "rloo")
    assert raised.value.problems == [("rloo.environment", "importing or constructing it did not return within 2 s "
                                                          "(rloo.tool_timeout_s); its process was stopped")]


def test_describe_gives_trls_schemas_in_trls_order():
    toolset = describe(["hostile:add"], {"count": "hostile:Counter"}, LIMITS, SECTION)
    assert toolset.tools == ("hostile:add",)
    assert toolset.environments == {"count": "hostile:Counter"}
    assert toolset.names("count") == ["add", "crash", "crashy_increment", "increment"]
    assert toolset.schemas["count"][0] == {
        "type": "function", "function": {
            "name": "add", "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first integer"},
                                                            "b": {"type": "integer", "description": "the second integer"}},
                           "required": ["a", "b"]},
            "return": {"type": "integer"}}}
    assert toolset.rewarded == {"count": "Counter"}


def test_open_and_call_refuse_rollouts_they_do_not_know(toolset):
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        with pytest.raises(ValueError, match="rollout 0 names environment 'x'"):
            workers.open([("x", {})])
        workers.open([(None, {})])
        with pytest.raises(ValueError, match="rollout 1 is not open: this round has 1"):
            workers.call([(1, "echo", {"text": "a"})])


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pids: list[int], within_s: float = 5) -> bool:
    """Whether every process of ``pids`` has ended within ``within_s`` (a SIGKILL takes effect when the process is
    next scheduled)."""
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def group_members(groups: set[int]) -> list[int]:
    """The live processes whose process group is one of ``groups``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) in groups and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_no_tool_process_or_child_survives_close(toolset, tmp_path):
    workers = ToolWorkers(toolset, LIMITS, SECTION, rank=0)
    workers.open([(None, {})] * 3)
    answers = workers.call([(i, "spawns", {"path": str(tmp_path / f"child{i}")}) for i in range(3)] +
                           [(0, "hangs", {})])
    assert answers[:3] == [("started", None)] * 3
    # Each process leads a group of its own (rollout 0's, timed out, is replaced at its rollout's next step).
    groups = {worker.proc.pid for worker in workers._workers if worker is not None}
    assert len(groups) == 2
    children = [int((tmp_path / f"child{i}").read_text()) for i in range(3)]
    assert all(alive(child) for child in children[1:])
    assert gone(children[:1])  # (rollout 0's went with its timed-out process)
    members = group_members(groups)  # the processes, their children, their lifelines' watchers
    assert set(members) >= {*groups, *children[1:]}
    workers.close()
    assert gone([*groups, *children])
    assert group_members(groups) == []
    workers.close()  # idempotent


def test_an_unclosed_toolworkers_kills_its_processes_when_collected(toolset):
    workers = ToolWorkers(toolset, LIMITS, SECTION, rank=0)
    workers.open([(None, {})] * 2)
    groups = {worker.proc.pid for worker in workers._workers}
    del workers
    assert gone(group_members(groups))


def test_a_tool_process_dies_with_the_trainer(tmp_path):
    """The trainer killed with SIGKILL (no close, no finalizer): its tool processes and their children go too."""
    script = tmp_path / "trainer.py"
    script.write_text(f"""
import sys, time
sys.path.insert(0, {str(TOOLS)!r})
from hfsdp.builtin.agent.runtime import Limits, ToolWorkers, describe
limits = Limits(timeout_s=2, memory_mb=512, cpu_s=1)
workers = ToolWorkers(describe(["hostile:spawns"], None, limits, "grpo"), limits, "grpo", 0)
workers.open([(None, {{}})] * 2)
workers.call([(i, "spawns", {{"path": {str(tmp_path)!r} + f"/child{{i}}"}}) for i in range(2)])
print(" ".join(str(w.proc.pid) for w in workers._workers), flush=True)
time.sleep(3600)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))})
    try:
        groups = {int(pid) for pid in proc.stdout.readline().split()}
        assert len(groups) == 2
        children = [int((tmp_path / f"child{i}").read_text()) for i in range(2)]
        assert all(alive(pid) for pid in [*groups, *children])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert gone([*groups, *children])
    assert group_members(groups) == []


def test_the_training_process_never_imports_a_tool_module(toolset):
    with ToolWorkers(toolset, LIMITS, SECTION, rank=0) as workers:
        workers.open([(None, {})])
        workers.call([(0, "echo", {"text": "a"}), (0, "async_echo", {"text": "b"})])
    environment = describe([], "hostile:Counter", LIMITS, SECTION)
    with ToolWorkers(environment, LIMITS, SECTION, rank=0) as workers:
        workers.open([(None, {})])
        workers.rewards()
    assert "hostile" not in sys.modules
