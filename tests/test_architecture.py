"""The tree keeps its shape: the config and rules packages are torch-free (``validate --no-rows`` answers without
torch installed), every import points down the layers (:data:`LAYERS`, written down in pyproject.toml as
import-linter's layers contract is), no module and no package imports itself back through others (imports inside
functions and under ``TYPE_CHECKING`` count in all three), and ``hfsdp train`` decides its run in one pass: config,
rules, decided run."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import REPO, base_env, preset_overrides

PACKAGE = REPO / "hfsdp"


def test_validate_no_rows_of_every_example_and_preset_config_imports_no_torch():
    """``hfsdp validate --no-rows`` promises an answer without torch, transformers or accelerate: on every shipped
    config, QLoRA, DPO and GRPO included (a QLoRA config imported torch through config -> quantization -> fsdp)."""
    configs = sorted(str(p) for p in (REPO / "examples").glob("*.yaml"))
    configs += sorted("|".join([p.stem, *preset_overrides(p.stem)]) for p in (PACKAGE / "config" / "presets").glob("*.yaml"))
    script = ("import sys\nfrom hfsdp.cli import cli\nfor arg in sys.argv[1:]:\n"
              "    config, *overrides = arg.split('|')\n"
              "    try:\n        cli(['validate', '--no-rows', config, *[a for o in overrides for a in ('--set', o)]], "
              "prog_name='hfsdp')\n"
              "    except SystemExit as e:\n        assert not e.code, (config, e.code)\n"
              "    heavy = [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]\n"
              "    print('HEAVY', config, heavy, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", script, *configs], env=base_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY")]
    assert len(lines) == len(configs) and any("qlora" in line for line in lines), proc.stderr[-3000:]
    assert all(line.endswith(" []") for line in lines), "\n".join(lines)


def test_validate_no_rows_of_muon_and_optimizer_args_imports_no_torch(tmp_path):
    """The optimizer's rules read a table, not the optimizer: ``train.optimizer: muon`` (whose torch version is
    checked) and ``optimizer_args`` (checked against the optimizer's keyword arguments) validate without torch, and a
    wrong argument is still named."""
    from conftest import tiny_config

    cases = {"muon": {"optimizer": "muon", "optimizer_args": {"ns_steps": 4}},
             "sgd": {"optimizer": "sgd", "optimizer_args": {"momentum": 0.9}},
             "wrong": {"optimizer_args": {"momentum": 0.9}}}
    for name in cases:
        (tmp_path / name).mkdir()
    configs = [tiny_config(tmp_path / name, train=train) for name, train in cases.items()]
    script = ("import sys\nfrom hfsdp.cli import cli\nfor config in sys.argv[1:]:\n"
              "    try:\n        cli(['validate', '--no-rows', config], prog_name='hfsdp')\n"
              "    except SystemExit as e:\n        print('EXIT', e.code, file=sys.stderr)\n"
              "    heavy = [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]\n"
              "    print('HEAVY', heavy, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", script, *map(str, configs)], env=base_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("HEAVY", "EXIT"))]
    assert lines == ["EXIT 0", "HEAVY []", "EXIT 0", "HEAVY []", "EXIT 2", "HEAVY []"], proc.stderr[-3000:]
    assert "train.optimizer_args.momentum: unknown argument of adamw (torch.optim.AdamW); it takes: amsgrad, " \
           "maximize, foreach, capturable, differentiable, fused" in proc.stderr


def test_the_config_and_rules_packages_import_no_torch():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for folder in ("config", "rules") for p in sorted((PACKAGE / folder).rglob("*.py"))]
    script = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
              "print([m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", script, *modules], env=base_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(modules) > 6 and proc.stdout.strip() == "[]", (modules, proc.stdout)


def test_bench_decides_its_runs_without_torch(tmp_path):
    """``hfsdp bench`` launches each run in its own processes; deciding which runs to make (what one process runs
    under each strategy, train's own rule) imports neither torch nor transformers in the launching process."""
    script = ("import sys\nfrom pathlib import Path\nfrom hfsdp.tools import bench\n"
              "opts = bench.BenchOptions(config='tiny', strategies=['FULL_SHARD', 'NO_SHARD'], nprocs=[1, 2], steps=2,"
              " out=Path(sys.argv[1]), overrides=[])\nprint(bench._probe_plugin(), bench._runs(opts))\n"
              "print([m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=base_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs, heavy = proc.stdout.splitlines()
    assert runs == "bench_probe [(1, 'FULL_SHARD', True), (2, 'FULL_SHARD', False), (2, 'NO_SHARD', False)]"
    assert heavy == "[]"


def _module_of(path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _imports(path, modules: set[str]) -> set[str]:
    """The hfsdp modules ``path`` imports, wherever the import stands: at module level, inside functions (lazy), under
    ``if TYPE_CHECKING`` (a type is a dependency too), absolute or relative."""
    tree = ast.parse(path.read_text())
    own = _module_of(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]

    def known(name: str) -> str | None:  # the module itself, or the package that holds the name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base == "hfsdp" or base.startswith("hfsdp."):
                subs = {f"{base}.{a.name}" for a in node.names} & modules
                found |= subs
                if len(subs) < len(node.names):
                    found.add(known(base))
    return found - {own, None}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_of(p) for p in paths}
    return {_module_of(p): _imports(p, modules) for p in paths}


# The layers, bottom first, as pyproject.toml writes them down ([[tool.hfsdp.layers]]).
LAYERS = tuple((layer["name"], tuple(layer["modules"]))
               for layer in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hfsdp"]["layers"])


def _layer(module: str) -> int:
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def test_every_import_points_down_the_layers():
    graph = _graph()
    assert graph["hfsdp.run.loop"] and graph["hfsdp.config.validate"], "the import scan finds nothing"
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {n} ({LAYERS[_layer(n)][0]})"
              for m, targets in sorted(graph.items()) for n in sorted(targets) if _layer(n) > _layer(m)]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def _loops(graph: dict[str, set[str]]) -> list[str]:
    """Each path of ``graph`` from a node's import back to itself, written ``a -> b -> a``."""
    loops = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    loops.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return sorted(set(loops))


def test_no_module_imports_itself_back():
    loops = _loops(_graph())
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_no_package_imports_itself_back_through_another():
    """The packages of hfsdp (``hfsdp.X``) import each other without a loop, imports inside functions and under
    ``TYPE_CHECKING`` counted: a layer of the table above holds packages that never lean on each other both ways (the
    config, the rules and the decided run were a loop of three, model, parallel and data another)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        packages.setdefault(package(module), set()).update(package(t) for t in targets if package(t) != package(module))
    loops = _loops(packages)
    assert not loops, "package loops:\n" + "\n".join(loops)


# What ``hfsdp validate --no-rows`` needs besides hfsdp itself: the schema's, the CLI's and the plugin host's packages.
LIGHT_PACKAGES = ("pydantic", "pydantic_core", "typing_extensions.py", "annotated_types", "typing_inspection", "yaml",
                  "click", "pluggy")


def test_validate_no_rows_answers_on_an_interpreter_without_torch(tmp_path):
    """``hfsdp validate --no-rows`` needs no torch at all, not only no import of it: on an interpreter whose path
    holds hfsdp and its light dependencies but no torch (nor its metadata), a config is validated (exit 0) and a
    wrong one refused with its problems (exit 2). (The optimizer's rule looked for torch's pip name and crashed.)"""
    import site

    packages = Path(site.getsitepackages()[0])
    light = tmp_path / "light"
    light.mkdir()
    for name in LIGHT_PACKAGES + tuple(p.name for p in packages.glob("hfsdp-*.dist-info")):
        (light / name).symlink_to(packages / name)
    config = tmp_path / "config.yaml"
    config.write_text(f"base: tiny\ntrain: {{report_to: none, output_dir: {tmp_path / 'run'}}}\n")
    script = ("import sys, importlib.util\nassert importlib.util.find_spec('torch') is None\n"
              "from hfsdp.cli import cli\ncli(['validate', '--no-rows', *sys.argv[1:]], prog_name='hfsdp')\n")
    env = {**base_env(), "PYTHONPATH": f"{light}{os.pathsep}{REPO}"}
    good = subprocess.run([sys.executable, "-S", "-c", script, str(config)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert good.returncode == 0 and "optimizer: adamw" in good.stdout, good.stderr[-3000:]
    bad = subprocess.run([sys.executable, "-S", "-c", script, str(config), "--set", "train.optimizer_args.nope=1"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "train.optimizer_args.nope: unknown argument of adamw" in bad.stderr, bad.stderr


def test_hfsdp_train_enters_the_config_the_rules_and_the_decided_run_once_each_in_that_order(tmp_path):
    """One way through the decision: the config is read and validated by its schemas (``hfsdp.config``'s files and
    validation), the rule table checks it against its data, the world, a trial and the model (``hfsdp.rules``), and
    the run is decided (``hfsdp.setup``), each entered once, in that order (the config's own methods, its schema's,
    are the value's, not a stage). Traced as ``hfsdp train`` runs, up to the training itself."""
    script = f"""
import sys
from hfsdp.run import loop

STAGES = {{"hfsdp.config.files": "config", "hfsdp.config.validate": "config", "hfsdp.rules": "rules",
          "hfsdp.setup": "setup"}}
entered = []

def profile(frame, event, arg):
    if event != "call":
        return
    module = frame.f_globals.get("__name__", "")
    stage = next((s for m, s in STAGES.items() if module == m or module.startswith(m + ".")), None)
    if stage and (not entered or entered[-1] != stage):
        entered.append(stage)

def trains(setup, host, opts):
    sys.setprofile(None)
    print("ENTERED", entered)
    raise SystemExit(0)

loop.train = trains
from hfsdp.cli import cli
sys.setprofile(profile)
cli(["train", {str(_tiny_config(tmp_path))!r}], prog_name="hfsdp")
"""
    proc = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ENTERED ['config', 'rules', 'setup']" in proc.stdout, proc.stdout[-2000:]


def _tiny_config(tmp_path):
    from conftest import tiny_config

    return tiny_config(tmp_path, plugins=["lora"])  # a plugin with rules of its own, in the config and model phases
