"""Generate the bundled demo task: turn a sentence about a person into one line of JSON.

A held-out split makes the effect of fine-tuning measurable as exact-match accuracy: the pretrained
SmolLM2-135M-Instruct answers in prose or malformed JSON; after a few dozen steps it answers in the format.
Run: python scripts/make_demo_data.py  (deterministic; rewrites hfsdp/config/presets/data/contacts_*.jsonl)

The preference files (contacts_pref_<split>.jsonl, for ``data.format: preference``) pair the first rows' prompt with
the right JSON (chosen) and the same JSON with one field wrong (rejected): TRL's conversational shape. The prompt
files (contacts_prompts_<split>.jsonl, for ``data.format: prompt``) hold the prompts with the right JSON as ``answer``.
The unpaired files (contacts_unpaired_<split>.jsonl, for ``data.format: unpaired`` and KTO) are the preference pairs
unpaired as TRL's ``unpair_preference_dataset`` does (the chosen answer labelled true, the rejected one false), each
pair's two rows side by side.

The tool files (contacts_tools_<split>.jsonl, for ``data.format: chat`` with a tool-calling template: the ``tools``
preset) are conversations about the bundled contacts in OpenAI's shape: a question about one person by name, the
assistant's call of the ``lookup_contact`` tool (``TOOL``) with that name, the tool's answer (the contact as JSON)
and the assistant's answer from it, the tool listed in each row's ``tools``. The eval rows ask about people no
training row names, some in phrasings no training row uses. Their preference files (contacts_tools_pref_<split>.jsonl)
pair the right call with a call naming someone else; their prompt files (contacts_tools_prompts_<split>.jsonl) hold
the question, the tools and the expected call as ``answer``.

The agent files (contacts_agent_<split>.jsonl, for GRPO with the ``lookup_contact`` tool: the ``agent-rl`` preset)
ask one detail (age, city or job) of a person of the contacts database (``database``: the first record of each name
in contacts_train then contacts_eval, what ``hfsdp.builtin.agent.contacts.CONTACTS`` reads) and carry the detail
asked (``field``) and its value (``answer``), which no prompt holds: only a lookup finds it. The eval rows ask about
the tool eval rows' people, whom no training row of either file names.

The shapes files (shapes_<split>.jsonl, for a vision-language model: the ``vlm`` preset) ask one question of a 64x64
picture (a PNG data URI in an OpenAI/TRL image part): the colour of its shapes, their kind, or how many there are.
Each picture holds one to four shapes of one kind and one colour, each filling its own quarter of the picture (four of
the ``smolvlm-135m`` model's 16 image tokens), the quarters filled in reading order (top left first); the answer is
one word. Chance is about 28 %. (Shapes a quarter that size, one image token each, stayed at chance for 300 steps;
quarters filled at random places were counted right 44 % of the time after 360 steps, colours and kinds 100 % and 79 %.)
"""

import base64
import io
import json
import random
from pathlib import Path

FIRST = ["Maria", "John", "Aisha", "Wei", "Olga", "Pedro", "Fatima", "Liam", "Yuki", "Noah", "Elena", "Omar",
         "Sofia", "Ivan", "Amara", "Lucas", "Mei", "Ahmed", "Chloe", "Ravi", "Nina", "Tomas", "Zara", "Hugo",
         "Ingrid", "Kofi", "Lena", "Diego", "Hana", "Felix"]
LAST = ["Lopez", "Smith", "Khan", "Chen", "Petrova", "Silva", "Haddad", "Murphy", "Tanaka", "Brown", "Rossi",
        "Farouk", "Novak", "Ivanov", "Okafor", "Martin", "Wong", "Hassan", "Dubois", "Patel", "Berg", "Horvat",
        "Ali", "Laurent", "Larsen", "Mensah", "Fischer", "Garcia", "Kim", "Weber"]
CITIES = ["Lisbon", "Boston", "Lahore", "Shanghai", "Kyiv", "Recife", "Beirut", "Dublin", "Osaka", "Denver",
          "Milan", "Cairo", "Prague", "Kazan", "Lagos", "Lyon", "Hong Kong", "Dubai", "Marseille", "Pune",
          "Oslo", "Zagreb", "Nairobi", "Toulouse", "Bergen", "Accra", "Munich", "Seville", "Busan", "Vienna"]
