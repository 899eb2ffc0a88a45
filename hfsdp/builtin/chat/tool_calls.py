"""Generation eval of a tool call: was the call the model generated the reference's, name and arguments?

A chat model writes its tool calls as text in its template's own wrapping (``<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>`` for Hermes/ChatML templates, a bare JSON object for others): :func:`parse_calls`
reads the JSON objects that have a ``name`` and ``arguments`` (or ``parameters``) out of any of them, and
:class:`ToolCallMatch` compares the first ones with the reference turn's calls as JSON values, not as text (key
order, spacing and an arguments object written as a JSON string do not matter; a different name, a missing, extra or
different argument does). Chat's generation eval (hook ``hfsdp_generation_prompts``) gives it as the row's ``score``.
"""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()


def _arguments(value: Any) -> Any:
    """A call's arguments as a JSON value: a JSON string (OpenAI's form) decoded, anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def call_of(value: Any) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` of a tool call: an OpenAI call (``{"type": "function", "function": {...}}``), a
    ``{name, arguments}`` or ``{name, parameters}`` object; None for anything else."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value.get("name"), str):
        return None
    for key in ("arguments", "parameters"):
        if key in value:
            return {"name": value["name"], "arguments": _arguments(value[key])}
    return None


def parse_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls in generated ``text``, in order: each JSON object with a string ``name`` and ``arguments`` (or
    ``parameters``), wherever it stands (inside ``<tool_call>`` tags or not); text that is not JSON is skipped, and
    so is a call's own arguments object."""
    calls, at = [], text.find("{")
    while at != -1:
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            at = text.find("{", at + 1)
            continue
        call = call_of(value)
        if call is not None:
            calls.append(call)
            at = text.find("{", end)  # past this object: its arguments are not a call of their own
        else:
            at = text.find("{", at + 1)
    return calls


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: objects by their keys whatever the order, arrays in order, numbers by value (1 and 1.0
    alike), and true/false never equal to 1/0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class ToolCallMatch:
    """``score(generated) -> bool`` of one reference turn's tool calls: the first calls parsed out of the generated
    text (as many as the turn has: one, usually) are the reference's, in order, name and arguments as JSON values.
    ``compared`` says what is compared, for the summary; ``str()`` is the reference as the model is taught to write
    it (one JSON object a call)."""

    compared = "the first tool call (name and arguments)"

    def __init__(self, tool_calls: list[Any]):
        self.calls = [call_of(call) for call in tool_calls]
        if not self.calls or any(call is None for call in self.calls):
            raise ValueError(f"not a list of tool calls ({{name, arguments}} or OpenAI's "
                             f"{{type: function, function: {{name, arguments}}}}): {tool_calls!r}")

    def __call__(self, generated: str) -> bool:
        found = parse_calls(generated)[:len(self.calls)]
        return len(found) == len(self.calls) and all(
            f["name"] == c["name"] and same_json(f["arguments"], c["arguments"]) for f, c in zip(found, self.calls))

    def __str__(self) -> str:
        return " ".join(json.dumps(call, ensure_ascii=False) for call in self.calls)
