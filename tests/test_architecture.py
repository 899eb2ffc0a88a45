"""The tree keeps its shape: the config and rules packages are torch-free, and no module imports itself back
through others (imports inside functions count; ``TYPE_CHECKING`` imports, which never run, do not)."""

import ast
import subprocess
import sys

from conftest import REPO, base_env

PACKAGE = REPO / "hfsdp"


def test_validate_no_rows_of_every_example_and_preset_config_imports_no_torch():
    """``hfsdp validate --no-rows`` promises an answer without torch, transformers or accelerate: on every shipped
    config, QLoRA, DPO and GRPO included (a QLoRA config imported torch through config -> quantization -> fsdp)."""
    configs = sorted(str(p) for p in (REPO / "examples").glob("*.yaml"))
    configs += sorted(p.stem for p in (PACKAGE / "config" / "presets").glob("*.yaml"))
    script = ("import sys\nfrom hfsdp.cli import cli\nfor config in sys.argv[1:]:\n"
              "    try:\n        cli(['validate', '--no-rows', config], prog_name='hfsdp')\n"
              "    except SystemExit as e:\n        assert not e.code, (config, e.code)\n"
              "    heavy = [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]\n"
              "    print('HEAVY', config, heavy, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", script, *configs], env=base_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY")]
    assert len(lines) == len(configs) and any("qlora" in line for line in lines), proc.stderr[-3000:]
    assert all(line.endswith(" []") for line in lines), "\n".join(lines)


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
    """The hfsdp modules ``path`` imports, at module level or inside functions, not under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("hfsdp"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or ({node.module} & modules)
            if subs and len(subs) < len(node.names) and node.module in modules:
                found.add(node.module)
    return found - {_module_of(path)}


def test_no_module_imports_itself_back():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_of(p) for p in paths}
    graph = {_module_of(p): _imports(p, modules) for p in paths}
    assert graph["hfsdp.run.loop"] and graph["hfsdp.config.validate"], "the import scan finds nothing"
    loops = []
    for start in graph:  # a path from a module's import back to itself
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    loops.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not loops, "import loops:\n" + "\n".join(sorted(set(loops)))