JOBS = ["nurse", "teacher", "engineer", "chef", "pilot", "lawyer", "farmer", "dentist", "painter", "plumber",
        "architect", "librarian", "baker", "journalist", "pharmacist", "electrician", "designer", "mechanic"]
# {a_job}: the job with its indefinite article ("a nurse", "an engineer"); the ages (19-78) all take "a".
TEMPLATES = [
    "{name}, {age}, lives in {city} and works as {a_job}.",
    "Meet {name}: a {age}-year-old {job} from {city}.",
    "{name} is {a_job} based in {city}. Age: {age}.",
    "Our new member is {name} ({age}), {a_job} who lives in {city}.",
    "In {city} there is {a_job} called {name}, who is {age} years old.",
    "{name} works as {a_job}, is {age}, and calls {city} home.",
]
INSTRUCTIONS = ["Extract the person as JSON.", "Return this contact as JSON.", "Convert to JSON:"]


def with_article(noun: str) -> str:
    """The noun after its indefinite article (every job here that starts with a vowel letter starts with a vowel
    sound)."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def example(rng: random.Random) -> dict:
    person = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(19, 78),
              "city": rng.choice(CITIES), "job": rng.choice(JOBS)}
    sentence = rng.choice(TEMPLATES).format(**person, a_job=with_article(person["job"]))
    return {"messages": [
        {"role": "user", "content": f"{rng.choice(INSTRUCTIONS)} {sentence}"},
        {"role": "assistant", "content": json.dumps(person)},
    ]}


OUT = Path(__file__).resolve().parent.parent / "hfsdp" / "config" / "presets" / "data"


def splits() -> dict[str, list[dict]]:
    """The rows of each bundled file (contacts_<split>.jsonl), in order."""
    rng = random.Random(1234)
    return {split: [example(rng) for _ in range(count)] for split, count in (("train", 1000), ("eval", 64))}


def preference(row: dict, rng: random.Random) -> dict:
    """A preference pair of a contacts row: its answer chosen, the answer with one field wrong rejected."""
    prompt, answer = row["messages"]
    person = json.loads(answer["content"])
    wrong = dict(person)
    key = rng.choice(["age", "city", "job"])
    if key == "age":
        wrong["age"] = person["age"] + rng.choice([-10, -5, -1, 1, 5, 10])
    else:
        wrong[key] = rng.choice([v for v in (CITIES if key == "city" else JOBS) if v != person[key]])
    return {"prompt": [prompt], "chosen": [answer],
            "rejected": [{"role": "assistant", "content": json.dumps(wrong)}]}


def preference_splits() -> dict[str, list[dict]]:
    """The rows of each preference file (contacts_pref_<split>.jsonl): pairs of the first rows of each split."""
    rng = random.Random(4321)
    return {split: [preference(row, rng) for row in rows[:count]]
            for (split, rows), count in zip(splits().items(), (256, 32))}


# What a GRPO prompt adds to the chat task's user turn: the keys the answer needs. Online RL learns only from
# completions whose rewards differ: without the keys the pretrained model's samples almost never hold one right field
# (a mean json_fields of 0.016 at temperature 1), with them 0.2 (0.66 greedy), which GRPO then raises.
PROMPT_KEYS = ' Answer with one line of JSON with the keys "name", "age" (a number), "city" and "job".'


def prompt_splits() -> dict[str, list[dict]]:
    """The rows of each prompt file (contacts_prompts_<split>.jsonl, for ``data.format: prompt`` and GRPO): the
    first rows' user turn with the keys asked for (``PROMPT_KEYS``) as the prompt and the right JSON as the
    ``answer`` column the json_fields reward reads."""
    return {split: [{"prompt": [{"role": "user", "content": row["messages"][0]["content"] + PROMPT_KEYS}],
                     "answer": row["messages"][-1]["content"]} for row in rows[:count]]
            for (split, rows), count in zip(splits().items(), (256, 64))}


def unpaired_splits() -> dict[str, list[dict]]:
    """The rows of each unpaired file (contacts_unpaired_<split>.jsonl): each preference pair as two rows."""
    return {split: [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                    for p in pairs for side in ("chosen", "rejected")]
            for split, pairs in preference_splits().items()}


# Short: every row's system turn lists it, and the rows' length is the preset's training time.
TOOL = {"type": "function", "function": {
    "name": "lookup_contact", "description": "A contact's age, city and job, by full name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
# (field asked about, question, answer from the record); {name} the person's full name. The eval rows also use
# EVAL_QUESTIONS, which no training row does.
QUESTIONS = [
    ("age", "How old is {name}?", "{name} is {age} years old."),
    ("age", "What is {name}'s age?", "{name} is {age}."),
    ("age", "Can you tell me the age of {name}?", "{name} is {age} years old."),
    ("age", "{name} - how old are they?", "They are {age}."),
    ("city", "Where does {name} live?", "{name} lives in {city}."),
    ("city", "Which city is {name} based in?", "{name} is based in {city}."),
    ("city", "In what city can I find {name}?", "You can find {name} in {city}."),
    ("job", "What does {name} do for a living?", "{name} works as {a_job}."),
    ("job", "What is {name}'s job?", "{name} is {a_job}."),
    ("job", "Look up {name} and tell me their profession.", "{name} is {a_job}."),
    ("all", "Tell me about {name}.", "{name} is {a_job} in {city}, {age} years old."),
    ("all", "Who is {name}?", "{name} is {age}, lives in {city} and works as {a_job}."),
]
EVAL_QUESTIONS = [
    ("age", "Do you know how old {name} is?", "{name} is {age} years old."),
    ("city", "Where is {name} from?", "{name} lives in {city}."),
    ("job", "What kind of work does {name} do?", "{name} works as {a_job}."),
]


def tool_conversation(person: dict, question: tuple[str, str, str], number: int) -> dict:
    """One tool row: the question about ``person``, the lookup call, its result and the answer from it."""
    _, asked, answer = question
    fields = {**person, "a_job": with_article(person["job"])}
    call_id = f"call_{number}"
    return {"messages": [
        {"role": "user", "content": asked.format(**fields)},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": TOOL["function"]["name"], "arguments": {"name": person["name"]}}}]},
        {"role": "tool", "name": TOOL["function"]["name"], "tool_call_id": call_id, "content": json.dumps(person)},
        {"role": "assistant", "content": answer.format(**fields)},
    ], "tools": [TOOL]}


def tool_splits() -> dict[str, list[dict]]:
    """The rows of each tool file (contacts_tools_<split>.jsonl): the contacts of the first rows of each split; the
    eval rows only those whose name no training row has, a quarter of them asked in EVAL_QUESTIONS' words."""
    rng = random.Random(2468)
    people = {split: [json.loads(row["messages"][-1]["content"]) for row in rows] for split, rows in splits().items()}
    train = [tool_conversation(p, rng.choice(QUESTIONS), i) for i, p in enumerate(people["train"][:400])]
    seen = {p["name"] for p in people["train"][:400]}
    held_out = [p for p in people["eval"] if p["name"] not in seen][:32]
    evaluation = [tool_conversation(p, rng.choice(EVAL_QUESTIONS if i % 4 == 3 else QUESTIONS), i)
                  for i, p in enumerate(held_out)]
    return {"train": train, "eval": evaluation}


