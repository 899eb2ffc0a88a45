"""Vision-language models (issue 72): rows with images as people have them, labels as TRL 1.16 makes them, the
parts frozen, FSDP on 2 gloo ranks as one process, resume and export. Tiny random models of the real architectures
with the real SmolLM2 tokenizer (tests/vlm_models.py)."""

from __future__ import annotations

import copy
import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import CACHE_DIR, RUN_ENV, read_metrics, run_cli, run_torchrun
from vlm_models import ARCHS, colour_pairs, colour_prompts, colour_rows, tiny_vlm_folder

def image(seed: int, width: int = 56, height: int = 56):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def vlm_config(folder: Path, arch: str, rows: Path, **sections) -> Path:
    config = {
        "model": {"name_or_path": str(tiny_vlm_folder(arch, CACHE_DIR))},
        "data": {"format": "chat", "path": str(rows), "max_seq_len": 128},
        "train": {"output_dir": str(folder / "run"), "max_steps": 4, "per_device_batch_size": 2,
                  "learning_rate": 1e-3, "log_every": 1, "seed": 7, "report_to": "none", "loss_plot": False},
        "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD"},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def tokenized(arch: str, rows: list[dict], data_path: str | None = None, template: str | None = None,
              data_format: str = "chat", **data) -> dict[str, list]:
    """hfsdp's ``data_format`` (chat, preference or prompt) on ``rows`` with the tiny ``arch`` model's tokenizer (and
    processor), ``template`` as data.chat_template, ``data`` the data section's other keys."""
    from hfsdp.builtin.chat import tokenize_chat
    from hfsdp.builtin.preference import tokenize_preference
    from hfsdp.builtin.prompt import tokenize_prompt
    from hfsdp.config.schema import DataConfig, ModelConfig
    from hfsdp.model import chat_template, loading

    path = str(tiny_vlm_folder(arch, CACHE_DIR))
    tokenizer = loading.load_tokenizer(path, ModelConfig(name_or_path=path))
    chat_template.use(tokenizer, template)
    batch = {k: [r.get(k) for r in rows] for k in rows[0]}
    tokenize = {"chat": tokenize_chat, "preference": tokenize_preference, "prompt": tokenize_prompt}[data_format]
    return tokenize(batch, tokenizer, DataConfig(format=data_format, path=data_path or "rows.jsonl", **data))


TRL_ROWS = [
    {"images": [0], "messages": [{"role": "user", "content": "What is this?"},
                                 {"role": "assistant", "content": "A cat."}]},
    {"images": [1, 2], "messages": [{"role": "user", "content": "Compare them."},
                                    {"role": "assistant", "content": "Same."},
                                    {"role": "user", "content": "Sure?"},
                                    {"role": "assistant", "content": "Yes."}]},
]


@pytest.mark.parametrize("arch", ARCHS)
def test_labels_and_pixels_equal_trl_vision_collation(arch):
    """TRL 1.16's DataCollatorForVisionLanguageModeling with assistant_only_loss (its training template) on the same
    rows and processor: the same tokens, the same labels (the assistant's tokens only: never an image, vision
    marker or padding token), the same pixel inputs."""
    from transformers import AutoProcessor
    from trl.chat_template_utils import get_training_chat_template
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from hfsdp.data.batches import collate
    from hfsdp.data.images import PixelInputs
    from hfsdp.model import vision

    vision.images_only_processors()
    sizes = {0: (56, 56), 1: (56, 56), 2: (48, 64)}
    rows = [{**r, "images": [image(k, *sizes[k]) for k in r["images"]]} for r in TRL_ROWS]
    processor = AutoProcessor.from_pretrained(str(tiny_vlm_folder(arch, CACHE_DIR)))
    collator = DataCollatorForVisionLanguageModeling(processor=processor, assistant_only_loss=True,
                                                     chat_template=get_training_chat_template(processor))
    theirs = collator(copy.deepcopy(rows))
    # (Qwen3.5's template drops earlier turns' empty thinking once later turns follow: hfsdp refuses to mask it and
    # names its training version, which TRL renders with too)
    ours = tokenized(arch, rows, template="qwen3_5_nothink_training" if arch == "qwen3_5" else None)
    batch = collate([{k: ours[k][i] for k in ours} for i in range(len(rows))], processor.tokenizer.pad_token_id)
    assert torch.equal(batch["input_ids"], theirs["input_ids"])
    assert torch.equal(batch["labels"], theirs["labels"])
    assert (batch["labels"] != -100).sum() > 0
    forward = set(theirs) - {"input_ids", "attention_mask", "labels"}
    pixels = PixelInputs(processor, forward)([{"images": ours["images"][i]} for i in range(len(rows))])
    assert set(pixels) == {k for k in forward if k not in ("token_type_ids", "mm_token_type_ids")}
    for key, value in pixels.items():
        assert torch.equal(value, theirs[key]), key


