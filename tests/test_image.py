"""The Docker image, built from the repository's Dockerfile and run for real (podman, scripts/image.sh).

Inside the container, as the image's non-root user with the cache volume mounted: `hfsdp --version`, `hfsdp train
tiny` to the end, the 2-rank FSDP rehearsal under torchrun, and `hfsdp export` of the container's checkpoint into
a bind-mounted host folder. Skipped only where the container tools are not installed (CI installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hfsdp
from conftest import REPO, base_env, step_losses

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "image.sh"
IMAGE = "localhost/hfsdp:local"  # what scripts/image.sh builds
# Outlives the test run (in the podman storage, $HFSDP_IMAGE_CACHE), like the `-v hfsdp-cache:/cache` of
# docs/gpu_hosts.md: the built-in models are made in it once per cache.
CACHE_VOLUME = "hfsdp-test-cache"
TOOLS = ("podman", "runc", "mmdebstrap")


def _podman(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "podman", *args], env=base_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def image_user() -> tuple[int, int]:
    """Build the image (layers cached by podman) and return its user's uid and gid."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no container engine: {', '.join(missing)} not installed "
                    "(apt-get install podman buildah runc mmdebstrap)")
    if os.getuid() != 0:
        pytest.skip("scripts/image.sh runs rootful podman, and this test is not running as root")
    build = subprocess.run(["bash", str(SCRIPT), "build"], env=base_env(), capture_output=True, text=True,
                           timeout=3600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-6000:]
    print(build.stdout.splitlines()[-1])
    user = _podman("image", "inspect", "--format", "{{.Config.User}}", IMAGE)
    assert user.returncode == 0, user.stderr
    uid, gid = (int(x) for x in user.stdout.strip().split(":"))
    assert uid != 0
    return uid, gid


def _in_container(workspace: Path, *command: str, mounts: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """COMMAND in a fresh container: the image's user, /workspace = WORKSPACE (host), the cache volume, no network."""
    args = ["run", "--rm", "--network", "none", "-e", "OMP_NUM_THREADS=1", "-e", "HF_HUB_OFFLINE=1",
            "-v", f"{CACHE_VOLUME}:/cache", "-v", f"{workspace}:/workspace"]
    for mount in mounts:
        args += ["-v", mount]
    proc = _podman(*args, IMAGE, *command)
    assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    print(proc.stdout)
    return proc


def _workspace(path: Path, user: tuple[int, int]) -> Path:
    """A host folder the container's user can write to: it owns it."""
    path.mkdir()
    os.chown(path, *user)
    return path


def _owners(folder: Path) -> set[tuple[int, int]]:
    return {(p.stat().st_uid, p.stat().st_gid) for p in [folder, *folder.rglob("*")]}


def _run_tiny(workspace: Path, *launcher: str) -> subprocess.CompletedProcess:
    proc = _in_container(workspace, *launcher, "hfsdp", "train", "tiny")
    assert "model written to runs/tiny/final" in proc.stdout
    losses = step_losses(workspace / "runs" / "tiny")
    assert max(losses) == 20 and losses[20] < losses[1], losses
    return proc


@pytest.fixture(scope="module")
def rehearsal(image_user, tmp_path_factory) -> tuple[Path, str]:
    """`torchrun --nproc-per-node 2 -m hfsdp train tiny` in the container, into a host folder: (folder, output)."""
    workspace = _workspace(tmp_path_factory.mktemp("image") / "rehearsal", image_user)
    proc = _run_tiny(workspace, "torchrun", "--nproc-per-node", "2", "-m")
    return workspace, proc.stdout + proc.stderr


def test_version_as_non_root_user(image_user, tmp_path):
    proc = _in_container(_workspace(tmp_path / "ws", image_user), "bash", "-c", "id -u; id -g; hfsdp --version")
    uid, gid, version = proc.stdout.split("\n", 2)
    assert (int(uid), int(gid)) == image_user
    assert version.strip() == f"hfsdp, version {hfsdp.__version__}"


def test_train_tiny_to_the_end_and_the_export_loads(image_user, tmp_path):
    from transformers import AutoModelForCausalLM

    workspace = _workspace(tmp_path / "ws", image_user)
    _run_tiny(workspace)
    run = workspace / "runs" / "tiny"
    model = AutoModelForCausalLM.from_pretrained(run / "final")  # on the host, from the container's files
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert _owners(run) == {image_user}


def test_torchrun_two_ranks_shard_in_container(rehearsal):
    _, out = rehearsal
    assert "2 processes on cpu (rehearsal, gloo), FSDP" in out
    assert "parameters on this rank: 6.2 MiB of 12.5 MiB (50%)" in out


def test_export_into_bind_mounted_host_folder(rehearsal, image_user, tmp_path):
    workspace, _ = rehearsal
    out = _workspace(tmp_path / "out", image_user)
    proc = _in_container(workspace, "hfsdp", "export", "runs/tiny/checkpoints/step-20", "/out/model",
                         mounts=(f"{out}:/out",))
    assert "-> /out/model" in proc.stdout
    # Owned on the host by the image's user (HFSDP_UID): the uid a host user builds the image with to own
    # what the container writes (docs/gpu_hosts.md).
    assert _owners(out / "model") == {image_user}
    exported = load_file(out / "model" / "model.safetensors")
    final = load_file(workspace / "runs" / "tiny" / "final" / "model.safetensors")
    assert exported.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(exported[name], tensor), name
