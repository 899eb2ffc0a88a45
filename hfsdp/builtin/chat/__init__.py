"""Format ``chat``: rows with a list of messages, rendered with the chat template (the tokenizer's, or
``data.chat_template``).

Rows come in the shapes people have, read without configuration:

* OpenAI / transformers ``messages``: ``{role, content}`` with the roles system, user, assistant and tool; an
  assistant turn may carry ``tool_calls`` (``[{type: function, function: {name, arguments}}]``, the arguments an
  object or a JSON text) and its thinking (``reasoning_content``, or ``thinking`` / ``reasoning``); a tool message its
  ``name`` and ``tool_call_id``. Any other key a template reads (``name``, ...) passes through.
* ShareGPT ``conversations``: ``{from, value}`` with the roles human, gpt and system, and LLaMA-Factory's
  ``function_call`` (the value is the call, or a list of calls, as JSON) and ``observation`` (a tool result).
* A ``tools`` column: the functions the assistant may call, as JSON schemas (``{type: function, function: {name,
  description, parameters}}``, or the function alone, or all of it as a JSON text as LLaMA-Factory writes it), given
  to the template (``apply_chat_template(tools=...)``).

Other shapes are named by ``data.messages_field``, ``data.message_keys`` and ``data.roles``. :func:`conversation`
turns one row's messages into the template's messages, or says what is wrong with the row and which key fixes it.

Only what the assistant generates carries loss: each assistant turn's content, tool calls and thinking (where the
template renders it); system, user, tool results and the tools preamble never do. The mask comes from, in order:

1. the template's ``{% generation %}`` markers (transformers' ``return_assistant_tokens_mask``);
2. for a model family's original template that hfsdp recognises (see :mod:`hfsdp.model.chat_template`), the markers
   of its ``_training`` version, when that version renders the row to the same text;
3. otherwise each assistant turn is found by rendering the conversation up to that turn (with the generation prompt)
   and through it; this needs a template that renders a conversation's prefixes as prefixes of the whole.

A row none of these can mask (a template that re-renders earlier turns once later ones follow, as Qwen3's drops their
thinking), or whose text lacks a part of a message (a template that ignores ``tool_calls``), is refused with the
template and the fix, never trained with a wrong mask.
"""

from __future__ import annotations

import json
from typing import Any

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.builtin.chat import tool_calls
from hfsdp.data import images
from hfsdp.errors import RowError, UserError
from hfsdp.model import chat_template
from hfsdp.rules.table import Rule

ALWAYS_ON = True

# (messages column, role key, content key) of the shapes recognised without configuration, in the order tried.
MESSAGES_FIELDS = ("messages", "conversations")
MESSAGE_KEYS = (("role", "content"), ("from", "value"))
TOOLS_FIELD = "tools"
# The rows' role names -> the chat template's; data.roles adds to these.
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "human": "user",
         "gpt": "assistant", "observation": "tool", "function_call": "assistant"}
CALL_ROLE = "function_call"  # ShareGPT (LLaMA-Factory): an assistant turn whose text is its tool call(s) as JSON
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # an assistant turn's thinking, by any of its names
REASONING = "reasoning_content"  # the name the template gets (transformers copies it under the others)


def messages_field(data_config, columns) -> str:
    """The column holding the messages: ``data.messages_field``, else the first of MESSAGES_FIELDS present."""
    if data_config.messages_field:
        if data_config.messages_field not in columns:
            raise UserError(f"data.messages_field: column '{data_config.messages_field}' not found; columns: "
                            f"{', '.join(columns)}")
        return data_config.messages_field
    found = next((f for f in MESSAGES_FIELDS if f in columns), None)
    if found is None:
        raise UserError(f"chat data needs a column of messages ({' or '.join(MESSAGES_FIELDS)}); columns: "
                        f"{', '.join(columns)}. Name yours with data.messages_field")
    return found


def _without_nulls(value: Any) -> Any:
    """``value`` with the null entries of its mappings dropped: rows read through Arrow carry, in every object of a
    column, every key any row's object has (null where it lacks it)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _json_object(value: Any, what: str, expected: str) -> Any:
    """``value`` itself, or parsed when it is a JSON text; a RowError naming ``what`` when that text is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise RowError(f"{what} is not JSON ({err.msg} at character {err.pos}): give {expected}") from None