TRL_PAIRS = [
    {"images": [0], "prompt": [{"role": "user", "content": "What is this?"}],
     "chosen": [{"role": "assistant", "content": "A cat."}], "rejected": [{"role": "assistant", "content": "A dog."}]},
    {"images": [1, 2], "prompt": [{"role": "user", "content": "Compare them."}],
     "chosen": [{"role": "assistant", "content": "They are the same."}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]


@pytest.mark.parametrize("arch", ARCHS)
def test_preference_pairs_equal_trl_vision_preference_collation(arch):
    """TRL 1.16's DataCollatorForVisionPreference (DPOTrainer's for a processor) on the same rows and processor:
    each chosen and rejected sequence has the same tokens, the same completion tokens (the only ones hfsdp labels:
    never an image or prompt token), the same per-token inputs, and the pair's micro-batch the same pixel inputs
    (the prompt's images for both sequences)."""
    from transformers import AutoProcessor
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from hfsdp.data.images import PixelInputs
    from hfsdp.model import vision
    from hfsdp.objective import MicroBatchLayout, PreferenceObjective

    vision.images_only_processors()
    sizes = {0: (56, 56), 1: (56, 56), 2: (48, 64)}
    rows = [{**r, "images": [image(k, *sizes[k]) for k in r["images"]]} for r in TRL_PAIRS]
    processor = AutoProcessor.from_pretrained(str(tiny_vlm_folder(arch, CACHE_DIR)))
    theirs = DataCollatorForVisionPreference(processor=processor)(copy.deepcopy(rows))
    ours = tokenized(arch, rows, data_format="preference")
    pairs = [{k: ours[k][i] for k in ours} for i in range(len(rows))]
    sequences = [(p["input_ids"], p["labels"], p) for p in pairs] + \
        [(p["rejected_input_ids"], p["rejected_labels"], {k[len("rejected_"):]: v for k, v in p.items()
                                                          if k.startswith("rejected_")}) for p in pairs]
    per_token = {"token_type_ids", "mm_token_type_ids"} & set(theirs)
    for i, (ids, labels, columns) in enumerate(sequences):
        real = theirs["attention_mask"][i].bool()
        assert theirs["input_ids"][i][real].tolist() == ids, i
        assert theirs["completion_mask"][i][real].tolist() == [int(label != -100) for label in labels], i
        for key in per_token:
            assert theirs[key][i][real].tolist() == columns[key], (i, key)
    assert sum(label != -100 for label in pairs[0]["labels"]) > 0
    forward = set(theirs) - {"input_ids", "attention_mask", "completion_mask", *per_token}
    objective = PreferenceObjective()
    objective.lay_out(MicroBatchLayout(images=PixelInputs(processor, forward)))
    batch = objective.micro_batch(pairs, processor.tokenizer.pad_token_id, torch.device("cpu"), False)
    assert set(forward) <= set(batch.inputs)
    for key in forward:
        assert torch.equal(batch.inputs[key], theirs[key]), key


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_completions_of_image_prompts_are_scored_by_the_training_forward_as_sampled(arch):
    """GRPO's sampler on prompts with images (left-padded to a width wider than every prompt, two images of
    different sizes, a group of two completions each): each drawn token's log-prob under the sampler equals the one
    the training forward of the prompt and completion gives it (its pixel inputs, per-token inputs and, for Qwen's
    3-D rope, the positions the model lays out itself): the completions GRPO trains on are scored where they were
    sampled. A completion depends on its own prompt and generator only: sampled alone, it is the same."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hfsdp.builtin.grpo.schema import GrpoSection
    from hfsdp.builtin.online.rounds import prompt_completion_batch, token_logps
    from hfsdp.builtin.online.sampling import sample
    from hfsdp.data.images import PixelInputs
    from hfsdp.model import vision
    from hfsdp.model.loading import forward_arguments

    vision.images_only_processors()
    folder = str(tiny_vlm_folder(arch, CACHE_DIR))
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    rows = [{"prompt": [{"role": "user", "content": "What is this?"}], "images": [image(0, 56, 56)]},
            {"prompt": [{"role": "user", "content": "And this one, here?"}], "images": [image(1, 48, 64)]}]
    prompt_rows = tokenized(arch, rows, data_format="prompt")
    visual = [{k: prompt_rows[k][i] for k in prompt_rows} for i in range(2) for _ in range(2)]
    prompts = [row["input_ids"] for row in visual]
    section = GrpoSection(rewards=[{"name": "m:f"}], max_new_tokens=5, temperature=0.9, top_k=20)
    pad, eos = processor.tokenizer.pad_token_id, [processor.tokenizer.eos_token_id]
    pixels = PixelInputs(processor, forward_arguments(model))
    width = max(map(len, prompts)) + 3
    completions, drawn = sample(model, model, prompts, [11, 12, 13, 14], pad, width, section, eos, gather=False,
                                synced=False, logps=True, visual=visual, pixels=pixels)
    assert all(completions) and len({tuple(c) for c in completions}) > 1
    batch = prompt_completion_batch(prompts, completions, pad, "cpu", False, visual=visual,
                                    mrope=vision.uses_mrope(model.config))
    batch.inputs.update(pixels(visual))
    with torch.no_grad():
        trained, _ = token_logps(model, batch, section.temperature)
    mask = batch.sequence_targets != -100
    for i, row in enumerate(drawn):
        assert trained[i][mask[i]].tolist() == pytest.approx(row, abs=2e-5), i
    alone = sample(model, model, prompts[3:], [14], pad, width, section, eos, gather=False, synced=False,
                   visual=visual[3:], pixels=pixels)
    assert alone == completions[3:]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_micro_batch_without_images_runs_the_tower_on_the_placeholder_leaving_the_loss_as_it_was(arch):
    """Where the run's rows have images, a micro-batch of text-only rows carries the placeholder image's pixel
    inputs: the forward runs the tower and projector on it and gives the logits it gives without (0 times the
    features), and the backward reaches the same parameters of the tower and projector as a micro-batch with a real
    image does, each with a zero gradient (without the placeholder: none), so that FSDP's ranks gather and reduce
    the same units whatever their micro-batches hold."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hfsdp.data.images import TOWER_PLACEHOLDER, PixelInputs
    from hfsdp.model import vision
    from hfsdp.model.loading import forward_arguments
    from hfsdp.objective import MicroBatchLayout, Objective

    vision.images_only_processors()
    folder = str(tiny_vlm_folder(arch, CACHE_DIR))
    processor = AutoProcessor.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    vision.TowerTouch(model, forward_arguments(model))
    columns = tokenized(arch, [{"images": [], "messages": [{"role": "user", "content": "Name a colour."},
                                                           {"role": "assistant", "content": "Blue."}]},
                               {"images": [image(0, 56, 56)], "messages": [
                                   {"role": "user", "content": "<image>What is this?"},
                                   {"role": "assistant", "content": "A square."}]}])
    text_row, image_row = ({k: v[i] for k, v in columns.items()} for i in range(2))
    objective = Objective()
    pad = processor.tokenizer.pad_token_id

    def backward(rows, touch_tower):
        objective.lay_out(MicroBatchLayout(images=PixelInputs(processor, forward_arguments(model), touch_tower)))
        batch = objective.micro_batch(rows, pad, "cpu", False)
        assert (TOWER_PLACEHOLDER in batch.inputs) == (touch_tower and not any(r["images"] for r in rows))
        model.zero_grad(set_to_none=True)
        logits = model(**batch.inputs).logits
        logits.float().square().mean().backward()
        reached = {n: p.grad for n, p in model.named_parameters() if vision.part_of(n) != "language"
                   and p.grad is not None}
        return logits.detach(), reached

    plain, untouched = backward([text_row], False)
    touched, zeros = backward([text_row], True)
    _, seen = backward([image_row], True)
    assert torch.equal(touched, plain)
    assert not untouched and zeros.keys() == seen.keys() and seen
    assert all(not grad.any() for grad in zeros.values())
    assert any(grad.any() for grad in seen.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_plan_counts_what_the_vision_tower_saves_for_a_real_image_to_the_byte(arch):
    """hfsdp plan traces the vision tower and projector on fake tensors (the meta device cannot read an image's
    layout): for a micro-batch of 2 rows whose real images make N image tokens each, the plan's tower saves, for N
    image tokens a row, the bytes the real tower saves for the backward on the processor's pixel inputs of those
    images (eager attention both, which keeps the scores), on images that make the micro-batch's image tokens;
    nothing with the tower and projector frozen."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.data.images import PixelInputs
    from hfsdp.hooks.host import PluginHost
    from hfsdp.model import vision
    from hfsdp.model.loading import architecture_config, forward_arguments
    from hfsdp.objective import MicroBatchLayout, Objective
    from hfsdp.tools.plan.trace import trace_activations

    vision.images_only_processors()
    folder = str(tiny_vlm_folder(arch, CACHE_DIR))
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").train()
    columns = tokenized(arch, [{"images": [image(seed, 112, 56)], "messages": [
        {"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A square."}]}
        for seed in range(2)])
    objective = Objective()
    objective.lay_out(MicroBatchLayout(images=PixelInputs(processor, forward_arguments(model))))
    batch = objective.micro_batch([{k: v[i] for k, v in columns.items()} for i in range(2)],
                                  processor.tokenizer.pad_token_id, "cpu", False)
    image_token = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    tokens = int((batch.inputs["input_ids"][0] == image_token).sum())  # a row's
    params, saved = {id(p) for p in model.parameters()}, {}

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) not in params and id(t) not in params:
            saved[id(base)] = (base, base.numel() * base.element_size())
        return t

    takes = set(inspect.signature(model.get_image_features).parameters)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        features = model.get_image_features(**{k: v for k, v in batch.inputs.items() if k in takes})
    assert features.pooler_output is not None
    real = sum(n for _, n in saved.values())

    def planned(freeze):
        config = HfsdpConfig.model_validate({
            "model": {"name_or_path": folder, "attn_implementation": "eager", "freeze": freeze},
            "data": {"format": "chat", "path": "rows.jsonl", "max_seq_len": 64},
            "train": {"output_dir": "run", "max_steps": 1, "per_device_batch_size": 2}})
        return trace_activations(architecture_config(folder, config.model, None), config, PluginHost([]), "no",
                                 image_tokens=tokens).images

    images = planned([])
    assert images.saved == real and real > 0
    assert images.count * images.tokens == 2 * tokens
    assert planned(["vision", "projector"]).saved == 0


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "smolvlm"])
def test_every_row_shape_gives_the_same_tokens(tmp_path, arch):
    """Content parts naming their image, LLaMA-Factory's <image> placeholders with an images column, and TRL's images
    column beside plain texts: the same tokens, labels and image bytes (paths read from the data file's folder)."""
    out = {}
    for shape in ("parts", "placeholders", "column"):
        path = colour_rows(tmp_path, 3, shape)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[shape] = tokenized(arch, rows, str(path))
    assert out["parts"] == out["placeholders"] == out["column"]
    assert out["parts"]["images"][0] == [(tmp_path / "img" / "0-0.png").read_bytes()]


def rows_refused(config: Path) -> str:
    """The error with which the row check of ``hfsdp validate`` (:func:`hfsdp.data.prepare.check_rows`) refuses
    ``config``'s rows, in this process (a CLI's start-up with the processor costs about 12 s; the prompt format's
    tests below and test_image_rows_on_a_text_only_model_are_refused run the CLI)."""
    from hfsdp.config.files import validated_config
    from hfsdp.data.prepare import check_rows
    from hfsdp.errors import UserError
    from hfsdp.model import loading

    cfg, host, _ = validated_config(str(config), ())
    with pytest.raises(UserError) as refused:
        check_rows(cfg, host, loading.load_tokenizer(cfg.model.name_or_path, cfg.model))
    return str(refused.value)


@pytest.mark.parametrize("row, said", [
    ({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}],
      "images": ["img/missing.png"]}, "no file"),
    ({"messages": [{"role": "user", "content": "<image><image>What?"}, {"role": "assistant", "content": "A."}],
      "images": ["img/0-0.png"]}, "more <image> placeholders than the row has images (1 in its images column)"),
    ({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}],
      "images": ["broken.png"]}, "cannot be read as an image"),
    ({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}],
      "images": ["img/0-0.png", "img/0-1.png"]}, "2 images in its images column and 1 placeholders"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]},
                   {"role": "assistant", "content": "A."}]}, "of type 'video'"),
])
def test_a_bad_image_row_is_named_by_hfsdp_validate(tmp_path, row, said):
    """A missing file, a file that is no image, more placeholders than images, images without placeholders among
    placeholders, a video part: hfsdp validate names the row (its line) and what to fix, before anything trains."""
    good = colour_rows(tmp_path, 4, "placeholders")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    lines = good.read_text().splitlines()
    lines[2] = json.dumps(row)
    good.write_text("\n".join(lines) + "\n")
    config = vlm_config(tmp_path, "qwen2_5_vl", good)
    message = rows_refused(config)
    assert "line 3 of" in message and said in message, message


