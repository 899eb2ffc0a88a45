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


def test_bundled_tool_rows_are_the_generators_calls_of_the_asked_name_and_eval_names_are_held_out():
    module = generator()
    rows = module.tool_splits()
    for split, expected in rows.items():
        bundled = [json.loads(line) for line in (PRESET_DATA / f"contacts_tools_{split}.jsonl").read_text().splitlines()]
        assert bundled == expected, f"contacts_tools_{split}.jsonl is stale: run python scripts/make_demo_data.py"
        for row in bundled:
            question, call, result, answer = row["messages"]
            assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
            assert row["tools"] == [module.TOOL] and call["content"] == "" and "tool_calls" not in answer
            (tool_call,) = call["tool_calls"]
            name = tool_call["function"]["arguments"]["name"]
            assert tool_call["function"]["name"] == result["name"] == "lookup_contact"
            assert tool_call["id"] == result["tool_call_id"] and json.loads(result["content"])["name"] == name
            assert name in question["content"] and name in answer["content"] or answer["content"].startswith("They")
            assert not re.search(r"\ba [aeiou]", answer["content"]), answer["content"]
    names = {split: {r["messages"][1]["tool_calls"][0]["function"]["arguments"]["name"] for r in split_rows}
             for split, split_rows in rows.items()}
    assert len(rows["eval"]) == 32 and not names["train"] & names["eval"]
    trained = {row["messages"][0]["content"].replace(name, "{name}")
               for row, name in zip(rows["train"], [r["messages"][1]["tool_calls"][0]["function"]["arguments"]["name"]
                                                    for r in rows["train"]])}
    assert {q for _, q, _ in module.QUESTIONS} == trained  # every training phrasing used; the eval ones never
    assert not trained & {q for _, q, _ in module.EVAL_QUESTIONS}


def test_bundled_tool_pairs_and_prompts_are_the_generators_right_and_wrong_calls():
    module = generator()
    for kind, make in (("pref", module.tool_preference_splits), ("prompts", module.tool_prompt_splits)):
        for split, expected in make().items():
            path = PRESET_DATA / f"contacts_tools_{kind}_{split}.jsonl"
            bundled = [json.loads(line) for line in path.read_text().splitlines()]
            assert bundled == expected, f"{path.name} is stale: run python scripts/make_demo_data.py"
    for pair in module.tool_preference_splits()["train"]:
        right, wrong = (pair[k][0]["tool_calls"][0]["function"]["arguments"]["name"] for k in ("chosen", "rejected"))
        assert right != wrong and right.split()[1] == wrong.split()[1] and right in pair["prompt"][0]["content"]


def test_bundled_agent_rows_are_the_generators_and_its_database_is_the_agent_tools():
    from hfsdp.builtin.agent.contacts import CONTACTS

    module = generator()
    assert module.database() == CONTACTS
    for split, expected in module.agent_splits().items():
        bundled = [json.loads(line) for line in (PRESET_DATA / f"contacts_agent_{split}.jsonl").read_text().splitlines()]
        assert bundled == expected, f"contacts_agent_{split}.jsonl is stale: run python scripts/make_demo_data.py"


def test_bundled_pictures_are_the_generators_and_show_their_answers():
    """The vlm preset's rows: the generator's, and each picture shows its answer: as many filled quarters as the
    count, the shapes' colour, and their kind by how much of its box a shape fills (a square all of it, a circle
    about pi/4, a triangle about half)."""
    import base64
    import io

    from PIL import Image

    module = generator()
    for split, expected in module.shapes_splits().items():
        bundled = [json.loads(line) for line in (PRESET_DATA / f"shapes_{split}.jsonl").read_text().splitlines()]
        assert bundled == expected, f"shapes_{split}.jsonl is stale: run python scripts/make_demo_data.py"
    fills = {"square": (0.95, 1.01), "circle": (0.72, 0.85), "triangle": (0.4, 0.6)}
    for row in bundled:
        uri = row["messages"][0]["content"][0]["image"]
        image = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")
        cell = module.CELL
        quarters = [image.crop((x, y, x + cell, y + cell)) for y in (0, cell) for x in (0, cell)]
        shown = [q for q in quarters if any(pixel != (235, 235, 235) for pixel in q.getdata())]
        answer = row["messages"][1]["content"]
        if answer.isdigit():
            assert len(shown) == int(answer)
        elif answer in module.COLOURS:
            assert all(module.COLOURS[answer] in q.getdata() for q in shown)
        else:
            box = (cell - 6) ** 2  # (PIL draws both ends of a box)
            filled = sum(pixel != (235, 235, 235) for pixel in shown[0].getdata()) / box
            low, high = fills[answer]
            assert low <= filled <= high, (answer, filled)