def _row_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call as ``{type: function, function: {name, arguments}}`` (arguments an object), or a RowError."""
    if not isinstance(call, dict):
        raise RowError(f"{where} is a {type(call).__name__}, not a mapping with a function name and arguments")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise RowError(f"{where} has no function name: give it {{type: function, function: {{name: NAME, "
                       "arguments: {...}}}}")
    arguments = _json_object(function.get("arguments", function.get("parameters", {})), f"{where}'s arguments",
                             "them as an object, or as a JSON text of one")
    if not isinstance(arguments, dict):
        raise RowError(f"{where}'s arguments are a {type(arguments).__name__}, not an object of named arguments")
    own = ("function", "type") if "function" in call else ("name", "arguments", "parameters", "type")
    kept = {k: v for k, v in call.items() if k not in own}  # the call's id, ...
    return {**kept, "type": "function", "function": {"name": function["name"], "arguments": _without_nulls(arguments)}}


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    calls = _json_object(value, f"{where}'s tool calls", "a list of {name, arguments} calls, as JSON")
    calls = calls if isinstance(calls, list) else [calls]
    if not calls:
        raise RowError(f"{where} has an empty list of tool calls: drop the key, or give the calls")
    return [_row_call(c, f"{where}'s tool call {k}") for k, c in enumerate(calls)]


def conversation(messages: Any, data_config, parts: bool = False) -> list[dict[str, Any]]:
    """One row's messages as the template reads them (roles system, user, assistant, tool; ``content`` a text;
    ``tool_calls`` normalised, thinking as ``reasoning_content``; other keys as they are), or a RowError naming the
    message at fault and the config key that fixes it. Content given as a list of parts: with ``parts``, kept as
    text and image parts (:func:`visual_conversation` reads the images), else its text parts joined, and a
    RowError for an image (only the chat format trains on images)."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"the messages are {type(messages).__name__ if messages is not None else 'missing'}"
                       f"{' (empty)' if messages == [] else ''}, not a list of messages: give every row a list of "
                       "{role, content} (or ShareGPT {from, value}) messages")
    keys = data_config.message_keys
    roles = {**ROLES, **(data_config.roles or {})}
    out: list[dict[str, Any]] = []
    calls_seen = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {i} is a {type(message).__name__}, not a mapping with a role and a text")
        message = _without_nulls(message)
        present = sorted(message)
        if keys is not None:
            role_key, content_key = keys.role, keys.content
        else:
            role_key, content_key = next(((r, c) for r, c in MESSAGE_KEYS if r in present and (
                c in present or "tool_calls" in present)), (None, None))
        if role_key not in present or (content_key not in present and "tool_calls" not in present):
            given = f"data.message_keys {{role: {keys.role}, content: {keys.content}}}" if keys else \
                " or ".join(f"{r}/{c}" for r, c in MESSAGE_KEYS)
            raise RowError(f"message {i} has the keys {present}, not {given}: set data.message_keys: "
                           "{role: KEY, content: KEY} to the keys of its role and text")
        role, content = message[role_key], message.get(content_key)
        if role not in roles:
            raise RowError(f"message {i} has the role {role!r}, which is none of {', '.join(roles)}: map it with "
                           f"data.roles: {{{role}: ROLE}}, ROLE being system, user, assistant or tool")
        turn = {k: v for k, v in message.items() if k not in (role_key, content_key, *REASONING_KEYS)}
        turn["role"] = roles[role]
        if role == CALL_ROLE and role not in (data_config.roles or {}):
            turn["content"], turn["tool_calls"] = "", _tool_calls(content, f"message {i}")
        elif content is None and "tool_calls" in message:
            turn["content"] = ""  # a turn of tool calls alone (OpenAI's content null): templates read its content
        elif isinstance(content, list):
            turn["content"] = _content_parts(content, i)
            if not parts:
                if any(part["type"] != "text" for part in turn["content"]):
                    raise RowError(f"message {i} holds an image: {images.FORMATS_WITH_IMAGES} so far; remove the "
                                   "image parts for this format")
                turn["content"] = "".join(part["text"] for part in turn["content"])
        elif isinstance(content, (int, float, bool)):
            # datasets 5 stores a column whose messages mix content parts and texts as JSON, and reads back a text
            # that is valid JSON ("3", "true") as its value: written back as that JSON text
            turn["content"] = json.dumps(content)
        elif not isinstance(content, str):
            raise RowError(f"message {i}'s {content_key} is a {type(content).__name__}, not a text (or a list of "
                           "content parts)")
        else:
            turn["content"] = content
        if "tool_calls" in message:
            if turn["role"] != "assistant":
                raise RowError(f"message {i} has tool calls but the role {role!r}: only assistant turns call tools")
            turn["tool_calls"] = _tool_calls(message["tool_calls"], f"message {i}")
        calls_seen += len(turn.get("tool_calls", ()))
        if turn["role"] == "tool" and not calls_seen:
            raise RowError(f"message {i} is a tool result with no tool call before it: a tool message answers an "
                           "assistant turn's tool_calls (or ShareGPT's function_call); add the call, or make the "
                           "result a user message")
        thinking = [message[k] for k in REASONING_KEYS if k in message]
        if thinking and turn["role"] == "assistant":
            if not isinstance(thinking[0], str):
                raise RowError(f"message {i}'s thinking is a {type(thinking[0]).__name__}, not a text")
            if thinking[0]:
                turn[REASONING] = thinking[0]
        out.append(turn)
    return out


