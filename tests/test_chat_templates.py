"""Loss masks of agent conversations (tool calls, tool results, thinking, several turns) are exact on real model
families' chat templates, against an oracle no one here wrote: TRL 1.16's ``_training`` templates with
``{% generation %}`` markers and transformers' assistant mask. No model: the template and the SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hfsdp import IGNORE_INDEX
from hfsdp.builtin import chat
from hfsdp.config.schema import DataConfig
from hfsdp.errors import RowError
from hfsdp.model import chat_template

trl = pytest.importorskip("trl")
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
ROWS = 200

NAMES = ["Ann Lee", "Omar Ali", "Mei Wong", "Hugo Berg", "Lena Kim", "Ravi Patel"]
CITIES = ["Oslo", "Lagos", "Lyon", "Pune", "Osaka"]
TOOLS = [
    {"type": "function", "function": {"name": "lookup_contact", "description": "Find a contact by name.",
                                      "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                     "required": ["name"]}}},
    {"type": "function", "function": {"name": "weather", "description": "Today's weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"type": "string"}},
                                          "required": ["city"]}}},
]


def _call(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"type": "function", "function": {"name": "lookup_contact", "arguments": {"name": rng.choice(NAMES)}}}
    return {"type": "function", "function": {"name": "weather", "arguments": {"city": rng.choice(CITIES),
                                                                              "unit": rng.choice(["C", "F"])}}}


def conversation(rng: random.Random, tools: bool = True, thinking: bool = True) -> list[dict]:
    """An agent conversation: maybe a system turn, 1-3 user turns, each answered after 0-2 rounds of tool calls
    (1-2 calls each, with their results), assistant turns with thinking some of the time (without ``tools`` or
    ``thinking``, none of them)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
    for turn in range(rng.randint(1, 3)):
        who = rng.choice(NAMES)
        messages.append({"role": "user", "content": f"Question {turn}: what about {who}?"})
        for _ in range(rng.choice([0, 1, 1, 2]) if tools else 0):
            calls = [_call(rng) for _ in range(rng.choice([1, 1, 2]))]
            step = {"role": "assistant", "tool_calls": calls, **({"content": ""} if rng.random() < 0.5 else {})}
            if thinking and rng.random() < 0.5:
                step["reasoning_content"] = f"I need {calls[0]['function']['name']} first."
            messages.append(step)
            for call in calls:
                messages.append({"role": "tool", "name": call["function"]["name"],
                                 "content": json.dumps({"ok": True, "value": rng.randint(1, 99)})})
        answer = {"role": "assistant", "content": f"{who} lives in {rng.choice(CITIES)}."}
        if thinking and rng.random() < 0.6:
            answer["reasoning_content"] = f"The answer is about {who}."
        messages.append(answer)
    return messages


def _code(template: str) -> str:
    return re.sub(r"\{#.*?#\}", "", template, flags=re.S)  # without its comments


def _reads_tools(template: str) -> bool:
    return "tool_calls" in _code(template)


def _reads_thinking(template: str) -> bool:
    return any(k in _code(template) for k in chat.REASONING_KEYS)


def _reads(template: str) -> bool:
    """The families this test covers: templates that render tool calls or thinking."""
    return _reads_tools(template) or _reads_thinking(template)


def conversations(template: str) -> list[list[dict]]:
    """ROWS conversations with the parts ``template`` reads (tool calls, thinking)."""
    rng = random.Random(0)
    return [conversation(rng, _reads_tools(template), _reads_thinking(template)) for _ in range(ROWS)]


FAMILIES = sorted(n for n in chat_template.names() if chat_template.training_version(n)
                  and _reads((chat_template.TEMPLATES_DIR / f"{n}.jinja").read_text()))
MARKED = sorted(n for n in chat_template.names() if n != "chatml_tools"
                and chat_template.has_generation_markers(text := (chat_template.TEMPLATES_DIR / f"{n}.jinja").read_text())
                and _reads(text))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _tools(tokenizer, template: str):
    """TOOLS where ``template`` shows the model its tools (some families leave that to the system message)."""
    probe = [{"role": "user", "content": "hi"}]
    shown = "lookup_contact" in tokenizer.apply_chat_template(probe, tools=TOOLS, chat_template=template, tokenize=False)
    return TOOLS if shown else None


