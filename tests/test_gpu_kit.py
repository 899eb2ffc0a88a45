"""scripts/gpu_kit.sh, the GPU kit for an air-gapped GPU host (docs/gpu_hosts.md): the size of what is copied is
within the limit (computed from the lock, without a registry), the lock is a closed set of wheels for the host's
Python that the image lacks, the install plan keeps the image's packages where they satisfy, the kit installs into a
site folder with hfsdp's entry points, and `run` on a machine without a GPU skips each GPU stage with its reason,
and a stage that hangs is stopped at its own limit."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, base_env
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

SCRIPT = REPO / "scripts" / "gpu_kit.sh"


def _load_kit():
    spec = importlib.util.spec_from_file_location("gpu_kit", REPO / "scripts" / "gpu_kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load_kit()
HAS_GPU = shutil.which("nvidia-smi") is not None or any(Path("/dev").glob("nvidia[0-9]*"))


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env or base_env(PYTHON=sys.executable), cwd=REPO)


def test_size_of_what_is_copied_is_within_the_limit_without_downloading(tiny_model_dir):
    """The size report adds the tree, the wheels (the lock's sizes where they are not downloaded) and the cache seed
    (from the tests' cache, which tiny_model_dir fills), and fails when the total is over the limit."""
    proc = _run("size")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sizes = {}
    for line in proc.stdout.splitlines()[1:]:
        label, rest = line[:42].strip(), line[42:].split()
        sizes[label] = float(rest[0])
    assert set(sizes) == {"tree (tracked + untracked, not ignored)", "wheels", "cache seed (tokenizer + config)",
                          "total"}, proc.stdout
    assert abs(sizes["total"] - sum(v for k, v in sizes.items() if k != "total")) < 0.02, proc.stdout
    assert sizes["wheels"] >= sum(e["size"] for e in kit.read_lock()["packages"]) / kit.MiB - 0.01
    assert 1 < sizes["cache seed (tokenizer + config)"] < 8 and sizes["total"] <= kit.COPY_LIMIT / kit.MiB
    assert f"within the {kit.COPY_LIMIT // kit.MiB} MiB limit" in proc.stdout
    over = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_kit.py"), "size", "--limit-mib", "1"],
                          capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=120)
    assert over.returncode == 1 and "OVER the 1 MiB limit" in over.stdout, over.stdout + over.stderr


def test_lock_is_a_closed_set_of_wheels_for_the_host_that_the_image_lacks():
    """Every locked wheel installs on CPython 3.12 manylinux x86-64; none is an image package; the roots are
    hfsdp's requirements (and the GPU tests' tools) that the image lacks; every requirement of a locked wheel, on the
    host's markers, is an image package or a locked wheel whose version satisfies it; nothing is locked that the
    roots do not need."""
    lock = kit.read_lock()
    locked = {canonicalize_name(e["name"]): e for e in lock["packages"]}
    image = {canonicalize_name(n) for n in kit.IMAGE_PACKAGES}
    assert not image & set(locked)
    target_tags = {f"cp312-{abi}-{plat}" for abi in ("cp312", "abi3", "none") for plat in kit.PLATFORMS}
    target_tags |= {f"{py}-none-any" for py in ("py3", "py312", "cp312")} | {f"{py}-none-{p}" for py in ("py3", "py312")
                                                                             for p in kit.PLATFORMS}
    for entry in lock["packages"]:
        name, version, _, tags = parse_wheel_filename(entry["file"])
        assert canonicalize_name(entry["name"]) == name and str(version) == entry["version"], entry
        good = any(str(t) in target_tags or (t.abi == "abi3" and t.platform in kit.PLATFORMS) for t in tags)
        assert good, (entry["file"], [str(t) for t in tags])
    roots = [Requirement(r) for r in kit.kit_roots()]
    assert {canonicalize_name(r.name) for r in roots} == {canonicalize_name(Requirement(r).name) for r in lock["roots"]}
    assert {"datasets", "pydantic", "pytest"} <= {canonicalize_name(r.name) for r in roots}
    reached, todo = set(), [(r, set(r.extras)) for r in roots]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in image:
            continue
        assert name in locked, f"{req} is needed but neither in the image nor locked"
        assert req.specifier.contains(Version(locked[name]["version"]), prereleases=True), (str(req), locked[name])
        if name not in reached:
            reached.add(name)
            todo += [(d, set(d.extras)) for d in map(Requirement, locked[name]["requires"])
                     if kit.applies(d, kit.TARGET_MARKERS, extras)]
    assert reached == set(locked), f"locked but not needed: {set(locked) - reached}"


class _Dist:
    def __init__(self, requires=()):
        self.requires = list(requires)


def _lock(*entries):
    return {"packages": [{"name": n, "version": v, "file": f"{n}-{v}-py3-none-any.whl", "requires": list(r)}
                         for n, v, r in entries]}


def test_install_plan_keeps_image_packages_that_satisfy_and_says_what_cannot_be_met():
    lock = _lock(("datasets", "5.2.0", ["numpy>=1.17", "dill<0.4.2"]), ("dill", "0.4.1", []),
                 ("numpy", "2.5.5", []), ("fsspec", "2026.9.0", []))
    # the image has numpy and an old dill: numpy stays the image's, dill comes from the kit
    image = {"numpy": ("1.26.4", _Dist()), "dill": ("0.3.0", _Dist()), "tool": ("1.0", _Dist(["dill>=0.3"]))}
    plan, files, problems = kit.plan_install(lock, image, ["datasets>=3.0", "numpy"])
    assert problems == []
    assert plan == {"datasets": "kit 5.2.0", "numpy": "image 1.26.4", "dill": "image 0.3.0"}  # 0.3.0 is < 0.4.2
    assert files == ["datasets-5.2.0-py3-none-any.whl"], plan
    # a requirement the image's version fails takes the kit's copy (and its file), checked against the image's users
    image["dill"] = ("0.5.0", _Dist())
    plan, files, problems = kit.plan_install(lock, image, ["datasets>=3.0"])
    assert plan["dill"] == "kit 0.4.1" and "dill-0.4.1-py3-none-any.whl" in files and problems == []
    image["tool"] = ("1.0", _Dist(["dill>=0.5"]))
    _, _, problems = kit.plan_install(lock, image, ["datasets>=3.0"])
    assert problems == ["dill: the kit's 0.4.1 replaces the image's 0.5.0, but the image's tool wants dill>=0.5"]
    # neither the image nor the kit: named, with who wants what
    _, _, problems = kit.plan_install(lock, {}, ["datasets>=6"])
    assert problems == ["datasets: hfsdp wants datasets>=6; the image lacks it, the kit has 5.2.0"], problems


def _wheel(folder: Path, name: str, version: str, requires=()) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_install_puts_the_needed_wheels_and_hfsdps_entry_points_into_the_site(tmp_path, monkeypatch, capsys):
    """Real pip (--no-index --no-deps --target) on two small wheels made here, as the host would run it: the wheel
    the roots need is installed, the other is not, and the site carries hfsdp's metadata, so that hfsdp from the
    tree finds its built-in plugins (entry points) there."""
    wheels = tmp_path / "kit" / "wheels"
    wheels.mkdir(parents=True)
    a, b = _wheel(wheels, "kitdemo_a", "1.0", ["kitdemo_b>=2"]), _wheel(wheels, "kitdemo_b", "2.0")
    unused = _wheel(wheels, "kitdemo_c", "1.0")
    lock = {"packages": [{"name": p.name.split("-")[0], "version": p.name.split("-")[1], "file": p.name,
                          "sha256": kit.sha256(p), "requires": kit.wheel_requires(p)} for p in (a, b, unused)]}
    (tmp_path / "lock.json").write_text(json.dumps(lock))
    monkeypatch.setattr(kit, "LOCK", tmp_path / "lock.json")
    monkeypatch.setattr(kit, "IMAGE_PYTHON", sys.version_info[:2])
    monkeypatch.setattr(kit, "root_requirements", lambda: ["kitdemo_a", "pyyaml"])
    site = tmp_path / "site"
    assert kit.main(["install", "--kit", str(tmp_path / "kit"), "--site", str(site)]) == 0
    out = capsys.readouterr().out
    assert "installed 2 of 3 kit wheels" in out and "pyyaml" in out and "image " in out, out
    assert sorted(p.name for p in site.iterdir()) == ["hfsdp-0.1.0.dist-info", "kitdemo_a", "kitdemo_a-1.0.dist-info",
                                                      "kitdemo_b", "kitdemo_b-2.0.dist-info"]
    probe = ("import importlib.metadata as m, kitdemo_a;"
             "print(m.version('hfsdp'), sorted(e.name for e in m.entry_points(group='hfsdp')))")
    env = {**base_env(), "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "'chat'" in result.stdout and "'text'" in result.stdout, result.stdout
    # an altered wheel is refused before anything is installed
    b.write_bytes(b.read_bytes() + b"x")
    assert kit.main(["install", "--kit", str(tmp_path / "kit"), "--site", str(tmp_path / "site2")]) == 1
    assert "altered" in capsys.readouterr().out and not (tmp_path / "site2").exists()


@pytest.mark.skipif(HAS_GPU, reason="checks the run of a machine without a GPU")
def test_run_without_a_gpu_skips_each_gpu_stage_with_its_reason_and_exits_0(tmp_path):
    proc = _run("run", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["install", "check", "gpu", "gpu-tests", "mfu"] and summary["failed"] is False
    assert stages["check"]["result"] == "PASS" and stages["check"]["detail"].startswith("ok ("), stages["check"]
    assert stages["install"]["result"] in ("PASS", "SKIP") and stages["install"]["detail"], stages["install"]
    for name in ("gpu", "gpu-tests", "mfu"):
        assert stages[name]["result"] == "SKIP", stages[name]
        assert stages[name]["detail"] == "no NVIDIA GPU on this machine (no nvidia-smi, no /dev/nvidia*)"
        assert f"gpu_kit: {name:<10} SKIP" in proc.stdout
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "gpu-tests  SKIP" in text and (tmp_path / "out" / "logs" / "check.log").is_file()


def test_a_stage_that_hangs_is_stopped_at_its_limit_and_the_run_goes_on(tmp_path):
    """PYTHON is a wrapper whose `check` hangs: the check stage fails at its 3 s limit (GPU_KIT_LIMITS), the later
    stages still run and are reported, and the run exits 1."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [[ "$a" == check ]] && exec sleep 300; done\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = base_env(PYTHON=str(wrapper), GPU_KIT_LIMITS="check=3")
    proc = _run("run", str(tmp_path / "out"), env=env, timeout=90)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    stages = {s["stage"]: s for s in json.loads((tmp_path / "out" / "summary.json").read_text())["stages"]}
    assert stages["check"]["result"] == "FAIL" and "timed out after 3s" in stages["check"]["detail"], stages
    assert stages["check"]["seconds"] < 20 and len(stages) == 5, stages


def test_usage_errors():
    for args in ([], ["bogus"], ["run", "a", "b"], ["size", "x"]):
        proc = _run(*args)
        assert proc.returncode == 2 and "scripts/gpu_kit.sh prepare" in proc.stderr, (args, proc.stderr)
    proc = _run("run", env=base_env(GPU_KIT_LIMITS="mfu=soon"))
    assert proc.returncode == 2 and "is not NAME=SECONDS" in proc.stderr