def _content_parts(content: list, i: int) -> list[dict[str, Any]]:
    """A message's content given as OpenAI / TRL content parts: text parts and image parts
    (:mod:`hfsdp.data.images` reads their images), or a RowError naming the part at fault."""
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in images.IMAGE_PARTS:
            parts.append(part)
        else:
            raise RowError(f"message {i}'s content part {k} is "
                           + (f"of type {kind!r}" if kind else f"a {type(part).__name__} without a type")
                           + ": content parts are {type: text, text: ...} and {type: image, image: ...} (or "
                           "image_url); hfsdp trains on text and images, not audio or video")
    return parts


def tools_of(value: Any) -> list[dict[str, Any]] | None:
    """A row's ``tools`` as the JSON schemas the template gets (``{type: function, function: {...}}``), or None when
    the row has none; a RowError for an entry that is not a function's JSON schema."""
    value = _without_nulls(_json_object(value, "the tools column", "a list of JSON schemas, or a JSON text of one"))
    if value is None or value == [] or value == "":
        return None
    if not isinstance(value, list):
        raise RowError(f"the tools column is a {type(value).__name__}, not a list of JSON schemas of functions")
    tools = []
    for k, entry in enumerate(value):
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        problem = (
            f"is a {type(entry).__name__}" if not isinstance(entry, dict) else
            "has no name" if not isinstance(function, dict) or not isinstance(function.get("name"), str) else
            "has parameters that are not an object schema ({type: object, properties: {...}})"
            if "parameters" in function and not (isinstance(function["parameters"], dict)
                                                 and function["parameters"].get("type", "object") == "object"
                                                 and isinstance(function["parameters"].get("properties", {}), dict))
            else None)
        if problem:
            raise RowError(f"tools entry {k} {problem}: it is not a JSON schema of a function; give {{type: "
                           "function, function: {name: NAME, description: TEXT, parameters: {type: object, "
                           "properties: {...}}}}")
        tools.append({"type": "function", "function": function} if "function" not in entry else entry)
    return tools


