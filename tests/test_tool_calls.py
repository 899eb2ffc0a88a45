"""Generation eval of a tool-calling turn (``hfsdp.builtin.chat.tool_calls``): the first tool call parsed out of the
generated text, its name and arguments compared with the reference's as JSON values; a split's own score used in
place of the text comparison, and the summary saying what was compared."""

from __future__ import annotations

import pytest

from hfsdp.builtin.chat.tool_calls import ToolCallMatch, parse_calls, same_json
from hfsdp.run.generation import GenerationItem, compared

CALL = {"type": "function", "function": {"name": "lookup_contact", "arguments": {"name": "Ingrid Okafor"}}}
HERMES = '<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Ingrid Okafor"}}\n</tool_call>'


@pytest.mark.parametrize("generated", [
    HERMES,
    '{"name": "lookup_contact", "arguments": {"name": "Ingrid Okafor"}}',  # bare
    '<tool_call>{"arguments":{"name":"Ingrid Okafor"},"name":"lookup_contact"}</tool_call>',  # order, spacing
    '<tool_call>\n{"name": "lookup_contact", "arguments": "{\\"name\\": \\"Ingrid Okafor\\"}"}\n</tool_call>',  # str
    '<tool_call>\n{"name": "lookup_contact", "parameters": {"name": "Ingrid Okafor"}}\n</tool_call>',
    'Let me look. {not json} <tool_call>\n' + HERMES[12:] + ' and then {"name": "x", "arguments": {}}',  # the first
])
def test_the_first_tool_call_matches_whatever_its_wrapping(generated):
    assert ToolCallMatch([CALL])(generated)


@pytest.mark.parametrize("generated", [
    HERMES.replace("lookup_contact", "lookup_person"),  # wrong name
    HERMES.replace("Ingrid Okafor", "Ingrid Okafo"),  # wrong argument
    HERMES.replace('{"name": "Ingrid Okafor"}', '{"name": "Ingrid Okafor", "city": "Lagos"}'),  # an extra argument
    HERMES.replace('{"name": "Ingrid Okafor"}', '{}'),  # a missing one
    HERMES.replace('"arguments"', '"args"'),  # no arguments: not a call
    'Ingrid Okafor is 34 years old.',  # no JSON
    '<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Ingrid Okafor"}\n</tool_call>',  # cut short
    '{"name": "Ingrid Okafor"}',  # an arguments object alone is not a call
    '',
])
def test_a_wrong_name_a_wrong_argument_or_no_call_fails(generated):
    assert not ToolCallMatch([CALL])(generated)


def test_arguments_are_compared_as_json_values():
    assert same_json({"a": 1, "b": [1, 2.0]}, {"b": [1.0, 2], "a": 1.0})
    assert not same_json({"a": [1, 2]}, {"a": [2, 1]})
    assert not same_json({"a": True}, {"a": 1}) and not same_json({"a": 0}, {"a": False})
    assert not same_json({"a": "1"}, {"a": 1}) and not same_json({"a": None}, {"a": "null"})
    number = ToolCallMatch([{"name": "f", "arguments": '{"n": 3}'}])  # a reference given as a JSON string
    assert number('{"name": "f", "arguments": {"n": 3.0}}') and not number('{"name": "f", "arguments": {"n": "3"}}')


def test_a_turn_of_several_calls_needs_them_all_in_order():
    second = {"type": "function", "function": {"name": "lookup_contact", "arguments": '{"name": "Kofi Novak"}'}}
    both = ToolCallMatch([CALL, second])
    two = HERMES + "\n" + HERMES.replace("Ingrid Okafor", "Kofi Novak")
    assert both(two) and not both(HERMES) and not both(HERMES.replace("Ingrid Okafor", "Kofi Novak") + "\n" + HERMES)
    assert len(parse_calls(two)) == 2
    assert str(both) == ('{"name": "lookup_contact", "arguments": {"name": "Ingrid Okafor"}} '
                         '{"name": "lookup_contact", "arguments": {"name": "Kofi Novak"}}')


def test_a_reference_that_is_no_tool_call_is_refused():
    with pytest.raises(ValueError, match="not a list of tool calls"):
        ToolCallMatch([{"function": {"arguments": {}}}])
    with pytest.raises(ValueError):
        ToolCallMatch([])


def test_a_rows_own_score_replaces_the_text_comparison_and_the_summary_says_what_it_compares():
    plain = GenerationItem("prompt", "shown", "  the answer ")
    tool = GenerationItem("prompt", "shown", str(ToolCallMatch([CALL])), ToolCallMatch([CALL]))
    assert plain.hit("the   answer") and not plain.hit("another answer") and plain.compared is None
    assert tool.hit(HERMES) and not tool.hit(tool.reference.replace("Okafor", "Okafo"))
    assert compared([plain, plain]) is None
    assert compared([tool, tool]) == "the first tool call (name and arguments)"
    assert compared([tool, plain]) == ("the first tool call (name and arguments) on 1 of 2 rows, "
                                       "the text on the others")


def test_chat_evaluates_a_bundled_tool_row_by_its_first_tool_call_and_trains_only_what_the_model_writes(
        tiny_model_dir):
    """The tools preset's rows read through Arrow, rendered with chatml_tools: generation eval's prompt ends at the
    generation prompt before the tool call, with the tools listed; the reference is the call; the loss covers the
    call and the answer (each with its <|im_end|>), never the tools preamble, the question or the tool's result."""
    import datasets
    from transformers import AutoTokenizer

    from conftest import PRESET_DATA
    from hfsdp import IGNORE_INDEX
    from hfsdp.builtin import chat
    from hfsdp.config.schema import DataConfig
    from hfsdp.data import prepare
    from hfsdp.model import chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = chat_template.resolve("chatml_tools")
    data = DataConfig(path="x", format="chat", chat_template="chatml_tools")
    rows = datasets.load_dataset("json", data_files=str(PRESET_DATA / "contacts_tools_eval.jsonl"), split="train")
    text, shown, reference, score = chat.generation_prompt(rows[0], data, tokenizer)
    name = rows[0]["messages"][1]["tool_calls"][0]["function"]["arguments"]["name"]
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert '"name": "lookup_contact"' in text and text.endswith(f"{shown}<|im_end|>\n<|im_start|>assistant\n")
    assert name in shown and reference == f'{{"name": "lookup_contact", "arguments": {{"name": "{name}"}}}}'
    assert score(f"<tool_call>\n{reference}\n</tool_call>") and not score(shown)
    assert score.compared == "the first tool call (name and arguments)"

    row = prepare.tokenize(rows.select(range(1)), chat.tokenize_chat, tokenizer, data, None)[0][0]
    trained, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            trained, current = [*trained, tokenizer.decode(current)], []
    trained += [tokenizer.decode(current)] if current else []
    answer = rows[0]["messages"][3]["content"]
    assert trained == [f"<tool_call>\n{reference}\n</tool_call><|im_end|>\n", f"{answer}<|im_end|>\n"]
