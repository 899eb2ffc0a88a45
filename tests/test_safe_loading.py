"""Checkpoints from elsewhere run no code: every file that `hfsdp export` or `hfsdp train --resume` would unpickle
is read with a restricted unpickler (DCP metadata) or ``weights_only=True`` first, and a hostile one is refused with
exit 2 and one line naming it, before anything from it runs.

Each case copies a real SHARDED checkpoint of the tiny model and replaces one file (or one entry) with a pickle that
would create a marker file when unpickled the way DCP or Accelerate would read it."""

from __future__ import annotations

import io
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import Payload, base_env, run_cli, tiny_config
from hfsdp.checkpoint.safe_load import read_dcp_metadata, verify_checkpoint

pytestmark = pytest.mark.slow


def _poison_metadata(ckpt: Path, folder: str, marker: Path) -> Path:
    path = ckpt / folder / ".metadata"
    path.write_bytes(pickle.dumps(Payload(marker)))
    return path


def _poison_dcp_bytes(ckpt: Path, marker: Path) -> Path:
    """Point the optimizer's first non-tensor entry (a param_groups value) at a torch.save payload appended to its
    .distcp file; the metadata itself stays genuine."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = ckpt / "optimizer_0"
    metadata = read_dcp_metadata(folder)
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    data = folder / info.relative_path
    offset = data.stat().st_size
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    with open(data, "ab") as f:
        f.write(buffer.getvalue())
    info.offset, info.length = offset, len(buffer.getvalue())
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return data


def _poison_torch_file(ckpt: Path, name: str, marker: Path) -> Path:
    path = ckpt / name
    torch.save({"step": 2, "payload": Payload(marker)}, path)
    return path


# case -> (poison(checkpoint, marker) -> file named in the error, command)
CASES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "model metadata, export": (lambda c, m: _poison_metadata(c, "pytorch_model_fsdp_0", m), "export"),
    "model metadata, resume": (lambda c, m: _poison_metadata(c, "pytorch_model_fsdp_0", m), "resume"),
    "optimizer metadata, resume": (lambda c, m: _poison_metadata(c, "optimizer_0", m), "resume"),
    "optimizer non-tensor entry, resume": (_poison_dcp_bytes, "resume"),
    "RNG state, resume": (lambda c, m: _poison_torch_file(c, "random_states_0.pkl", m), "resume"),
    "LR scheduler state, resume": (lambda c, m: _poison_torch_file(c, "custom_checkpoint_0.pkl", m), "resume"),
    "trainer state, resume": (lambda c, m: _poison_torch_file(c, "custom_checkpoint_1.pkl", m), "resume"),
}


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("genuine")
    config = tiny_config(tmp, fsdp={"single_process": "fsdp"}, train={"max_steps": 2, "save_every": 2, "eval_at_start": False})
    run_cli("train", str(config), timeout=600)
    ckpt = tmp / "run" / "checkpoints" / "step-2"
    verify_checkpoint(ckpt)  # positive control: what hfsdp wrote passes
    return config, ckpt


def _run_case(case: str, root: Path, config: Path, genuine_ckpt: Path):
    poison, command = CASES[case]
    folder = root / case.replace(" ", "_").replace(",", "")
    ckpt = folder / "step-2"
    shutil.copytree(genuine_ckpt, ckpt)
    marker = folder / "pwned"
    poisoned = poison(ckpt, marker)
    if command == "export":
        argv = ["export", str(ckpt), str(folder / "out")]
    else:
        argv = ["train", str(config), "--resume", str(ckpt), "--set", f"train.output_dir={folder / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "hfsdp", *argv], env=base_env(), capture_output=True, text=True,
                          timeout=600)
    return proc, poisoned, marker, folder


@pytest.fixture(scope="module")
def results(genuine, tmp_path_factory):
    config, ckpt = genuine
    root = tmp_path_factory.mktemp("hostile")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(lambda c: _run_case(c, root, config, ckpt), CASES)))


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_checkpoint_file_is_refused_and_runs_nothing(case, results):
    proc, poisoned, marker, folder = results[case]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hfsdp: error:")]
    assert len(errors) == 1 and f"{poisoned}: refusing to load it" in errors[0], proc.stderr[-4000:]
    assert not marker.exists()
    assert not (folder / "out").exists()


def test_the_payloads_are_live(tmp_path):
    """Unpickled the way DCP reads metadata (pickle.load) or Accelerate reads custom states (weights_only=False),
    these payloads create their marker: the refusals above are what stops them."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
    marker.unlink()
    torch.save({"payload": Payload(marker)}, tmp_path / "state.pkl")
    torch.load(tmp_path / "state.pkl", weights_only=False)
    assert marker.exists()
