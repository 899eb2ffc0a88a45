"""Checks on the shipped accelerate launcher configs (accelerate_configs/*.yaml).

Parsed with accelerate's own loader, the one `accelerate launch --config_file`
uses. Independent of the hfsdp package (it need not be importable).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import ComputeEnvironment, DistributedType

CONFIG_DIR = Path(__file__).resolve().parents[1] / "accelerate_configs"

# name -> (num_processes, num_machines)
EXPECTED = {
    "single_gpu_debug.yaml": (1, 1),
    "1node_8gpu_fsdp1.yaml": (8, 1),
    "1node_8gpu_fsdp2.yaml": (8, 1),
    "multinode.yaml": (16, 2),
}

# Anything that would make accelerate launch in FSDP mode or export FSDP_*
# environment variables; hfsdp's YAML is the only place for FSDP settings.
FSDP_KEY = re.compile(r"fsdp|parallelism|deepspeed|megatron", re.IGNORECASE)


def _shipped() -> list[Path]:
    return sorted(CONFIG_DIR.glob("*.y*ml"))


def test_every_shipped_config_is_covered():
    assert {p.name for p in _shipped()} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    path = CONFIG_DIR / name
    cfg = load_config_from_file(str(path))
    num_processes, num_machines = EXPECTED[name]

    assert isinstance(cfg, ClusterConfig)
    assert cfg.compute_environment == ComputeEnvironment.LOCAL_MACHINE
    assert cfg.distributed_type == DistributedType.MULTI_GPU
    assert cfg.num_processes == num_processes
    assert cfg.num_machines == num_machines
    assert num_processes % num_machines == 0
    # The string 'no', not YAML's boolean False from an unquoted `no`.
    assert cfg.mixed_precision == "no"
    assert cfg.use_cpu is False
    # accelerate's launcher refuses MULTI_GPU with fewer than two explicit ids.
    assert cfg.gpu_ids == "all"
    assert cfg.rdzv_backend in ("static", "c10d")
    # No FSDP (or other engine) settings in the launcher config.
    assert cfg.fsdp_config == {}
    assert cfg.parallelism_config == {}
    assert cfg.deepspeed_config == {}
    assert cfg.megatron_lm_config == {}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_launch_accepts_config(name):
    """Run `accelerate launch`'s own argument validation (no processes started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(
        ["--config_file", str(CONFIG_DIR / name), "-m", "hfsdp", "train", "my.yaml"]
    )
    args, defaults, _ = _validate_launch_command(args)
    num_processes, num_machines = EXPECTED[name]
    assert args.multi_gpu is True
    assert args.use_fsdp is False
    assert args.num_processes == num_processes
    assert args.num_machines == num_machines
    assert args.mixed_precision == "no"
    assert args.training_script_args == ["train", "my.yaml"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_fsdp_settings_in_raw_yaml(name):
    raw = yaml.safe_load((CONFIG_DIR / name).read_text(encoding="utf-8"))
    assert isinstance(raw, dict)
    offending = [k for k in raw if FSDP_KEY.search(k)]
    assert offending == [], f"{name} carries FSDP/engine settings: {offending}"
    for key, value in raw.items():
        assert not (isinstance(value, str) and value.upper().startswith("FSDP")), (key, value)
    text = (CONFIG_DIR / name).read_text(encoding="utf-8")
    uncommented = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    assert "FSDP_" not in uncommented
    assert "mixed_precision: 'no'" in text or 'mixed_precision: "no"' in text


def test_every_setting_is_commented():
    """Every shipped config explains itself (header plus per-setting comments)."""
    for path in _shipped():
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("#"), f"{path.name}: no header comment"
        assert sum(line.startswith("#") for line in lines) >= 10, path.name


def test_fsdp1_and_fsdp2_share_topology():
    """The launcher cannot pick the FSDP version; the two files differ only in comments."""
    one = yaml.safe_load((CONFIG_DIR / "1node_8gpu_fsdp1.yaml").read_text(encoding="utf-8"))
    two = yaml.safe_load((CONFIG_DIR / "1node_8gpu_fsdp2.yaml").read_text(encoding="utf-8"))
    assert one == two
    assert "--set fsdp.version=1" in (CONFIG_DIR / "1node_8gpu_fsdp1.yaml").read_text(encoding="utf-8")
    assert "--set fsdp.version=2" in (CONFIG_DIR / "1node_8gpu_fsdp2.yaml").read_text(encoding="utf-8")


def test_multinode_takes_per_node_values_from_command_line():
    raw = yaml.safe_load((CONFIG_DIR / "multinode.yaml").read_text(encoding="utf-8"))
    # Per-node values must not be hard-coded (accelerate cannot expand env vars).
    for key in ("machine_rank", "main_process_ip", "main_process_port"):
        assert key not in raw, key
    text = (CONFIG_DIR / "multinode.yaml").read_text(encoding="utf-8")
    for flag in ("--machine_rank", "--main_process_ip", "--main_process_port"):
        assert flag in text
    for var in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        assert var in text


def test_cpu_rehearsal_uses_torchrun():
    script = CONFIG_DIR / "cpu_rehearsal.sh"
    assert script.is_file()
    assert script.stat().st_mode & 0o111, "cpu_rehearsal.sh must be executable"
    text = script.read_text(encoding="utf-8")
    assert "torchrun" in text and "-m hfsdp train" in text
    assert "ACCELERATE_USE_CPU=true" in text
