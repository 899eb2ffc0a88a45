"""The ``agent-rl`` preset's task (issue 69, item 5): the bundled contacts as a database behind ``lookup_contact``
(hfsdp.builtin.agent.contacts), questions whose answer no prompt holds, the ``contact_answer`` reward (the right
value, and no other value of the detail: listing values cannot win), the ``tools/answered_from_result`` share, and the
preset: it starts from the ``tools`` preset's run, and says so where that run is absent."""

from __future__ import annotations

import json

import pytest

from conftest import PRESET_DATA, run_cli
from hfsdp.builtin.agent.contacts import CONTACTS, contact_answer, lookup_contact
from hfsdp.builtin.agent.rollouts import answered_from_result, tool_stats
from hfsdp.builtin.online.rewards import BUILTIN_REWARDS


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (PRESET_DATA / f"contacts_agent_{split}.jsonl").read_text().splitlines()]


def _call(name: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup_contact", "arguments": {"name": name}}}]}


def test_the_agent_rows_ask_one_detail_that_only_the_database_holds_and_eval_people_are_held_out():
    train, evaluation = _rows("train"), _rows("eval")
    assert (len(train), len(evaluation)) == (256, 32)
    names = {}
    for split, rows in (("train", train), ("eval", evaluation)):
        names[split] = set()
        for row in rows:
            (message,) = row["prompt"]
            name = next(n for n in CONTACTS if n in message["content"])
            names[split].add(name)
            assert row["field"] in ("age", "city", "job")
            assert row["answer"] == str(CONTACTS[name][row["field"]])
            assert row["answer"] not in message["content"]  # the value is in no prompt
    assert not names["train"] & names["eval"]
    tools_train = {json.loads(line)["messages"][2]["content"] for line in
                   (PRESET_DATA / "contacts_tools_train.jsonl").read_text().splitlines()}
    assert not {json.loads(r)["name"] for r in tools_train} & names["eval"]  # nor did the tools preset train on them


def test_lookup_contact_returns_the_record_and_raises_for_a_stranger():
    name = next(iter(CONTACTS))
    assert json.loads(lookup_contact(name)) == CONTACTS[name]
    with pytest.raises(KeyError, match="no contact named"):
        lookup_contact("Nobody Atall")


def test_contact_answer_needs_the_right_value_alone_in_a_final_answer():
    assert BUILTIN_REWARDS["contact_answer"] is contact_answer
    result = {"role": "tool", "name": "lookup_contact", "content": json.dumps(
        {"name": "Mei Smith", "age": 37, "city": "Zagreb", "job": "electrician"})}
    cases = [
        ([_call("Mei Smith"), result, {"role": "assistant", "content": "Mei Smith is based in Zagreb."}], "city",
         "Zagreb", 1.0),
        ([{"role": "assistant", "content": "She lives in zagreb"}], "city", "Zagreb", 1.0),  # a lucky guess counts
        ([{"role": "assistant", "content": "Zagreb, Lyon or Oslo."}], "city", "Zagreb", 0.0),  # listing does not
        ([{"role": "assistant", "content": "Mei Smith is 37 years old."}], "age", "37", 1.0),
        ([{"role": "assistant", "content": "37 or 137."}], "age", "37", 0.0),
        ([{"role": "assistant", "content": "She is 73."}], "age", "37", 0.0),
        ([{"role": "assistant", "content": "An electrician and a nurse."}], "job", "electrician", 0.0),
        ([_call("Mei Smith")], "city", "Zagreb", 0.0),  # ended on a call: no answer
        ([_call("Mei Smith"), result], "city", "Zagreb", 0.0),  # ended on the result: no answer
    ]
    for completion, field, value, expected in cases:
        assert contact_answer([completion], [field], [value]) == [expected], (completion, field)


def test_answered_from_result_is_an_answer_holding_a_value_of_a_result_other_than_the_arguments():
    record = {"name": "Mei Smith", "age": 37, "city": "Zagreb", "job": "electrician"}
    result = {"role": "tool", "name": "lookup_contact", "content": json.dumps(record)}
    error = {"role": "tool", "name": "lookup_contact", "content": str({"error": "\"no contact named '37'\""})}
    answer = {"role": "assistant", "content": "Mei Smith is 37 years old."}
    assert not answered_from_result([_call("37"), error, {"role": "assistant", "content": "no contact named '37'"}])
    assert answered_from_result([_call("Mei Smith"), result, answer])
    assert not answered_from_result([answer])  # no call
    assert not answered_from_result([_call("Mei Smith"), error, answer])  # an error is not a result
    assert not answered_from_result([_call("Mei Smith"), result, {"role": "assistant", "content": "Mei Smith?"}])
    assert not answered_from_result([_call("Mei Smith"), result, _call("Mei Smith")])
    stats = tool_stats([{"tool_stats": [{"calls": 1, "failures": 0, "turns": 2, "rolled_back": 0,
                                         "answered_from_result": a} for a in (1, 0, 1, 1)]}])
    assert stats["tools/answered_from_result"] == 0.75 and stats["tools/call_frequency"] == 1.0


@pytest.mark.slow
def test_the_agent_rl_preset_validates_and_names_the_tools_run_it_starts_from(tmp_path):
    proc = run_cli("validate", "agent-rl", "--set", "model.name_or_path=smollm2-135m-instruct", cwd=tmp_path,
                   timeout=300)
    assert "hfsdp.builtin.agent.contacts:lookup_contact" in proc.stdout
    proc = run_cli("validate", "agent-rl", cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "runs/tools/final does not exist" in proc.stderr and "`hfsdp train tools`" in proc.stderr