def tool_preference_splits() -> dict[str, list[dict]]:
    """The tool preference files (contacts_tools_pref_<split>.jsonl): the first tool rows' question as the prompt,
    the right call as chosen and a call with another person's name as rejected, the tools column kept."""
    rng = random.Random(1357)
    out = {}
    for split, rows in tool_splits().items():
        pairs = []
        for row in rows[:{"train": 128, "eval": 16}[split]]:
            call = row["messages"][1]
            wrong = json.loads(json.dumps(call))
            name = call["tool_calls"][0]["function"]["arguments"]["name"]
            wrong["tool_calls"][0]["function"]["arguments"]["name"] = rng.choice(
                [f"{first} {name.split()[1]}" for first in FIRST if first != name.split()[0]])
            pairs.append({"prompt": row["messages"][:1], "chosen": [call], "rejected": [wrong], "tools": row["tools"]})
        out[split] = pairs
    return out


def tool_prompt_splits() -> dict[str, list[dict]]:
    """The tool prompt files (contacts_tools_prompts_<split>.jsonl, for GRPO): each tool row's question with the
    tools, and its call as ``answer`` (what the ``tool_call`` reward compares the completion's first call with)."""
    return {split: [{"prompt": row["messages"][:1], "tools": row["tools"],
                     "answer": {k: row["messages"][1]["tool_calls"][0]["function"][k] for k in ("name", "arguments")}}
                    for row in rows] for split, rows in tool_splits().items()}


