"""Agent rows read as people have them: OpenAI tool calls and tool results, a tools column, thinking, ShareGPT's
function_call / observation (LLaMA-Factory); bad rows named with their number and fix before anything trains; the
chat template chosen by data.chat_template; earlier turns' thinking trained or kept as context."""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from conftest import run_cli, tiny_config
from hfsdp import IGNORE_INDEX
from hfsdp.builtin import chat
from hfsdp.config.schema import DataConfig
from hfsdp.data import prepare
from hfsdp.errors import RowError, UserError
from hfsdp.model import chat_template

TOOLS = [{"type": "function", "function": {
    "name": "lookup_contact", "description": "Find a contact by name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]
OPENAI = [
    {"role": "user", "content": "Where does Ann Lee live?"},
    {"role": "assistant", "content": None, "reasoning_content": "Look her up.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "lookup_contact", "arguments": {"name": "Ann Lee"}}}]},
    {"role": "tool", "name": "lookup_contact", "tool_call_id": "c1", "content": '{"city": "Oslo"}'},
    {"role": "assistant", "content": "Ann Lee lives in Oslo.", "reasoning_content": "The tool says Oslo."},
]
# The same conversation as LLaMA-Factory writes it: ShareGPT roles, the call as JSON text, tools as a JSON text.
SHAREGPT = {"conversations": [
    {"from": "human", "value": "Where does Ann Lee live?"},
    {"from": "function_call", "value": json.dumps({"name": "lookup_contact", "arguments": {"name": "Ann Lee"}})},
    {"from": "observation", "value": '{"city": "Oslo"}'},
    {"from": "gpt", "value": "Ann Lee lives in Oslo."},
], "tools": json.dumps([TOOLS[0]["function"]])}


@pytest.fixture()
def tokenizer(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = chat_template.resolve("qwen3_training")  # renders tools, tool calls, results and thinking
    return tok


def _rows(rows, tokenizer, **cfg):
    data = DataConfig(path="x", format="chat", **cfg)
    return prepare.tokenize(datasets.Dataset.from_list(rows), chat.tokenize_chat, tokenizer, data, None)[0]


def _trained(tokenizer, row) -> list[str]:
    """The text of each run of tokens that carries loss."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_tool_calls_results_and_the_tools_column_are_rendered_and_only_the_assistant_trained(tokenizer):
    row = _rows([{"messages": OPENAI, "tools": TOOLS}], tokenizer)[0]
    text = tokenizer.decode(row["input_ids"])
    assert '"name": "lookup_contact"' in text and "<tool_response>\n{\"city\": \"Oslo\"}" in text
    assert _trained(tokenizer, row) == [
        '<think>\nLook her up.\n</think>\n\n<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Ann Lee"}}\n'
        '</tool_call><|im_end|>\n',
        "<think>\nThe tool says Oslo.\n</think>\n\nAnn Lee lives in Oslo.<|im_end|>\n"]


def test_arguments_as_json_text_and_the_sharegpt_shape_give_the_same_tokens(tokenizer):
    as_text = json.loads(json.dumps(OPENAI))
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"name": "Ann Lee"}'
    as_object = _rows([{"messages": OPENAI, "tools": TOOLS}], tokenizer)[0]
    assert _rows([{"messages": as_text, "tools": TOOLS}], tokenizer)[0] == as_object
    no_thinking = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in OPENAI]
    assert _rows([SHAREGPT], tokenizer)[0] == _rows([{"messages": no_thinking, "tools": TOOLS}], tokenizer)[0]


def test_thinking_by_any_of_its_names_reaches_the_template(tokenizer):
    renamed = [{k.replace("reasoning_content", key): v for k, v in m.items()} for m in OPENAI
               for key in ["thinking"]]
    a, b = _rows([{"messages": OPENAI, "tools": TOOLS}, {"messages": renamed, "tools": TOOLS}], tokenizer)
    assert a["input_ids"] == b["input_ids"] and "<think>\nThe tool says Oslo.\n</think>" in tokenizer.decode(a["input_ids"])


def test_earlier_turns_thinking_is_context_only_when_asked(tokenizer):
    """data.train_earlier_thinking: false takes the thinking of turns before the last user message out of the loss
    (it stays in the text); the last exchange's thinking and every answer are still trained."""
    later = [*OPENAI, {"role": "user", "content": "Thanks."},
             {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."}]
    trained = _rows([{"messages": later, "tools": TOOLS}], tokenizer)[0]
    context = _rows([{"messages": later, "tools": TOOLS}], tokenizer, train_earlier_thinking=False)[0]
    assert trained["input_ids"] == context["input_ids"]
    dropped = {"input_ids": trained["input_ids"], "labels": [a if a != b else IGNORE_INDEX for a, b in
                                                            zip(trained["labels"], context["labels"])]}
    assert _trained(tokenizer, dropped) == ["Look her up.", "The tool says Oslo."]
    assert "Be polite." in "".join(_trained(tokenizer, context))
    assert all(b in (a, IGNORE_INDEX) for a, b in zip(trained["labels"], context["labels"]))


@pytest.mark.parametrize("change, found", [
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].pop("name"),
     "message 1's tool call 0 has no function name: give it {type: function, function: {name: NAME"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{name: Ann Lee}"),
     "message 1's tool call 0's arguments is not JSON (Expecting property name enclosed in double quotes at "
     "character 1): give them as an object, or as a JSON text of one"),
    (lambda r: r["messages"].pop(1),
     "message 1 is a tool result with no tool call before it: a tool message answers an assistant turn's tool_calls"),
    (lambda r: r["tools"][0]["function"].update(parameters={"type": "string"}),
     "tools entry 0 has parameters that are not an object schema ({type: object, properties: {...}}): it is not a "
     "JSON schema of a function"),
    (lambda r: r.update(tools=[{"description": "no name"}]), "tools entry 0 has no name: it is not a JSON schema"),
])
def test_a_bad_agent_row_is_named_with_its_number_and_fix(tokenizer, change, found):
    rows = [{"messages": json.loads(json.dumps(OPENAI)), "tools": json.loads(json.dumps(TOOLS))} for _ in range(3)]
    for row in rows:  # arguments as JSON text in every row (a column holds texts or objects, not both)
        row["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"name": "Ann Lee"}'
    change(rows[2])
    with pytest.raises(UserError) as err:
        _rows(rows, tokenizer)
    assert "row 2 (counting from 0)" in str(err.value) and found in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_hfsdp_validate_names_a_bad_tool_call_by_its_line(tmp_path):
    rows = [{"messages": OPENAI, "tools": TOOLS}] * 5
    rows[3] = {"messages": [*OPENAI[:1], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "lookup_contact", "arguments": "Ann"}}]}], "tools": TOOLS}
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_config(tmp_path, data={"path": str(path), "eval_path": None, "chat_template": "qwen3_training"})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"data.path: line 4 of {path}: message 1's tool call 0's arguments is not JSON (Expecting value at "
            "character 0): give them as an object, or as a JSON text of one") in proc.stderr, proc.stderr


def test_a_template_that_ignores_tool_calls_is_refused_with_the_fix(tiny_model_dir):
    """SmolLM2's own template renders only content: a tool call would vanish from the text, so the row is refused,
    naming chatml_tools."""
    plain = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with pytest.raises(RowError, match=r"the chat template drops part of this row: message 1's tool call "
                                       r"\(lookup_contact\) is not in the text: this template does not render "
                                       r"tool_calls\. .*chatml_tools"):
        chat.tokenize_conversation(chat.conversation(OPENAI, DataConfig(path="x")), plain, chat.tools_of(TOOLS))


def test_a_family_template_that_re_renders_earlier_turns_is_refused_with_its_training_version(tokenizer):
    """Qwen3's original shows thinking only after the last user message, so an earlier turn renders differently once
    the conversation goes on: refused, naming qwen3_training."""
    tokenizer.chat_template = chat_template.resolve("qwen3")
    later = [*OPENAI, {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You're welcome."}]
    with pytest.raises(RowError) as err:
        chat.tokenize_conversation(chat.conversation(later, DataConfig(path="x")), tokenizer, chat.tools_of(TOOLS))
    assert str(err.value) == (
        "the chat template qwen3 cannot be masked on this conversation: message 1 renders differently once later "
        "messages follow (the template re-renders earlier turns: e.g. drops their thinking). set data.chat_template: "
        "qwen3_training (hfsdp ships it: the same family's template with every turn rendered alike and what the "
        "model generates marked)")


def test_data_chat_template_takes_a_name_or_a_file_next_to_the_config(tmp_path):
    (tmp_path / "mine.jinja").write_text(chat_template.resolve("qwen3_training"))
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps({"messages": OPENAI, "tools": TOOLS}) + "\n")
    for value in ("qwen3_training", "mine.jinja"):
        config = tiny_config(tmp_path, data={"path": str(path), "eval_path": None, "chat_template": value})
        proc = run_cli("validate", str(config))
        assert f"tokenized 1 of 1 rows of {path}" in proc.stderr, proc.stderr
    config = tiny_config(tmp_path, data={"path": str(path), "eval_path": None, "chat_template": "qwen9"})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2 and "data.chat_template: 'qwen9' is neither a file nor a template hfsdp ships" in \
        proc.stderr, proc.stderr


def test_a_chat_template_that_names_nothing_is_refused_with_the_config(tmp_path):
    """``data.chat_template`` is a rule of the config (the chat plugin's): ``validate --no-rows`` (no tokenizer, no
    torch) refuses a name that is neither shipped nor a file, with the closest name; it was refused only at use."""
    config = tiny_config(tmp_path, data={"chat_template": "qwen3_trainin"})
    proc = run_cli("validate", "--no-rows", str(config), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "data.chat_template: 'qwen3_trainin' is neither a file nor a template hfsdp ships (did you mean " \
           "'qwen3_training'?)" in proc.stderr, proc.stderr


def test_arguments_read_through_arrow_keep_their_own_keys(tokenizer, tmp_path):
    """A JSONL file whose rows call tools with other argument names, read by datasets: the tokens are those of the
    rows as written (no argument of another row's call, no null)."""
    other = json.loads(json.dumps(OPENAI))
    other[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    rows = [{"messages": OPENAI, "tools": TOOLS}, {"messages": other, "tools": TOOLS}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = datasets.load_dataset("json", data_files=str(tmp_path / "a.jsonl"), split="train")
    data = DataConfig(path="x", format="chat")
    via_arrow = prepare.tokenize(read, chat.tokenize_chat, tokenizer, data, None)[0]
    direct = _rows(rows, tokenizer)
    assert via_arrow["input_ids"] == direct["input_ids"]


def test_preference_and_unpaired_rows_take_tool_conversations(tokenizer):
    """A DPO pair whose prompt is a tool conversation and whose answers are tool calls (right and wrong arguments),
    and the same as KTO rows: the tools reach the template, and only the completion is labelled."""
    from hfsdp.builtin.preference import tokenize_pair
    from hfsdp.builtin.unpaired import tokenize_row

    data = DataConfig(path="x", format="preference")
    call = OPENAI[1]
    wrong = json.loads(json.dumps(call))
    wrong["tool_calls"][0]["function"]["arguments"] = {"name": "Ann Lea"}
    pair = tokenize_pair(OPENAI[:1], [call], [wrong], tokenizer, data, TOOLS)
    assert '"name": "lookup_contact"' in tokenizer.decode(pair["input_ids"])  # the tools' schema, in the prompt
    chosen = tokenizer.decode([t for t, label in zip(pair["input_ids"], pair["labels"]) if label != IGNORE_INDEX])
    rejected = tokenizer.decode([t for t, label in zip(pair["rejected_input_ids"], pair["rejected_labels"])
                                 if label != IGNORE_INDEX])
    assert chosen.endswith('{"name": "Ann Lee"}}\n</tool_call><|im_end|>\n') and "Ann Lea" in rejected
    row = tokenize_row(OPENAI[:3], OPENAI[3:], True, tokenizer, data, json.dumps(TOOLS))
    assert tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]) == \
        "<think>\nThe tool says Oslo.\n</think>\n\nAnn Lee lives in Oslo.<|im_end|>\n"


def test_a_preference_row_whose_template_drops_its_tool_call_is_refused(tiny_model_dir):
    from hfsdp.builtin.preference import tokenize_pair

    plain = AutoTokenizer.from_pretrained(str(tiny_model_dir))  # SmolLM2's template: content only
    with pytest.raises(RowError, match="drops part of this row: tools entry 0 \\(lookup_contact\\) is not in the text"):
        tokenize_pair(OPENAI[:1], [OPENAI[1]], [{"role": "assistant", "content": "No."}], plain,
                      DataConfig(path="x", format="preference"), TOOLS)


def test_grpo_prompts_carry_their_tools(tokenizer):
    from hfsdp.builtin.prompt import prompt_ids

    data = DataConfig(path="x", format="prompt")
    with_tools, without = prompt_ids(OPENAI[:1], tokenizer, data, TOOLS), prompt_ids(OPENAI[:1], tokenizer, data)
    assert '"name": "lookup_contact"' in tokenizer.decode(with_tools) and len(without) < len(with_tools)
    assert tokenizer.decode(with_tools).endswith("<|im_start|>assistant\n")


COMPLETIONS = [
    '<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Ann Lee"}}\n</tool_call><|im_end|>',
    '<think>\nLook her up.\n</think>\n\n<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Ann"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Lee"}}\n</tool_call><|im_end|>',
    "Ann Lee lives in Oslo.<|im_end|>",
    '<tool_call>\n{"name": "lookup_contact", "argu</tool_call><|im_end|>',  # malformed: its text
    '<tool_call>\n{"name": "lookup_contact", "arguments": {"name": "Ann Lee"}}',  # cut by max_new_tokens
    "no end of turn",
]


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_rewards_receive_each_completion_as_trls_grpo_parses_it(tiny_model_dir, family):
    """A conversational GRPO completion reaches the reward functions as the assistant message TRL 1.16's
    GRPOTrainer gives them (``parse_response`` with the family's response template): tool calls with their
    arguments, thinking, content; a malformed one as its text."""
    from trl.chat_template_utils import add_response_schema, parse_response

    ours = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ours.chat_template = chat_template.resolve(family)
    theirs = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    theirs.chat_template = ours.chat_template
    theirs = add_response_schema(theirs)
    prompt = chat.chat_ids(chat.conversation(OPENAI[:1], DataConfig(path="x")), ours, chat.tools_of(TOOLS),
                           add_generation_prompt=True)
    parsed = []
    for text in COMPLETIONS:
        ids = ours(text, add_special_tokens=False)["input_ids"]
        parsed.append(chat.parse_completion(ours, ids, prompt, chat.tools_of(TOOLS)))
        assert parsed[-1] == parse_response(theirs, ids, prefix=prompt, tools=TOOLS), text
    assert parsed[1]["tool_calls"][1]["function"]["arguments"] == {"name": "Lee"}
    assert parsed[3] == {"role": "assistant", "content": COMPLETIONS[3].removesuffix("<|im_end|>")}


def test_the_tool_call_reward_scores_the_first_parsed_call(tiny_model_dir):
    """GRPO's built-in tool_call reward: 1 where the completion's first parsed call is the row's answer (arguments
    as JSON values, a JSON-text answer too), 0 for another argument, no call, or a malformed one (read as text)."""
    from hfsdp.builtin.online.rewards import tool_call

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = chat_template.resolve("chatml_tools")
    tools = chat.tools_of(TOOLS)
    prompt = chat.chat_ids(chat.conversation(OPENAI[:1], DataConfig(path="x")), tok, tools, add_generation_prompt=True)
    completions = [[chat.parse_completion(tok, tok(text, add_special_tokens=False)["input_ids"], prompt, tools)]
                   for text in COMPLETIONS]
    answer = {"name": "lookup_contact", "arguments": {"name": "Ann Lee"}}
    # the fifth: cut by max_new_tokens after its JSON, before </tool_call>: read as a call (as TRL reads it)
    assert tool_call(completions, [answer] * 5 + [json.dumps(answer)]) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert tool_call(completions[:1], [json.dumps(answer)]) == [1.0]
    # a rollout that acted: its first call counts, not its last turn's text
    result = {"role": "tool", "name": "lookup_contact", "content": "{}"}
    acted = [completions[0] + [result, {"role": "assistant", "content": "Ann is 3."}],
             completions[1] + [result] + completions[0]]
    assert tool_call(acted, [answer, answer]) == [1.0, 0.0]