@pytest.mark.parametrize("row, said", [
    ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "img/pair-0-0.png"}]}],
      "chosen": [{"role": "assistant", "content": "Red."}],
      "rejected": [{"role": "user", "content": [{"type": "image", "image": "img/pair-0-1.png"}]}]},
     "a completion shows 1 image(s): images go in the prompt"),
    ({"prompt": "What colour is this?", "chosen": "Red.", "rejected": "Blue.", "images": ["img/pair-0-0.png"]},
     "has images and a text prompt: give the prompt as a list of messages"),
    ({"prompt": [{"role": "user", "content": "<image>What?"}], "chosen": [{"role": "assistant", "content": "Red."}],
      "rejected": [{"role": "assistant", "content": "Blue."}], "images": ["img/missing.png"]}, "no file"),
])
def test_a_bad_preference_row_with_images_is_named_by_hfsdp_validate(tmp_path, row, said):
    """A completion that shows an image, images beside a text prompt, a missing image: hfsdp validate names the
    pair (its line) and what to fix."""
    good = colour_pairs(tmp_path, 4)
    lines = good.read_text().splitlines()
    lines[1] = json.dumps(row)
    good.write_text("\n".join(lines) + "\n")
    config = vlm_config(tmp_path, "qwen2_5_vl", good, plugins=["dpo"], data={"format": "preference"})
    message = rows_refused(config)
    assert "line 2 of" in message and said in message, message