def database() -> dict[str, dict]:
    """The contacts database: name -> record, the first record of each name in contacts_train then contacts_eval
    (names repeat with other details; ``hfsdp.builtin.agent.contacts`` reads the files the same way)."""
    out: dict[str, dict] = {}
    for rows in splits().values():
        for row in rows:
            person = json.loads(row["messages"][-1]["content"])
            out.setdefault(person["name"], person)
    return out


def agent_row(person: dict, question: tuple[str, str, str]) -> dict:
    """One agent row: the question, the detail it asks (``field``) and its value in the database (``answer``)."""
    asked, text, _ = question
    return {"prompt": [{"role": "user", "content": text.format(name=person["name"])}], "field": asked,
            "answer": str(person[asked])}


def agent_splits() -> dict[str, list[dict]]:
    """The agent files (contacts_agent_<split>.jsonl): a one-detail question (not "all") about each of 256 people of
    the database for training, and about each of the tool eval rows' 32 held-out people for eval (a quarter in
    EVAL_QUESTIONS' words), whom no training row of either file names."""
    rng = random.Random(97531)
    people = database()
    single = [q for q in QUESTIONS if q[0] != "all"]
    held_out = [json.loads(row["messages"][2]["content"])["name"] for row in tool_splits()["eval"]]
    train_names = [n for n in people if n not in set(held_out)]
    rng.shuffle(train_names)
    train = [agent_row(people[n], rng.choice(single)) for n in train_names[:256]]
    evaluation = [agent_row(people[n], rng.choice(EVAL_QUESTIONS if i % 4 == 3 else single))
                  for i, n in enumerate(held_out)]
    return {"train": train, "eval": evaluation}


COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
SHAPE_QUESTIONS = {
    "colour": ["What colour are the shapes?", "Which colour is used?", "Name the colour of the shapes."],
    "shape": ["What kind of shape is shown?", "Which shape do you see?", "Name the shape in the picture."],
    "count": ["How many shapes are there?", "Count the shapes.", "How many shapes do you see?"],
}
CELL = 32  # 2x2 cells of a 64x64 picture


def picture(colour: str, shape: str, cells: list[int]) -> str:
    """A 64x64 PNG, as a data URI: ``shape`` in ``colour`` in each of ``cells`` (0..3, row by row), grey ground."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (2 * CELL, 2 * CELL), (235, 235, 235))
    draw = ImageDraw.Draw(image)
    for cell in cells:
        x, y = (cell % 2) * CELL + 3, (cell // 2) * CELL + 3
        box = (x, y, x + CELL - 7, y + CELL - 7)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(x + (CELL - 7) / 2, y), (x, y + CELL - 7), (x + CELL - 7, y + CELL - 7)],
                         fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.convert("P", palette=Image.Palette.ADAPTIVE, colors=8).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def shapes_row(rng: random.Random) -> dict:
    colour, shape, count = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.randint(1, 4)
    asked = rng.choice(list(SHAPE_QUESTIONS))
    answer = {"colour": colour, "shape": shape, "count": str(count)}[asked]
    image = picture(colour, shape, list(range(count)))
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": image},
                                     {"type": "text", "text": rng.choice(SHAPE_QUESTIONS[asked])}]},
        {"role": "assistant", "content": answer},
    ]}


def shapes_splits() -> dict[str, list[dict]]:
    rng = random.Random(72)
    return {split: [shapes_row(rng) for _ in range(count)] for split, count in (("train", 1600), ("eval", 96))}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, split_rows in (("contacts", splits()), ("contacts_pref", preference_splits()),
                             ("contacts_prompts", prompt_splits()), ("contacts_unpaired", unpaired_splits()),
                             ("contacts_tools", tool_splits()), ("contacts_tools_pref", tool_preference_splits()),
                             ("contacts_tools_prompts", tool_prompt_splits()), ("contacts_agent", agent_splits()),
                             ("shapes", shapes_splits())):
        for split, rows in split_rows.items():
            with open(OUT / f"{name}_{split}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