def _oracle(tokenizer, messages, template: str):
    """Tokens and labels by transformers' assistant mask of ``template``, on the messages as hfsdp reads them (a
    turn of tool calls alone with the content '')."""
    messages = chat.conversation(messages, DataConfig(path="x"))
    out = tokenizer.apply_chat_template(messages, tools=_tools(tokenizer, template), chat_template=template,
                                        tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], out["assistant_masks"])]


def _hfsdp(tokenizer, messages):
    row = chat.conversation(messages, DataConfig(path="x"))
    return chat.tokenize_conversation(row, tokenizer, chat.tools_of(_tools(tokenizer, tokenizer.chat_template)))


def _drops(tokenizer, messages, template: str) -> str | None:
    """What of the row ``template`` leaves out of its text (hfsdp's check, asked of another template)."""
    tools = _tools(tokenizer, template)
    messages = chat.conversation(messages, DataConfig(path="x"))
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    return chat._missing_part(text, messages, tools)


def test_the_shipped_templates_are_trls():
    """hfsdp's copies of TRL's templates are TRL's, byte for byte."""
    ours = {p.name: p.read_text() for p in chat_template.TEMPLATES_DIR.glob("*.jinja") if p.stem != "chatml_tools"}
    assert ours == {p.name: p.read_text() for p in TRL_TEMPLATES.glob("*.jinja")}


def test_the_covered_families():
    """Every family with a training version whose original renders tool calls or thinking is covered."""
    assert {"qwen2_5", "qwen3", "qwen3_6", "llama3", "gptoss", "deepseekv3", "glm4moe", "nemotron_3_nano"} - {
        "llama3"} <= set(FAMILIES), FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_the_original_template_masks_as_its_training_version_or_refuses_with_the_fix(family, tokenizer):
    """With a family's original template, hfsdp's tokens and labels equal its _training template's tokens and
    assistant mask on every conversation the original renders alike; where it re-renders (or fails on) one, hfsdp
    refuses it naming the template and the fix, data.chat_template: NAME_training."""
    tokenizer.chat_template = (chat_template.TEMPLATES_DIR / f"{family}.jinja").read_text()
    training = (TRL_TEMPLATES / f"{family}_training.jinja").read_text()
    equal = refused = 0
    for k, messages in enumerate(conversations(tokenizer.chat_template)):
        try:
            got = _hfsdp(tokenizer, messages)
        except RowError as err:
            assert f"the chat template {family} " in str(err), (k, str(err))
            if "drops part of this row" in str(err):  # the family's templates leave part of the row out: both
                assert _drops(tokenizer, messages, training), (k, str(err))
            else:  # re-renders: the training version renders every turn alike
                assert f"set data.chat_template: {family}_training" in str(err), (k, str(err))
                assert any(why in str(err) for why in ("renders differently once later messages follow", "fails on",
                                                       "differently from its training version")), (k, str(err))
            refused += 1
            continue
        assert got == _oracle(tokenizer, messages, training), k
        equal += 1
    assert equal + refused == ROWS
    print(f"{family}: {equal} equal, {refused} refused")


@pytest.mark.parametrize("name", MARKED)
def test_a_training_template_masks_exactly_its_generation_markers(name, tokenizer):
    """With a template that has {% generation %} markers (a _training version, or one that ships them), tokens and
    labels equal its assistant mask on every conversation with the parts it reads, except those whose text lacks a
    part of the row or that the template fails on (the family's own limits, named in the refusal)."""
    template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    tokenizer.chat_template = template
    equal = 0
    for k, messages in enumerate(conversations(template)):
        try:
            got = _hfsdp(tokenizer, messages)
        except RowError as err:  # the template leaves out a part of the row it reads elsewhere, or fails on it
            if "fails on this conversation" in str(err):
                with pytest.raises(Exception):
                    _oracle(tokenizer, messages, template)
            else:
                assert "drops part of this row" in str(err) and _drops(tokenizer, messages, template), (k, str(err))
            continue
        assert got == _oracle(tokenizer, messages, template), k
        equal += 1
    print(f"{name}: {equal} equal, {ROWS - equal} refused")
    assert equal, f"{name}: no conversation masked"