@pytest.mark.parametrize("row, said", [
    ({"prompt": "What colour is this?", "answer": "red", "images": ["img/0-0.png"]},
     "has images and a text prompt: give the prompt as a list of messages"),
    ({"prompt": [{"role": "user", "content": "<image>What?"}], "answer": "red", "images": ["img/missing.png"]},
     "no file"),
])
def test_a_bad_prompt_row_with_images_is_named_by_hfsdp_validate(tmp_path, row, said):
    good = colour_prompts(tmp_path, 4)
    lines = good.read_text().splitlines()
    lines[1] = json.dumps(row)
    good.write_text("\n".join(lines) + "\n")
    config = vlm_config(tmp_path, "qwen2_5_vl", good, plugins=["grpo"], data={"format": "prompt"},
                        grpo={"num_generations": 2, "rewards": [{"name": "grpo_test_rewards:image_letters"}]})
    proc = run_cli("validate", str(config), check=False, env=RUN_ENV)
    assert proc.returncode != 0
    assert "line 2 of" in proc.stdout + proc.stderr and said in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_image_max_pixels_scales_a_large_image_down_before_the_processor_expands_it(tmp_path):
    """``data.image_max_pixels`` (LLaMA-Factory's): a 112x112 image, which the tiny Qwen2.5-VL's processor expands
    to 16 image tokens, is scaled down to 56x56 (3136 pixels) and expands to 4; the row's tokens and the
    micro-batch's pixel inputs are those of the image scaled down by hand; an image within the limit is kept as it
    is. On a text-only model the setting is refused before any weight loads."""
    from PIL import Image
    from transformers import AutoProcessor

    from hfsdp.data.images import PixelInputs

    def rows(first):
        return [{"images": [first], "messages": [{"role": "user", "content": "<image>What is this?"},
                                                 {"role": "assistant", "content": "A square."}]},
                {"images": [image(1, 40, 48)], "messages": [{"role": "user", "content": "<image>And this?"},
                                                            {"role": "assistant", "content": "A dot."}]}]

    large = image(0, 112, 112)
    whole = tokenized("qwen2_5_vl", rows(large))
    fitted = tokenized("qwen2_5_vl", rows(large), image_max_pixels=3136)
    by_hand = tokenized("qwen2_5_vl", rows(large.resize((56, 56), Image.Resampling.BICUBIC)))
    processor = AutoProcessor.from_pretrained(str(tiny_vlm_folder("qwen2_5_vl", CACHE_DIR)))
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [ids.count(pad) for ids in whole["input_ids"]] == [16, 2]  # (40x48: 2 merged patches)
    assert [ids.count(pad) for ids in fitted["input_ids"]] == [4, 2]
    assert fitted["input_ids"] == by_hand["input_ids"] and fitted["labels"] == by_hand["labels"]
    assert fitted["images"][1] == whole["images"][1]
    pixels = PixelInputs(processor, ["pixel_values", "image_grid_thw"])
    made, expected = ([{"images": column[i]} for i in range(2)] for column in (fitted["images"], by_hand["images"]))
    assert all(torch.equal(a, b) for a, b in zip(pixels(made).values(), pixels(expected).values()))

    data = colour_rows(tmp_path, 4)
    config = vlm_config(tmp_path, "qwen2_5_vl", data, model={"name_or_path": "smollm2-tiny"},
                        data={"format": "text", "path": str(data), "image_max_pixels": 3136})
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert "data.image_max_pixels: llama is a text-only model, which reads no image" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr


def test_image_rows_on_a_text_only_model_are_refused(tmp_path):
    data = colour_rows(tmp_path, 4, "placeholders")
    config = vlm_config(tmp_path, "qwen2_5_vl", data, model={"name_or_path": "smollm2-tiny"})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode != 0
    assert "the model is text-only: train a vision-language model" in proc.stdout + proc.stderr


@pytest.mark.parametrize("sections, key, said", [
    ({"plugins": ["packing"]}, "plugins", "without packing so far"),
    ({"plugins": ["orpo"], "data": {"format": "preference"}}, "plugins", "not with orpo"),
    ({"model": {"freeze": ["vision", "projector", "language"]}}, "model.freeze", "nothing would learn"),
])
def test_what_vision_language_training_does_not_take_yet_is_refused(tmp_path, sections, key, said):
    """Refused by train before any weight loads."""
    data = colour_rows(tmp_path, 4)
    config = vlm_config(tmp_path, "qwen2_5_vl", data, **sections)
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert key in proc.stdout + proc.stderr and said in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


def test_freeze_on_a_text_only_model_is_refused(tmp_path):
    data = colour_rows(tmp_path, 4)
    config = vlm_config(tmp_path, "qwen2_5_vl", data, model={"name_or_path": "smollm2-tiny", "freeze": ["vision"]})
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode != 0 and "is a text-only model: model.freeze names parts" in proc.stdout + proc.stderr


