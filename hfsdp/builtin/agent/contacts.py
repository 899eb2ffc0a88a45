"""The bundled contacts as a small database behind a tool (the ``agent-rl`` preset's task, where acting is the only
way to win): :data:`CONTACTS` (name -> ``{name, age, city, job}``: the first record of each name in the bundled
contacts_train then contacts_eval files, as ``scripts/make_demo_data.py``'s ``database`` builds the agent rows),
``lookup_contact`` (a plain function: TRL's ``tools=``, ``grpo.tools: [hfsdp.builtin.agent.contacts:lookup_contact]``),
and the built-in reward
``contact_answer``: whether the final answer states the detail a row asks about (its ``field`` column) with the value
the database holds (its ``answer`` column), and no other value of that detail. Torch-free: a tool worker imports it."""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "config" / "presets" / "data"
FIELDS = ("age", "city", "job")


def _contacts() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in ("contacts_train.jsonl", "contacts_eval.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            person = json.loads(json.loads(line)["messages"][-1]["content"])
            out.setdefault(person["name"], person)
    return out


CONTACTS = _contacts()


def lookup_contact(name: str) -> str:
    """A contact's age, city and job, by full name.

    Args:
        name: the contact's full name
    """
    if name not in CONTACTS:
        raise KeyError(f"no contact named {name!r}")
    return json.dumps(CONTACTS[name])


# Every value each detail takes in the database: an answer that names another one as well is not an answer.
_VALUES = {field: sorted({str(p[field]) for p in CONTACTS.values()}) for field in ("city", "job")}


def _mentions(text: str, value: str) -> bool:
    """Whether ``text`` states ``value`` as a word (case-insensitive: "34" not in "134", "Lyon" not in "Lyonnais")."""
    return re.search(rf"(?<![\w]){re.escape(value)}(?![\w])", text, re.IGNORECASE) is not None


def states(text: str, field: str, value: str) -> bool:
    """Whether ``text`` states ``value`` of detail ``field`` and no other value of it (no other number for an age,
    no other city or job of the database), so that listing values cannot win."""
    if not _mentions(text, value):
        return False
    if field == "age":
        return all(number == value for number in re.findall(r"\d+", text))
    return not any(_mentions(text, other) for other in _VALUES.get(field, ()) if other.lower() != value.lower())


def final_answer(completion) -> str | None:
    """The text of a completion's final answer: its last message's, where that is an assistant turn that calls no
    tool (a rollout that ends on a call or a tool result has not answered); a text completion as it is."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return None
    last = completion[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    return last.get("content") or ""


def contact_answer(completions: list, field: list, answer: list, **kwargs) -> list[float]:
    """1 where the completion's final answer (:func:`final_answer`) states the value of the detail the row asks
    (``field``: age, city or job) that the database holds (``answer``), and no other value of that detail; else 0.
    The prompts do not hold the value: a guess rarely wins, a lookup does."""
    out = []
    for completion, asked, expected in zip(completions, field, answer):
        text = final_answer(completion)
        out.append(float(text is not None and states(text, asked, str(expected))))
    return out