def render(tokenizer, messages, tools, add_generation_prompt=False, template=None) -> str:
    """Messages (from :func:`conversation`) as the chat template (``template``, else the tokenizer's) renders them
    with ``tools``, or a RowError naming the template where it fails on them."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # the template's own refusal (raise_exception) or its failure on these values
        used = template or tokenizer.chat_template
        raise RowError(f"{_named(used)} fails on this conversation ({type(err).__name__}: {err}). "
                       f"{_fix(used)}") from None


def _named(template: str) -> str:
    name = chat_template.known(template)
    return f"the chat template {name}" if name else "the chat template"


def _fix(template: str) -> str:
    """What to set when ``template`` cannot mask a row."""
    name = chat_template.known(template)
    twin = chat_template.training_version(name) if name else None
    if twin:
        return (f"set data.chat_template: {twin} (hfsdp ships it: the same family's template with every turn rendered "
                "alike and what the model generates marked)")
    return ("set data.chat_template to a .jinja file whose assistant output is wrapped in {% generation %} ... "
            "{% endgeneration %}, or to a training template hfsdp ships (chatml_tools; a family's NAME_training)")


def _missing_part(text: str, messages: list[dict], tools) -> str | None:
    """What of the row the rendered text lacks (a tool call, the thinking, a tool's schema), or None."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages):
        for call in m.get("tool_calls", ()):
            if call["function"]["name"] not in text:
                return f"message {i}'s tool call ({call['function']['name']}) is not in the text: this template " \
                       "does not render tool_calls"
        # Thinking before the last user message is the template's to drop (most families show the model only the
        # current answer's); after it, the turn being learned, it must be there.
        if m.get(REASONING) and i > last_user and m[REASONING].strip() not in text:
            return f"message {i}'s thinking is not in the text: this template does not render reasoning_content"
        if m["role"] == "tool" and not any(form in text for form in (m["content"].strip(), json.dumps(m["content"]))):
            return f"message {i} (a tool result) is not in the text: this template does not render tool messages"
    for k, tool in enumerate(tools or ()):
        if tool["function"]["name"] not in text:
            return f"tools entry {k} ({tool['function']['name']}) is not in the text: this template does not render tools"
    return None


def _rerendered(tokenizer, messages, tools, text) -> int | None:
    """The first message whose rendering changes once later messages follow (its conversation through it is not a
    prefix of the whole text), or None."""
    return next((i for i in range(len(messages) - 1)
                 if not text.startswith(render(tokenizer, messages[: i + 1], tools))), None)


def _check_parts(text: str, messages: list[dict], tools, template: str) -> None:
    """A RowError when ``text`` (the rendered row) lacks a part of it (see :func:`_missing_part`)."""
    if missing := _missing_part(text, messages, tools):
        raise RowError(f"{_named(template)} drops part of this row: {missing}. Remove that part from the rows, or "
                       "set data.chat_template to a template that renders it (a .jinja file; chatml_tools renders "
                       "tool calls, tool results and thinking)")


def chat_ids(messages: list[dict], tokenizer, tools=None, add_generation_prompt: bool = False) -> list[int]:
    """The token ids of messages (from :func:`conversation`) rendered with the chat template, as
    ``apply_chat_template(tokenize=True)`` gives them, or a RowError when the text leaves out a part of them: what
    the preference, unpaired and prompt formats tokenize."""
    text = render(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    _check_parts(text, messages, tools, tokenizer.chat_template)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_completion(tokenizer, ids: list[int], prompt_ids: list[int], tools=None) -> dict[str, Any]:
    """A sampled completion as the assistant message it is, as TRL's GRPOTrainer gives its reward functions: read
    with the template's response format (:func:`hfsdp.model.chat_template.response_template`: content, thinking as
    ``reasoning_content``, ``tool_calls`` with their arguments typed by the tools' schemas); a completion it cannot
    read (a malformed call), or a template without one, gives its decoded text as the content."""
    text = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    schema = chat_template.response_template(tokenizer)
    if schema is None:
        return text
    try:
        parsed = tokenizer.parse_response(ids, schema=schema, prefix=prompt_ids, tools=tools)
    except (ValueError, TypeError):
        return text
    if parsed is None:
        return text
    parsed["content"] = (parsed.get("content") or "").removesuffix(tokenizer.eos_token or "")
    for call in parsed.get("tool_calls", ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", {}), dict)):
            return text
    return parsed


def _prefix_spans(tokenizer, messages, tools, text) -> list[tuple[int, int]]:
    """The characters of each assistant turn: from the end of the conversation before it (with the generation prompt)
    to the end of the conversation through it; a RowError when those are not prefixes of the whole text."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1], tools)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            changed = _rerendered(tokenizer, messages, tools, text)
            why = (f"message {changed} renders differently once later messages follow (the template re-renders "
                   "earlier turns: e.g. drops their thinking)" if changed is not None else
                   f"the generation prompt is not how message {i} starts")
            raise RowError(f"{_named(tokenizer.chat_template)} cannot be masked on this conversation: {why}. "
                           f"{_fix(tokenizer.chat_template)}")
        spans.append((len(before), len(through)))
    return spans


def _overlapping(offsets, spans) -> list[int]:
    """1 for each token whose characters overlap a span, else 0 (transformers' rule for the assistant mask)."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def _thinking_span(tokenizer, messages, tools, i, text, template) -> tuple[int, int] | None:
    """The characters of message ``i``'s thinking in ``text``: where the text differs from the text rendered without
    that thinking; None when the template does not render it."""
    other = render(tokenizer, [{k: v for k, v in m.items() if k != REASONING} if j == i else m
                                for j, m in enumerate(messages)], tools, template=template)
    if other == text:
        return None
    start = next((k for k, (a, b) in enumerate(zip(text, other)) if a != b), min(len(text), len(other)))
    tail = 0  # the characters both texts end with, after the common start
    while tail < min(len(text), len(other)) - start and text[-1 - tail] == other[-1 - tail]:
        tail += 1
    return start, len(text) - tail


def tokenize_conversation(messages, tokenizer, tools=None, train_earlier_thinking: bool = True):
    """Token ids and labels of one conversation; labels are -100 outside what the assistant generates."""
    template = tokenizer.chat_template
    text = render(tokenizer, messages, tools)
    mask_template = template if chat_template.has_generation_markers(template) else None
    if mask_template is None and (name := chat_template.known(template)) and chat_template.training_version(name):
        mask_template = chat_template.resolve(chat_template.training_version(name))
        if render(tokenizer, messages, tools, template=mask_template) != text:
            changed = _rerendered(tokenizer, messages, tools, text)
            why = (f"message {changed} renders differently once later messages follow (the template re-renders "
                   "earlier turns: e.g. drops their thinking)" if changed is not None else
                   "it renders this conversation differently from its training version")
            raise RowError(f"{_named(template)} cannot be masked on this conversation: {why}. {_fix(template)}")
    _check_parts(text, messages, tools, template)
    if mask_template is not None:
        out = tokenizer.apply_chat_template(messages, tools=tools, chat_template=mask_template, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        ids, mask, offsets = list(out["input_ids"]), list(out["assistant_masks"]), out.encodings[0].offsets
    else:
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(out["input_ids"]), out["offset_mapping"]
        mask = _overlapping(offsets, _prefix_spans(tokenizer, messages, tools, text))
    if not train_earlier_thinking:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        spans = [span for i, m in enumerate(messages[:last_user]) if m["role"] == "assistant" and m.get(REASONING)
                 and (span := _thinking_span(tokenizer, messages, tools, i, text, mask_template))]
        for t, hit in enumerate(_overlapping(offsets, spans)):
            mask[t] = mask[t] and not hit
    return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]


def _needs_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("chat data needs a chat template; this tokenizer has none: set data.chat_template (a .jinja "
                        "file, or chatml_tools) or use data.format: instruction")
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("chat data needs a fast tokenizer (its token offsets place the loss mask); this one is "
                        f"{type(tokenizer).__name__}: use the model's tokenizer.json")


def tokenized_rows(batch, size: int, columns: tuple[str, ...] | None, tokenize_row) -> dict[str, list]:
    """The ``columns`` (None: those of the first row) of a format's tokenized ``batch`` of ``size`` rows:
    ``tokenize_row(position, tools)`` of each
    row (``tools``: the row's :data:`TOOLS_FIELD` entry, None without that column), a RowError naming its row."""
    out: dict[str, list] = {column: [] for column in columns or ()}
    for position in range(size):
        try:
            row = tokenize_row(position, batch[TOOLS_FIELD][position] if TOOLS_FIELD in batch else None)
        except RowError as err:
            err.position = position
            raise
        for column in columns or row:
            out.setdefault(column, []).append(row[column])
    return out


def visual_conversation(row_messages, row_images, tokenizer, data_config) -> tuple[list[dict], list[bytes]]:
    """One row's messages (:func:`conversation`) and its images (:func:`hfsdp.data.images.with_images`): as content
    parts for a vision-language model's template; for a text-only model, or a template that reads texts only (a
    vision-language model trained on text rows with ``data.chat_template: chatml_tools``), the messages with their
    text parts joined, or a RowError when the row has images."""
    chat, found = images.with_images(conversation(row_messages, data_config, parts=True), row_images,
                                     images.data_folder(data_config.path), data_config.image_max_pixels)
    if images.processor_of(tokenizer) is None:
        if found:
            raise RowError(f"has {len(found)} image(s), and the model is text-only: train a vision-language model "
                           "(one whose config has a vision_config: Qwen2.5-VL, SmolVLM, Gemma 3, ...), or remove "
                           "the images from the rows")
        return images.text_only(chat), found
    if not _reads_parts(tokenizer):
        if found:
            raise RowError(f"has {len(found)} image(s), and {_named(tokenizer.chat_template)} renders texts only, "
                           "never an image: leave data.chat_template unset (the model's processor renders images), "
                           "or name a template that renders image parts")
        return images.text_only(chat), found
    return images.as_parts(chat), found


_READS_PARTS: dict[str, bool] = {}


def _reads_parts(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a message's content given as a list of parts (a
    vision-language processor's template does; a text template, chatml_tools say, adds the content as a text)."""
    template = tokenizer.chat_template
    if template not in _READS_PARTS:
        probe = "hfsdp: a text part"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": probe}]}],
                                                 tokenize=False)
            _READS_PARTS[template] = probe in text and "'type'" not in text
        except Exception:  # (the template's failure on a list where it adds a text)
            _READS_PARTS[template] = False
    return _READS_PARTS[template]


def tokenize_chat(batch, tokenizer, data_config):
    _needs_template(tokenizer)
    messages = batch[messages_field(data_config, list(batch))]
    processor = images.processor_of(tokenizer)
    columns = ("input_ids", "labels") if processor is None else None

    def tokenize_row(position, tools):
        row_images = batch[images.IMAGES_COLUMN][position] if images.IMAGES_COLUMN in batch else None
        chat, found = visual_conversation(messages[position], row_images, tokenizer, data_config)
        tools = tools_of(tools)
        ids, labels = tokenize_conversation(chat, tokenizer, tools, data_config.train_earlier_thinking)
        if processor is None:
            return {"input_ids": ids, "labels": labels}
        return images.expand(processor, render(tokenizer, chat, tools), found, ids, labels)

    return tokenized_rows(batch, len(messages), columns, tokenize_row)


def generation_prompt(row, data_config, tokenizer) -> tuple:
    """Generation eval of a conversation: the conversation before its first assistant turn that calls tools, else
    before its last assistant turn (chat template, the row's tools, generation prompt), the turn before it shown, and
    the reference: that turn's tool calls, with the score that compares the first call generated with them (name and
    arguments as JSON values, :class:`hfsdp.builtin.chat.tool_calls.ToolCallMatch`), else the answer's text. For a
    vision-language model, where the conversation before that turn has images, also those (a fifth value)."""
    chat, found = visual_conversation(row[messages_field(data_config, list(row))], row.get(images.IMAGES_COLUMN),
                                      tokenizer, data_config)
    messages = images.text_only(chat)
    tools = tools_of(row[TOOLS_FIELD]) if TOOLS_FIELD in row else None
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise RowError("has no assistant turn to compare with; give every eval conversation an assistant answer, or "
                       "remove the generation_eval section")
    turn = next((i for i in answers if messages[i].get("tool_calls")), answers[-1])
    text = render(tokenizer, chat[:turn], tools, add_generation_prompt=True)
    shown = "[image] " * images.count(chat[turn - 1:turn]) + messages[turn - 1]["content"] if turn else ""
    seen = tuple(found[:images.count(chat[:turn])])
    with_images = (seen,) if seen else ()  # (a row without images: the 3 or 4 values it always split into)
    if not messages[turn].get("tool_calls"):
        return (text, shown, messages[turn]["content"], *((None, *with_images) if seen else ()))
    match = tool_calls.ToolCallMatch(messages[turn]["tool_calls"])
    return (text, shown, str(match), match, *with_images)


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("data.chat_template",), template_problems)]


def template_problems(config, facts) -> list[tuple[str, str]]:
    """``data.chat_template`` names a template: a shipped one or a readable file (checked with the config, not at
    first use)."""
    value = config.data.chat_template
    found = chat_template.problem(value) if value is not None else None
    return [("data.chat_template", found)] if found else []


@hookimpl
def hfsdp_dataset_formats():
    return {"chat": tokenize_chat}


@hookimpl
def hfsdp_generation_prompts():
    return {"chat": generation_prompt}