def test_each_part_is_its_own_fsdp_unit_and_freezing_is_by_part():
    """The wrap classes of Qwen2.5-VL and SmolVLM: each part's blocks, the projector and the tower, never a class
    that holds two parts; freezing the tower leaves the projector and the language model trainable."""
    from hfsdp.model import loading, vision
    from hfsdp.model.loading import load_model_config
    from hfsdp.config.schema import ModelConfig

    for arch, expected in (("qwen2_5_vl", {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock", "Qwen2_5_VLPatchMerger",
                                           "Qwen2_5_VisionTransformerPretrainedModel"}),
                           ("smolvlm", {"LlamaDecoderLayer", "SmolVLMEncoderLayer", "SmolVLMConnector",
                                        "SmolVLMVisionTransformer"})):
        path = str(tiny_vlm_folder(arch, CACHE_DIR))
        model_config = load_model_config(path, ModelConfig(name_or_path=path))
        assert set(loading.default_layer_classes(model_config)) == expected
        model = loading.meta_model(model_config, cfg=ModelConfig(name_or_path=path, freeze=["vision"]))
        parts = {vision.part_of(n): p.requires_grad for n, p in model.named_parameters()}
        assert parts == {"vision": False, "projector": True, "language": True}
        trainable = {vision.part_of(n) for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {"projector", "language"}


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


DPO = {"plugins": ["dpo"], "data": {"format": "preference"}}
# GRPO on prompts with images: 2 completions a prompt, a round kept for 2 steps, a reward that reads the images
GRPO = {"plugins": ["grpo"], "data": {"format": "prompt"},
        "grpo": {"num_generations": 2, "max_new_tokens": 4, "num_iterations": 2,
                 "rewards": [{"name": "grpo_test_rewards:image_letters"}]}}
# (name, arch, sections, in CI: on 2 ranks; every case on 2 and 4 ranks with --full-matrix); a "mixed" case's
# rows are every other one text-only (a micro-batch without images runs the tower on the placeholder)
RANKS_CASES = [
    ("qwen2_5_vl", "qwen2_5_vl", {"model": {"freeze": ["vision"]}}, False),
    ("qwen2_5_vl-mixed", "qwen2_5_vl", {}, True),
    ("smolvlm-lora", "smolvlm", {"fsdp": {"version": 1}, "plugins": ["lora"], "lora": {"r": 4},
                                 "model": {"freeze": ["vision"]}}, False),
    ("smolvlm-lora-mixed", "smolvlm", {"fsdp": {"version": 1}, "plugins": ["lora"], "lora": {"r": 4}}, False),
    ("qwen2_5_vl-dpo-mixed", "qwen2_5_vl", {**DPO, "model": {"freeze": ["vision"]}}, True),
    ("smolvlm-lora-dpo", "smolvlm", {**DPO, "fsdp": {"version": 1}, "plugins": ["lora", "dpo"], "lora": {"r": 4},
                                     "dpo": {"reference": "adapter"}}, False),
    ("qwen2_5_vl-grpo-mixed", "qwen2_5_vl", {**GRPO, "model": {"freeze": ["vision"]},
                                              "fsdp": {"gather_for_generation": False}}, True),
    ("smolvlm-lora-grpo", "smolvlm", {**GRPO, "fsdp": {"version": 1}, "plugins": ["lora", "grpo"], "lora": {"r": 4},
                                      "grpo": {**GRPO["grpo"], "beta": 0.04}}, False),
]


def pytest_generate_tests(metafunc):
    """CI trains its cases on 2 ranks; ``pytest --full-matrix`` every case on 2 and 4 ranks (4 processes on CI's 2
    cores)."""
    if "world" in metafunc.fixturenames:
        full = metafunc.config.getoption("full_matrix")
        cases = [(name, arch, sections, name.endswith("-mixed"), world) for world in ((2, 4) if full else (2,))
                 for name, arch, sections, in_ci in RANKS_CASES if full or in_ci]
        metafunc.parametrize("arch, sections, mixed, world", [c[1:] for c in cases],
                             ids=[f"{c[0]}-x{c[4]}" for c in cases])


@pytest.mark.slow
def test_ranks_train_as_one_process_resume_and_export(tmp_path, arch, sections, mixed, world):
    """FSDP on 2 (and 4) gloo ranks against one process accumulating the same micro-batches (Qwen2.5-VL full
    fine-tune under FSDP2; SmolVLM with LoRA on the language model under FSDP1), supervised, DPO (the pairs' images
    through both sequences and the reference) and GRPO: the same losses and gradient norms over 4 steps; a resume
    from step 2 ends bit for bit where the run did; the export reloads with the model's class and processor, a
    frozen tower byte-identical to the input. Rows with and without images in one split (``mixed``): a rank whose
    micro-batch (or sampled prompts, with FSDP2 gathering unit by unit) has no image runs the tower on the
    placeholder while another rank's runs it on images (without it gloo aborted on a collective mismatch); a
    trained tower learns from the image rows only."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hfsdp.model import vision
    from test_combinations import assert_resumed_exactly, resume_from

    plugins = sections.get("plugins", [])
    data = (colour_pairs if "dpo" in plugins else colour_prompts if "grpo" in plugins else colour_rows)(
        tmp_path, 12 * world, text_every=2 if mixed else 0)
    one = vlm_config(tmp_path / "one", arch, data, train={"gradient_accumulation_steps": world,
                                                         "output_dir": str(tmp_path / "one" / "run")}, **sections)
    two = vlm_config(tmp_path / "two", arch, data, train={"output_dir": str(tmp_path / "two" / "run"),
                                                         "save_every": 2}, **sections)
    run_cli("train", str(one), env=RUN_ENV)
    proc = run_torchrun(world, "train", str(two), env=RUN_ENV)
    shown = 6 * world if mixed else 12 * world  # the data report counts the rows with images
    assert re.search(rf"data: train {12 * world} rows \([^)]*, {shown} with images\)", proc.stdout), proc.stdout
    if "freeze" in sections.get("model", {}):
        assert re.search(r"model\.freeze vision: [\d,]+ of [\d,]+ parameters frozen", proc.stdout), proc.stdout
    single, ranks = steps(tmp_path / "one" / "run"), steps(tmp_path / "two" / "run")
    assert single.keys() == ranks.keys() == {1, 2, 3, 4}
    for step in single:
        for key in ("loss", "grad_norm"):
            assert ranks[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
    if not {"dpo", "grpo"} & set(plugins):  # (DPO's 4 steps on a random model: ln 2 at step 1, then noise)
        assert single[4]["loss"] < single[1]["loss"]
    if "grpo" in plugins:  # the rounds' rewards (of the images' brightness) and completions were the same
        for step in single:
            assert ranks[step]["reward"] == pytest.approx(single[step]["reward"], rel=1e-6), step
        assert any(m["grad_norm"] > 0 for m in single.values())
    assert_resumed_exactly(resume_from(tmp_path / "resumed", tmp_path / "two" / "run", world, step=2),
                           tmp_path / "two" / "run")
    vision.images_only_processors()
    if "lora" in sections.get("plugins", []):
        return  # (the adapter's export: tests/test_lora.py; a merged VLM export is the full fine-tune's path)
    final = tmp_path / "two" / "run" / "final"
    model = AutoModelForImageTextToText.from_pretrained(str(final))
    AutoProcessor.from_pretrained(str(final))
    source = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_folder(arch, CACHE_DIR)))
    trained = dict(model.named_parameters())
    tower = [name for name, _ in source.named_parameters() if vision.part_of(name) == "vision"]
    frozen = "vision" in sections.get("model", {}).get("freeze", [])
    assert all(torch.equal(source.get_parameter(n), trained[n]) for n in tower) == frozen
    assert any(not torch.equal(p, trained[n]) for n, p in source.named_parameters() if vision.part_of(n) == "language")


def test_the_preprocessing_cache_is_keyed_by_the_image_processor():
    """The image processor decides how many tokens each image expands to (the cached rows): a change of its sizes
    (Qwen's max_pixels, say) is another cache entry, never the rows of the old one."""
    from hfsdp.config.schema import DataConfig, ModelConfig
    from hfsdp.data.cache import cache_key
    from hfsdp.data.images import processor_of
    from hfsdp.model import loading

    path = str(tiny_vlm_folder("qwen2_5_vl", CACHE_DIR))
    tokenizer = loading.load_tokenizer(path, ModelConfig(name_or_path=path))
    data = DataConfig(format="chat", path="rows.jsonl")
    before = cache_key(["rows"], tokenizer, data, "chat")
    assert cache_key(["rows"], tokenizer, data, "chat") == before
    image_processor = processor_of(tokenizer).image_processor
    image_processor.size = {"shortest_edge": image_processor.size["shortest_edge"],
                            "longest_edge": image_processor.size["longest_edge"] * 4}
    assert cache_key(["rows"], tokenizer, data, "chat") != before


def test_model_freeze_enters_the_run_fingerprint_only_when_set():
    """model.freeze joined the schema after checkpoints began recording the fingerprint: unset, a checkpoint written
    before it keeps its fingerprint (tests/test_decisions.py); set, the run differs from one that trained every part."""
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.setup.record import run_fingerprint

    base = {"model": {"name_or_path": "smollm2-tiny"}, "data": {"path": "x.jsonl"},
            "train": {"output_dir": "run", "max_steps": 4}}
    frozen = {**base, "model": {**base["model"], "freeze": ["vision"]}}
    assert run_fingerprint(HfsdpConfig.model_validate(frozen)) != run_fingerprint(HfsdpConfig.model_validate(base))


@pytest.mark.slow
def test_gemma3_with_checkpointing_and_bf16_on_two_ranks_exports_its_tied_head_once(tmp_path):
    """Gemma 3 (its output head tied to the embedding, saved under transformers' language_model. names) on 2 FSDP2
    ranks with activation checkpointing (each part's units recomputed) and bf16 compute: it trains, and the export
    writes the tied head once and reloads with it tied, its tower as it was loaded."""
    from transformers import AutoModelForImageTextToText

    from hfsdp.model import vision

    data = colour_rows(tmp_path, 16)
    config = vlm_config(tmp_path, "gemma3", data, model={"freeze": ["vision"]}, train={"max_steps": 3},
                        fsdp={"activation_checkpointing": True, "mixed_precision": "bf16"})
    run_torchrun(2, "train", str(config))
    metrics = steps(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3] and all(m["loss"] == m["loss"] for m in metrics.values())
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "run" / "final"))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    source = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_folder("gemma3", CACHE_DIR)))
    trained = dict(model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in source.named_parameters() if vision.part_of(n) == "vision")


