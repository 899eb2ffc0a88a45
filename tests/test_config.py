"""Every class of bad config gives one clear error naming its YAML path: through the Python API (fast) and, for a
few, through the real ``hfsdp validate`` (exit 2, no traceback). Every bundled preset validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import preset_overrides, run_cli, tiny_config
from hfsdp.config.files import list_presets
from hfsdp.rules.table import load_checked
from hfsdp.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def _problems(path: Path, overrides=()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_checked(str(path), list(overrides))
    return dict(info.value.problems)


def _tiny_with(tmp_path: Path, **sections) -> Path:
    return tiny_config(tmp_path, **sections)


# (case id, sections merged over the tiny config, expected YAML path, message substring)
CASES = [
    ("unknown key", {"train": {"max_stepz": 3}}, "train.max_stepz", "unknown key"),
    ("unknown section", {"trainer": {"max_steps": 3}}, "trainer", "unknown section"),
    ("plugin section without plugin", {"lora": {"r": 8}}, "lora", "enable plugin 'lora' (add it to `plugins:`)"),
    ("wrong type int", {"train": {"max_steps": "many"}}, "train.max_steps", "valid integer"),
    ("wrong type bool", {"fsdp": {"cpu_offload": "sometimes"}}, "fsdp.cpu_offload", "valid boolean"),
    ("wrong type list", {"fsdp": {"transformer_layer_cls": "LlamaDecoderLayer"}}, "fsdp.transformer_layer_cls",
     "valid list"),
    ("out of range", {"train": {"learning_rate": -1.0}}, "train.learning_rate", "greater than 0"),
    ("bad enum strategy", {"fsdp": {"sharding_strategy": "ZERO3"}}, "fsdp.sharding_strategy", "FULL_SHARD"),
    ("bad enum version", {"fsdp": {"version": 3}}, "fsdp.version", "1 or 2"),
    ("bad enum precision", {"fsdp": {"mixed_precision": "fp8"}}, "fsdp.mixed_precision", "fp8"),
    ("bad enum precision part", {"fsdp": {"mixed_precision": {"param": "int8"}}}, "fsdp.mixed_precision.param",
     "int8"),
    ("bad enum too_long", {"data": {"too_long": "wrap"}}, "data.too_long", "'truncate' or 'drop'"),
    ("fsdp1-only knob on fsdp2", {"fsdp": {"version": 2, "use_orig_params": True}}, "fsdp",
     "use_orig_params only exist in FSDP1"),
    ("size policy without min_num_params", {"fsdp": {"wrap_policy": "size"}}, "fsdp", "needs fsdp.min_num_params"),
    ("min_num_params without size policy", {"fsdp": {"min_num_params": 1000}}, "fsdp",
     "min_num_params only applies to wrap_policy 'size'"),
    ("no_shard fsdp2 with cpu offload", {"fsdp": {"sharding_strategy": "NO_SHARD", "cpu_offload": True}}, "fsdp",
     "runs as DDP"),
    ("hybrid size without hybrid", {"fsdp": {"hybrid_shard_size": 2}}, "fsdp", "only applies to sharding_strategy"),
    ("two eval sources", {"data": {"eval_fraction": 0.1}}, "data", "set only one of eval_path, eval_split, eval_fraction"),
    ("no length", {"train": {"output_dir": "x", "max_steps": None}}, "train", "set train.max_steps or train.epochs"),
    ("missing required key", {"model": {"dtype": "bf16"}}, "model.name_or_path", "required key is missing"),
    ("unknown data format", {"data": {"format": "sharegpt"}}, "data.format", "unknown format 'sharegpt'"),
    ("unknown plugin", {"plugins": ["no_such_plugin_xyz"]}, "plugins", "neither an installed plugin"),
    # issue 15: keys that would silently do something other than they say
    # issue 21: train.compile is real now (per-block torch.compile); what it cannot do is refused
    ("compile under fsdp1", {"train": {"compile": True}, "fsdp": {"version": 1}}, "train.compile", "FSDP1"),
    ("compile with an unknown backend", {"train": {"compile": {"backend": "tvm"}}}, "train.compile.backend",
     "'inductor', 'aot_eager' or 'eager'"),
    ("fsdp2 ignores buffer dtype", {"fsdp": {"version": 2, "mixed_precision": {"param": "bf16", "buffer": "bf16"}}},
     "fsdp.mixed_precision.buffer", "only FSDP1 casts buffers"),
    ("ddp ignores reduce dtype", {"fsdp": {"sharding_strategy": "NO_SHARD", "mixed_precision": {"reduce": "bf16"}}},
     "fsdp", "reduces gradients in float32"),
    ("ddp ignores ram-efficient loading", {"fsdp": {"sharding_strategy": "NO_SHARD", "cpu_ram_efficient_loading": True}},
     "fsdp", "no cpu_ram_efficient_loading"),
    ("generation eval on text", {"data": {"format": "text"}, "generation_eval": {}}, "generation_eval",
     "needs data.format chat or instruction"),
]


@pytest.mark.parametrize("sections,where,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_names_yaml_path(tmp_path, sections, where, message):
    if sections.get("model") and "name_or_path" not in sections["model"]:
        path = tiny_config(tmp_path)
        raw = yaml.safe_load(path.read_text())
        raw["model"] = sections["model"]
        path.write_text(yaml.safe_dump(raw))
    else:
        path = _tiny_with(tmp_path, **sections)
    problems = _problems(path)
    assert where in problems, problems
    assert message in problems[where], problems


def test_a_missing_section_points_to_a_preset_base(tmp_path):
    problems = _problems(_write(tmp_path, "model:\n  name_or_path: meta-llama/Llama-3.1-8B\n"))
    assert set(problems) == {"data", "train"}
    assert all("start from a preset that has it: `base: default`" in m for m in problems.values()), problems
    # a key missing inside a section gets no preset hint
    path = tiny_config(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"dtype": "float32"}
    path.write_text(yaml.safe_dump(raw))
    assert _problems(path) == {"model.name_or_path": "required key is missing"}


def test_all_problems_reported_together(tmp_path):
    path = _tiny_with(tmp_path, train={"max_stepz": 1, "learning_rate": "fast"}, fsdp={"version": 7})
    problems = _problems(path)
    assert {"train.max_stepz", "train.learning_rate", "fsdp.version"} <= set(problems)


def test_missing_file_and_malformed_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_checked(str(tmp_path / "nope.yaml"))
    bad = _write(tmp_path, "model:\n  name_or_path: x\n data: [\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+, column \d+"):
        load_checked(str(bad))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_checked(str(_write(tmp_path, "- a\n- b\n")))
    with pytest.raises(ConfigError, match="neither a config file nor a preset"):
        load_checked("no_such_preset")


def test_overrides_typed_by_schema(tmp_path):
    path = tiny_config(tmp_path)
    config, _ = load_checked(str(path), ["train.max_steps=10", "fsdp.mixed_precision=bf16", "data.eval_path=null",
                                        "train.learning_rate=1e-4"])
    assert config.train.max_steps == 10 and isinstance(config.train.max_steps, int)
    assert config.fsdp.mixed_precision == "bf16"
    assert config.data.eval_path is None
    assert config.train.learning_rate == pytest.approx(1e-4)
    assert _problems(path, ["train.max_steps=abc"]).keys() == {"train.max_steps"}
    assert "unknown key" in _problems(path, ["train.nope=1"])["train.nope"]
    assert "overrides look like" in _problems(path, ["train.max_steps"])["train.max_steps"]
    assert "is not a section" in _problems(path, ["train.max_steps.x=1"])["train.max_steps.x"]


@pytest.mark.parametrize("name", sorted(list_presets()))
def test_bundled_presets_validate(name):
    config, host = load_checked(name, preset_overrides(name))
    assert config.train.max_steps or config.train.epochs
    assert config.data.format in host.dataset_formats()
    assert Path(config.data.path).is_file(), "preset data paths resolve next to the preset"


# ---- the real CLI: exit 2, one message that names the YAML path, no traceback

def _cli_fails(*args: str) -> str:
    proc = run_cli(*args, check=False, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("hfsdp: error:"), proc.stderr
    return proc.stderr


def test_cli_validate_errors(tmp_path):
    path = tiny_config(tmp_path, train={"max_stepz": 3}, fsdp={"sharding_strategy": "ZERO3"})
    err = _cli_fails("validate", str(path))
    assert "train.max_stepz: unknown key" in err and "fsdp.sharding_strategy:" in err
    assert "2 problem(s)" in err
    err = _cli_fails("validate", str(tiny_config(tmp_path)), "--set", "train.max_steps=abc")
    assert "train.max_steps: Input should be a valid integer" in err and "'abc'" in err
    assert "config file not found" in _cli_fails("validate", str(tmp_path / "missing.yaml"))
    assert "malformed YAML at line" in _cli_fails("validate", str(_write(tmp_path, "train: {max_steps: 3\n")))


def test_cli_validate_override_ok(tmp_path):
    proc = run_cli("validate", str(tiny_config(tmp_path)), "--set", "train.max_steps=10", timeout=120)
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["train"]["max_steps"] == 10
    assert resolved["fsdp"]["sharding_strategy"] == "FULL_SHARD"  # defaults filled in


# ---- issue 12: a base to start from, problems shown at once, messages that point somewhere real


def test_base_preset_is_overridden_key_by_key(tmp_path):
    path = _write(tmp_path, "base: tiny\ntrain:\n  max_steps: 3\n  output_dir: out\n")
    config, _ = load_checked(str(path))
    preset, _ = load_checked("tiny")
    assert config.train.max_steps == 3 and config.train.output_dir == "out"
    assert config.train.learning_rate == preset.train.learning_rate  # the rest of train: comes from the preset
    assert config.model == preset.model and config.data == preset.data  # data paths stay anchored to the preset


def test_base_file_chain_anchors_each_files_data_paths(tmp_path):
    (tmp_path / "common").mkdir()
    data = tmp_path / "common" / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    common = yaml.safe_load(tiny_config(tmp_path / "common").read_text())
    common["data"] = {"format": "text", "path": "rows.jsonl"}  # relative to common/
    (tmp_path / "common" / "base.yaml").write_text(yaml.safe_dump(common))
    middle = _write(tmp_path, "base: common/base.yaml\nfsdp:\n  version: 1\n")
    top = tmp_path / "top.yaml"
    top.write_text(f"base: {middle.name}\ntrain:\n  max_steps: 2\n")
    config, _ = load_checked(str(top))
    assert config.data.path == str(data.resolve()) and config.fsdp.version == 1 and config.train.max_steps == 2
    middle.write_text("base: ../" + tmp_path.name + "/top.yaml\n")
    assert "configs name each other as base" in _problems(top)["base"]
    middle.write_text("base: no_such_preset\n")
    assert "neither a config file" in _problems(top)["base"]


def test_unknown_key_suggests_and_points_to_config_reference(tmp_path):
    problems = _problems(tiny_config(tmp_path, train={"max_step": 3}, fsdp={"mixed_precision": {"parm": "bfloat16"}},
                                     plugins=["lora"], lora={"alpah": 4}))
    assert problems["train.max_step"] == ("unknown key (did you mean 'max_steps'? `hfsdp config-reference train` "
                                          "lists the valid keys)")
    assert "did you mean 'param'?" in problems["fsdp.mixed_precision.parm"]
    assert "did you mean 'alpha'?" in problems["lora.alpah"]
    assert "did you mean 'name_or_path'?" in _problems(_write(tmp_path, "base: tiny\nmodel:\n  name: x\n"))["model.name"]
    assert "`hfsdp config-reference lora --enable lora`" in problems["lora.alpah"]


def test_every_problem_at_once_type_errors_and_plugin_checks(tmp_path):
    # a type error in train: and in packing:, and the lora plugin's own checks (on fsdp: and on lora:): all at once
    path = tiny_config(tmp_path, plugins=["lora", "packing"], train={"max_steps": "many"},
                       fsdp={"version": 1, "use_orig_params": False}, lora={"target_modules": []}, packing={"window": 0})
    problems = _problems(path)
    assert set(problems) == {"train.max_steps", "packing.window", "fsdp.use_orig_params", "lora.target_modules"}
    # a plugin check that reads a section with its own problems is skipped, not crashed or reported twice
    problems = _problems(tiny_config(tmp_path, plugins=["packing"], data={"max_seq_len": "long"}, packing={"max_len": 8}))
    assert set(problems) == {"data.max_seq_len"}, problems


def test_config_reference_command(tmp_path):
    proc = run_cli("config-reference", "lora", timeout=120)
    assert proc.stdout.startswith("### `lora` (plugin `lora`: enable with `plugins: [lora]`)")
    assert "| `lora.r` | `int` | `8` | adapter rank |" in proc.stdout and "`train." not in proc.stdout
    everything = run_cli("config-reference", timeout=120).stdout
    assert all(f"### `{name}`" in everything for name in ("model", "data", "train", "fsdp", "lora", "packing"))
    assert "no section 'trainer'" in _cli_fails("config-reference", "trainer")


@pytest.mark.parametrize("command", ["validate", "plugins"])
def test_validate_and_plugins_do_not_import_torch(tmp_path, command):
    """The CLI promises that `validate --no-rows` and `plugins` answer without torch (issue 15 item 7); plain
    `validate` also tokenizes a sample of rows (issue 27), which needs the tokenizer, so transformers and torch."""
    import subprocess
    import sys

    from conftest import base_env

    argv = ["validate", "--no-rows", str(tiny_config(tmp_path))] if command == "validate" else ["plugins"]
    script = ("import sys\nfrom hfsdp.cli import cli\ntry:\n    cli(%r, prog_name='hfsdp')\nexcept SystemExit as e:\n"
              "    assert not e.code, e.code\nheavy = [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]\n"
              "print('HEAVY', heavy)\n" % (argv,))
    proc = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY []" in proc.stdout, proc.stdout[-3000:]


def test_precision_keys_that_are_honoured_still_validate(tmp_path):
    """The rejections above are narrow: FSDP1 casts buffers, FSDP2 may name model.dtype, DDP reduces in float32."""
    for fsdp in ({"version": 1, "mixed_precision": {"param": "bf16", "buffer": "bf16"}},
                 {"version": 2, "mixed_precision": {"param": "bf16", "buffer": "float32"}},
                 {"version": 2, "sharding_strategy": "NO_SHARD", "mixed_precision": {"param": "bf16"}},
                 {"version": 1, "sharding_strategy": "NO_SHARD", "mixed_precision": {"reduce": "bf16"}}):
        load_checked(str(tiny_config(tmp_path, fsdp=fsdp)))


def test_relative_data_paths_are_taken_from_the_config_folder(tmp_path, monkeypatch):
    """One rule: relative to the config file's folder, never the working directory; --set paths: the working
    directory (issue 15 item 11)."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "rows.jsonl").write_text("{}\n")
    (tmp_path / "cwd_rows.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    path = tiny_config(sub, data={"path": "rows.jsonl", "eval_path": "cwd_rows.jsonl"})
    config, _ = load_checked(str(path), check_data=False)
    assert config.data.path == str(sub / "rows.jsonl")
    assert config.data.eval_path == str(sub / "cwd_rows.jsonl")  # not the working directory's file
    assert _problems(path)["data.eval_path"] == (
        f"{sub / 'cwd_rows.jsonl'} does not exist (a relative path in a config file is taken from the config file's "
        "folder; one given with --set, from the working directory)")
    config, _ = load_checked(str(path), ["data.eval_path=cwd_rows.jsonl"])
    assert config.data.eval_path == "cwd_rows.jsonl"
    config, _ = load_checked(str(tiny_config(sub, data={"path": "org/dataset-name"})))
    assert config.data.path == "org/dataset-name"  # a datasets name stays a name


def test_core_checks_run_for_the_sections_that_validated(tmp_path):
    # fsdp: has a type error, so the fsdp/model cross-check is skipped; data: validated, so its checks still run
    problems = _problems(tiny_config(tmp_path, fsdp={"version": "three"},
                                     data={"format": "sharegpt", "path": str(tmp_path / "nope.jsonl")}))
    assert set(problems) == {"fsdp.version", "data.format", "data.path"}, problems


def test_hfsdp_presets_lists_every_preset_in_aligned_columns():
    lines = run_cli("presets").stdout.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(list_presets())
    assert len({line.index(" model ") for line in lines}) == 1, lines  # distill-online's row too
