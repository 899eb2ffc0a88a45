"""The chat templates hfsdp ships (``chat_templates/``: real model families' templates and their ``_training``
versions, copied from TRL, and hfsdp's own ``chatml_tools``) and ``data.chat_template``: a shipped template by name,
or a ``.jinja`` file, put on the tokenizer before any data is read (so the data cache, generation eval and the
saved tokenizer all use it).

A tokenizer's own template is recognised by its exact text, as TRL recognises it: a family's original whose
``_training`` version renders a conversation the same way is masked with that version's ``{% generation %}``
markers (see :mod:`hfsdp.builtin.chat`).
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

from hfsdp.errors import UserError

TEMPLATES_DIR = Path(__file__).parent / "chat_templates"
TRAINING_SUFFIX = "_training"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def names() -> list[str]:
    """The shipped templates' names (``data.chat_template: NAME``)."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


@functools.cache
def _shipped(name: str) -> str:
    return (TEMPLATES_DIR / f"{name}.jinja").read_text()


def problem(value: str) -> str | None:
    """What keeps ``data.chat_template`` from naming a template (neither a shipped template's name nor a readable
    file), or None: checked with the config, before anything loads."""
    if (TEMPLATES_DIR / f"{value}.jinja").is_file() and "/" not in value:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            return f"cannot read {path}: {err}"
        return None
    close = difflib.get_close_matches(value, names(), n=1)
    return (f"'{value}' is neither a file nor a template hfsdp ships" + (f" (did you mean '{close[0]}'?)" if close
                                                                          else "")
            + ". Give a .jinja file's path, or a shipped template's name: chatml_tools, or a model family's training "
              "template such as qwen3_training, qwen2_5_training, llama3_training, gptoss_training (all of them: the "
              f".jinja files in {TEMPLATES_DIR})")


def resolve(value: str) -> str:
    """The template text ``data.chat_template`` names: a shipped template's name (read once a process: chat reads a
    family's training version for every row), or a file's path (:func:`problem` says what is wrong with another)."""
    if found := problem(value):
        raise UserError(f"data.chat_template: {found}")
    if (TEMPLATES_DIR / f"{value}.jinja").is_file() and "/" not in value:
        return _shipped(value)
    return Path(value).expanduser().read_text()


def use(tokenizer, value: str | None) -> None:
    """Put ``data.chat_template`` on the tokenizer (nothing when it is unset)."""
    if value is not None:
        tokenizer.chat_template = resolve(value)


def has_generation_markers(template: str) -> bool:
    """Whether the template marks what the model generates (``{% generation %}``), which transformers' assistant mask
    (``return_assistant_tokens_mask``) reads."""
    return bool(_GENERATION.search(template))


@functools.cache
def _by_text() -> dict[str, str]:
    return {_shipped(name).strip(): name for name in names()}


def known(template: str) -> str | None:
    """The shipped template's name whose text this is, or None."""
    return _by_text().get(template.strip())


def training_version(name: str) -> str | None:
    """The name of the ``_training`` version of a shipped original, or None when there is none."""
    twin = f"{name}{TRAINING_SUFFIX}"
    return twin if (TEMPLATES_DIR / f"{twin}.jinja").is_file() else None


# How a completion of the Hermes format (Qwen 2.5 and 3, chatml_tools) is read back into a message: thinking in
# <think>, each tool call a JSON object in <tool_call>, the rest content; TRL 1.16's ``qwen3_template``, which its
# GRPOTrainer sets for these families (transformers' ``parse_response`` reads it).
HERMES_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
HERMES_TEMPLATES = ("chatml_tools", "qwen2_5", "qwen3", "qwen3_instruct_2507", "qwen3_vl")


def response_template(tokenizer) -> dict | None:
    """How to read a completion back into a message (tool calls, thinking): the tokenizer's own
    ``response_template``, else the Hermes format's for a template of that family (or its training version), else
    None."""
    own = getattr(tokenizer, "response_template", None)
    if own:
        return own
    name = known(tokenizer.chat_template or "")
    return HERMES_RESPONSE if name and name.removesuffix(TRAINING_SUFFIX) in HERMES_TEMPLATES else None