def test_bf16_compute_is_refused_where_transformers_casts_image_features_to_the_stored_dtype(tmp_path):
    """SmolVLM (and Idefics2/3) cast the image features to the dtype the weights are stored in: under FSDP's mixed
    precision that is not the text's, and transformers' merge fails at the first step. Refused before any weight
    loads, with the configuration that runs."""
    data = colour_rows(tmp_path, 4)
    config = vlm_config(tmp_path, "smolvlm", data, fsdp={"mixed_precision": "bf16"})
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode != 0 and "Loading weights" not in proc.stderr
    assert ("fsdp.mixed_precision: bfloat16 with weights stored in float32: transformers' smolvlm casts the image "
            "features") in proc.stdout + proc.stderr
    assert "(model.dtype: bfloat16, fsdp.mixed_precision: no)" in proc.stdout + proc.stderr


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "smolvlm", "gemma3", "llava"])
def test_generation_eval_answers_as_transformers_generates_from_the_processors_own_inputs(arch):
    """Generation eval on image rows: each prompt, batched with another whose image differs in size (left padding),
    gets the greedy answer that transformers generates from the processor's own apply_chat_template of that row
    alone; the images a split returns are the ones before the answered turn."""
    from transformers import AutoModelForImageTextToText

    from hfsdp.builtin.chat import generation_prompt
    from hfsdp.config.schema import DataConfig, ModelConfig
    from hfsdp.model import chat_template, loading
    from hfsdp.run.generation import GenerationItem, generate_eval

    path = str(tiny_vlm_folder(arch, CACHE_DIR))
    tokenizer = loading.load_tokenizer(path, ModelConfig(name_or_path=path))
    chat_template.use(tokenizer, None)
    processor = getattr(tokenizer, "hfsdp_processor")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    pictures = [image(3, 56, 56), image(4, 48, 64), image(5, 64, 64)]
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": pictures[0]},
                                                   {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": "A cat."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": pictures[1]},
                                                   {"type": "text", "text": "And this?"}]},
                      {"role": "assistant", "content": "A dog."},
                      {"role": "user", "content": [{"type": "image", "image": pictures[2]},
                                                   {"type": "text", "text": "Now?"}]},
                      {"role": "assistant", "content": "A bird."}]},
    ]
    data_config = DataConfig(format="chat", path="rows.jsonl")
    items = [GenerationItem(*generation_prompt(copy.deepcopy(row), data_config, tokenizer)) for row in rows]
    assert [len(item.images) for item in items] == [1, 2]
    assert [item.reference for item in items] == ["A cat.", "A bird."]
    assert [item.shown for item in items] == ["[image] What is this?", "[image] Now?"]
    ours = generate_eval(model, model, tokenizer, items, max_new_tokens=6)
    theirs = []
    for row in rows:
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], list)
                     else [{"type": "text", "text": m["content"]}]} for m in row["messages"][:-1]]
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        theirs.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    assert [generated for _, _, generated in ours.examples] == theirs
    assert all(theirs)



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("freeze", [[], ["vision"]])
def test_lora_adapts_every_vision_language_architecture_by_default(arch, freeze):
    """LoRA's default targets (every Linear of the wrapped blocks) on each tiny architecture, whole or with its
    tower frozen: peft builds the adapters (Qwen2.5-VL's projector is a Sequential whose Linears are named 0 and 2,
    which peft took for every module named so, decoder layers included) and no frozen part gets one."""
    from hfsdp.builtin.lora import _meta_adapted
    from hfsdp.config.files import validate_raw
    from hfsdp.model import loading, vision

    path = str(tiny_vlm_folder(arch, CACHE_DIR))
    config, _, problems = validate_raw({"model": {"name_or_path": path, "freeze": freeze}, "plugins": ["lora"],
                                        "data": {"path": "rows.jsonl", "format": "chat"},
                                        "train": {"output_dir": "run", "max_steps": 1}}, "test")
    assert not problems
    model = _meta_adapted(loading.load_model_config(path, config.model), config, config.section("lora"))
    adapted_parts = {vision.part_of(name) for name, p in model.named_parameters() if "lora_" in name}
    assert "language" in adapted_parts and not adapted_parts & set(freeze)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_a_text_fine_tune_of_a_vision_language_model_resumes_exactly(tmp_path, version):
    """Text rows on a vision-language model (a text fine-tune of Qwen3.5, which loads its VLM class), rendered by a
    text template (chatml_tools: it adds contents as texts, so the rows are given to it as texts): the projector
    never gets a gradient, so the optimizer holds no state for it; a resume from step 2 leaves it so and ends bit for
    bit where the run did (the load had looked for its state: "Missing key in checkpoint state_dict"); the export's
    processor carries the template the run trained with."""
    from conftest import PRESET_DATA
    from test_combinations import assert_resumed_exactly, resume_from

    rows = tmp_path / "text.jsonl"
    rows.write_text("".join((PRESET_DATA / "contacts_train.jsonl").read_text().splitlines(keepends=True)[:24]))
    config = vlm_config(tmp_path / "run", "qwen2_5_vl", rows, model={"freeze": ["vision"]},
                        data={"chat_template": "chatml_tools"}, fsdp={"version": version}, train={"save_every": 2})
    run_torchrun(2, "train", str(config))
    assert "<tool_call>" in (tmp_path / "run" / "run" / "final" / "chat_template.jinja").read_text()
    record = json.loads((tmp_path / "run" / "run" / "checkpoints" / "step-2" / "hfsdp_checkpoint.json").read_text())
    assert any(group.get("without_state") for group in record["optimizer"])
    assert_resumed_exactly(resume_from(tmp_path / "resumed", tmp_path / "run" / "run", 2, step=2),
                           tmp_path / "run" / "run")


