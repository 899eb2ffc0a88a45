"""Test tools and environments over the bundled contacts (the tool results of the ``tools`` preset's conversations):
``lookup_contact`` as a plain function (TRL's ``tools=``) and :class:`Contacts`, an environment whose reward is
whether the rollout looked up the person its row asks about (TRL's ``environment_factory`` with ``get_reward``;
:class:`QuietContacts`, the same without the line its reset appends to the prompt), and the rewards ``answered``
and ``looked_up``."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "hfsdp" / "config" / "presets" / "data"


def _contacts() -> dict[str, dict]:
    out = {}
    for name in ("contacts_tools_train.jsonl", "contacts_tools_eval.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            for message in json.loads(line)["messages"]:
                if message["role"] == "tool":
                    record = json.loads(message["content"])
                    out[record["name"]] = record
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


class Contacts:
    """One rollout's view of the contacts: it is rewarded for looking up the person its row asks about."""

    def reset(self, **row) -> str:
        self.asked = row["answer"]["arguments"]["name"]
        self.looked_up = []
        return " (Use the tool.)"

    def lookup_contact(self, name: str) -> str:
        """A contact's age, city and job, by full name.

        Args:
            name: the contact's full name
        """
        self.looked_up.append(name)
        return lookup_contact(name)

    def get_reward(self) -> float:
        return float(self.asked in self.looked_up)


def answered(completions, answer, **kwargs) -> list[float]:
    """1 where the last turn names a detail (age, city or job) of the person the row asks about, else 0."""
    out = []
    for completion, expected in zip(completions, answer):
        record = CONTACTS.get(expected["arguments"]["name"], {})
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(float(any(str(record[k]) in text for k in ("age", "city", "job") if k in record)))
    return out


class QuietContacts(Contacts):
    """:class:`Contacts` whose reset appends nothing to the prompt: the shrunk test model, fine-tuned on the bare
    questions, calls the tool in about half its rollouts of them, in few of those with " (Use the tool.)" after."""

    def reset(self, **row) -> None:
        super().reset(**row)


def looked_up(completions, **kwargs) -> list[float]:
    """1 where the rollout got a contact's record from the tool (a result that is not an error), else 0. The shrunk
    model mostly asks for a name it made up, so ``answered`` and ``tool_call`` are 0 in most groups; this one
    varies within them, so that the steps have a gradient."""
    return [float(any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("{'error'")
                      for m in completion)) for completion in completions]
