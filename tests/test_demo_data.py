"""The bundled demo task (hfsdp/config/presets/data/contacts_*.jsonl) is what scripts/make_demo_data.py generates, in
correct English."""

from __future__ import annotations

import importlib.util
import json
import re

from conftest import PRESET_DATA, REPO


def generator():
    spec = importlib.util.spec_from_file_location("make_demo_data", REPO / "scripts" / "make_demo_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bundled_rows_are_the_generators_and_say_an_before_a_vowel():
    rows = generator().splits()
    for split, expected in rows.items():
        bundled = [json.loads(line) for line in (PRESET_DATA / f"contacts_{split}.jsonl").read_text().splitlines()]
        assert bundled == expected, f"contacts_{split}.jsonl is stale: run python scripts/make_demo_data.py"
        prompts = [row["messages"][0]["content"] for row in bundled]
        wrong = [p for p in prompts if re.search(r"\ba [aeiou]", p)]
        assert not wrong, wrong[:3]
        assert sum(" an " in p for p in prompts) > 0  # "an electrician", "an engineer", "an architect"


def test_bundled_preference_rows_are_the_generators_pairs_of_a_right_and_a_wrong_answer():
    module = generator()
    for split, expected in module.preference_splits().items():
        bundled = [json.loads(line) for line in (PRESET_DATA / f"contacts_pref_{split}.jsonl").read_text().splitlines()]
        assert bundled == expected, f"contacts_pref_{split}.jsonl is stale: run python scripts/make_demo_data.py"
        sft = module.splits()[split]
        for row, source in zip(bundled, sft):
            assert row["prompt"] + row["chosen"] == source["messages"]
            assert row["chosen"][0]["content"] != row["rejected"][0]["content"]


def test_bundled_prompt_rows_are_the_generators_prompts_with_their_answers():
    for split, expected in generator().prompt_splits().items():
        bundled = [json.loads(line) for line in (PRESET_DATA / f"contacts_prompts_{split}.jsonl").read_text().splitlines()]
        assert bundled == expected, f"contacts_prompts_{split}.jsonl is stale: run python scripts/make_demo_data.py"
        assert all(row["prompt"][-1]["role"] == "user" and json.loads(row["answer"]) for row in bundled)