def test_image_rows_with_a_template_that_renders_texts_only_are_refused():
    """A data.chat_template that adds contents as texts (chatml_tools) would train the row without its image: the
    row is refused, naming the template and the fix."""
    from hfsdp.errors import RowError

    rows = [{**TRL_ROWS[0], "images": [image(0)]}]
    with pytest.raises(RowError, match=r"has 1 image\(s\), and .*chatml_tools.* renders texts only.*leave "
                                       r"data.chat_template unset"):
        tokenized("qwen2_5_vl", rows, template="chatml_tools")


def test_smolvlm_135m_is_the_real_smollm2_135m_instruct_seeing_through_a_new_tower():
    """The vlm preset's built-in model: SmolLM2-135M-Instruct's decoder weights unchanged inside SmolVLM (its
    embedding grown by SmolVLM's tokens, its head the embedding untied), a tower and projector of the documented
    shape, 16 image tokens for a 64x64 picture of the preset's data."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hfsdp.config.files import PRESET_DIR
    from hfsdp.config.schema import ModelConfig
    from hfsdp.data.images import decode, image_bytes
    from hfsdp.model import loading

    folder = Path(loading.resolve_model_path("smolvlm-135m", CACHE_DIR))
    text = load_file(str(Path(loading.resolve_model_path("smollm2-135m-instruct", CACHE_DIR)) / "model.safetensors"))
    ours = load_file(str(folder / "model.safetensors"))
    decoder = {k.removeprefix("model.text_model."): v for k, v in ours.items() if k.startswith("model.text_model.")}
    assert decoder.keys() == {k.removeprefix("model.") for k in text}
    for name, value in decoder.items():
        old = text["model." + name]
        assert torch.equal(value[:old.shape[0]], old), name
    assert torch.equal(ours["lm_head.weight"][:49152], text["model.embed_tokens.weight"])
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.vision_config.hidden_size, config.vision_config.num_hidden_layers) == (
        "smolvlm", 192, 4)
    assert sum(v.numel() for k, v in ours.items() if k.startswith("model.vision_model.")) < 2_500_000
    tokenizer = loading.load_tokenizer(str(folder), ModelConfig(name_or_path=str(folder)))
    processor = tokenizer.hfsdp_processor
    row = json.loads((PRESET_DIR / "data" / "shapes_eval.jsonl").read_text().splitlines()[0])
    picture = decode(image_bytes(row["messages"][0]["content"][0]["image"], None, "the image"))
    out = processor(text=["<image>What?"], images=[[picture]])
    assert out["input_ids"][0].count(config.image_token_id) == 16
