"""Third-party plugins: discovery (entry points and dotted paths), the errors a plugin author or user can make, the
example packages in plugins/, and the minimal plugin of docs/plugins.md — installed with pip, then used in a run."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import PRESET_DATA, REPO, base_env, run_cli, run_torchrun, step_losses, tiny_config


def _module(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if body.startswith(HEADER):
        body = HEADER + textwrap.dedent(body[len(HEADER):])
    (folder / f"{name}.py").write_text(body)


def _validate(tmp_path: Path, plugins: list[str], **sections) -> subprocess.CompletedProcess:
    config = tiny_config(tmp_path, plugins=plugins, **sections)
    return run_cli("validate", str(config), env=base_env(PYTHONPATH=str(tmp_path / "mods")), check=False)


HEADER = "import hfsdp\nfrom hfsdp import hookimpl\n"


@pytest.mark.parametrize("case, body, expected", [
    ("unknown_plugin", None, "plugin 'nosuch_plugin_xyz' is neither an installed plugin nor an importable module"),
    ("import_error", "import not_a_module_anywhere\n",
     "plugin 'import_error' is neither an installed plugin nor an importable module: ModuleNotFoundError"),
    ("misspelt_hook", HEADER + "@hookimpl\ndef hfsdp_on_evl(run):\n    pass\n",
     "function 'hfsdp_on_evl' is not an hfsdp hook (misspelt?)"),
    ("unmarked_hook", HEADER + "def hfsdp_on_eval(run, step, metrics):\n    pass\n",
     "function 'hfsdp_on_eval' is named like a hook but lacks the @hfsdp.hookimpl marker"),
    ("wrong_argument", HEADER + "@hookimpl\ndef hfsdp_on_eval(run, stepp):\n    pass\n",
     "plugin 'wrong_argument' does not match the hook specs"),
    ("bad_section", HEADER + "@hookimpl\ndef hfsdp_config_section():\n    return 'bad', dict\n",
     "hfsdp_config_section must return (section_name, pydantic model class)"),
    ("core_section", HEADER + "from pydantic import BaseModel\n@hookimpl\ndef hfsdp_config_section():\n"
                              "    return 'train', BaseModel\n", "plugin 'core_section' declares section 'train'"),
])
def test_plugin_problems_are_config_errors_naming_the_plugin(tmp_path, case, body, expected):
    name = "nosuch_plugin_xyz" if body is None else case
    if body is not None:
        _module(tmp_path / "mods", case, body)
    proc = _validate(tmp_path, [name])
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_plugin_section_is_validated_by_its_schema(tmp_path):
    _module(tmp_path / "mods", "sectioned", HEADER + """
        from pydantic import BaseModel, ConfigDict, Field
        class Cfg(BaseModel):
            model_config = ConfigDict(extra="forbid")
            every: int = Field(1, gt=0)
        @hookimpl
        def hfsdp_config_section():
            return "sectioned", Cfg
    """)
    proc = _validate(tmp_path, ["sectioned"], sectioned={"evrey": 2, "every": 0})
    assert proc.returncode == 2
    assert "sectioned.evrey: unknown key" in proc.stderr and "sectioned.every: Input should be greater than 0" in proc.stderr
    assert proc.stderr.count("[section of plugin 'sectioned']") == 2
    proc = _validate(tmp_path, [], sectioned={"every": 2})
    assert proc.returncode == 2 and "sectioned: unknown section" in proc.stderr
    assert _validate(tmp_path, ["sectioned"], sectioned={"every": 2}).returncode == 0


def test_two_plugins_claiming_one_format(tmp_path):
    for name in ("fmt_a", "fmt_b"):
        _module(tmp_path / "mods", name, HEADER + "@hookimpl\ndef hfsdp_dataset_formats():\n"
                                                  "    return {'qa2': lambda batch, tokenizer, data_config: None}\n")
    proc = _validate(tmp_path, ["fmt_a", "fmt_b"])
    assert proc.returncode == 2
    assert "format 'qa2' is registered by two plugins: 'fmt_a' and 'fmt_b'" in proc.stderr
    # and a plugin may not take over a built-in format silently either
    _module(tmp_path / "mods", "fmt_chat", HEADER + "@hookimpl\ndef hfsdp_dataset_formats():\n"
                                                   "    return {'chat': lambda batch, tokenizer, data_config: None}\n")
    proc = _validate(tmp_path, ["fmt_chat"])
    assert proc.returncode == 2 and "'chat' is registered by two plugins: 'chat' and 'fmt_chat'" in proc.stderr


@pytest.mark.slow
def test_plugin_raising_in_a_hook_fails_the_run_naming_plugin_and_hook(tmp_path):
    _module(tmp_path / "mods", "boom", HEADER + """
        @hookimpl
        def hfsdp_transform_dataset(dataset):
            raise ValueError("kaputt")
    """)
    config = tiny_config(tmp_path, plugins=["boom"])
    proc = run_cli("train", str(config), env=base_env(PYTHONPATH=str(tmp_path / "mods")), check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "plugin 'boom' failed in hook 'hfsdp_transform_dataset': ValueError: kaputt" in proc.stderr


def test_hfsdp_plugins_lists_builtins_and_path_plugins(tmp_path):
    _module(tmp_path / "mods", "listed", HEADER + "__version__ = '1.2.3'\n@hookimpl\ndef hfsdp_on_eval(run):\n    pass\n")
    proc = run_cli("plugins", "--enable", "listed", env=base_env(PYTHONPATH=str(tmp_path / "mods")))
    lines = proc.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines if line and not line.startswith(" ")}
    assert "built-in" in rows["chat"] and "always on" in rows["chat"]
    assert "built-in" in rows["safetensors_export"] and "always on" in rows["safetensors_export"]  # name configs use
    assert "built-in" in rows["preference"] and "always on" in rows["preference"]
    for name in ("lora", "packing", "dpo"):
        assert "built-in" in rows[name] and "enable in `plugins:`" in rows[name]
    assert "hfsdp_objective" in lines[lines.index(rows["dpo"]) + 1]
    assert re.search(r"listed\s+1\.2\.3\s+path", rows["listed"])
    hooks = lines[lines.index(rows["lora"]) + 1]
    assert "hfsdp_modify_model" in hooks and "hfsdp_export" in hooks and "hfsdp_config_section" in hooks


def test_export_helpers_keep_their_documented_module_name():
    """The guide named ``hfsdp.components.export`` for ``write_hf_folder``/``ModelFiles`` before the module became
    ``hfsdp.export.hf_folder``: the old name still imports them, with a DeprecationWarning."""
    from hfsdp.export import hf_folder

    with pytest.warns(DeprecationWarning, match="hfsdp.components.export is now hfsdp.export.hf_folder"):
        sys.modules.pop("hfsdp.components.export", None)
        from hfsdp.components.export import ModelFiles, write_hf_folder
    assert (write_hf_folder, ModelFiles) == (hf_folder.write_hf_folder, hf_folder.ModelFiles)


# ---- installed packages: the two examples in plugins/, the minimal plugin of docs/plugins.md, and a broken one


def docs_minimal_plugin() -> dict[str, str]:
    text = (REPO / "docs" / "plugins.md").read_text()
    blocks = dict(re.findall(r"<!-- minimal-plugin: (\S+) -->\n```\w*\n(.*?)```", text, flags=re.S))
    assert set(blocks) == {"hfsdp_hello.py", "pyproject.toml"}, blocks.keys()
    return blocks


def _install(tmp: Path, sources: list[Path]) -> Path:
    """pip-installs the packages into a folder of their own (real wheels, dist-info, entry points; no network, and the
    shared venv stays untouched) that the runs put on PYTHONPATH."""
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), *map(str, sources)], check=True, timeout=300,
                   capture_output=True)
    return site


def _copy_packages(root: Path, tmp: Path, hello: dict[str, str]) -> list[Path]:
    sources = []
    for name in ("hfsdp-csv-qa", "hfsdp-eval-log"):
        shutil.copytree(root / name, tmp / "src" / name)  # builds leave files next to the sources
        sources.append(tmp / "src" / name)
    (tmp / "src" / "hfsdp-hello").mkdir(parents=True)
    for filename, content in hello.items():
        (tmp / "src" / "hfsdp-hello" / filename).write_text(content)
    return [*sources, tmp / "src" / "hfsdp-hello"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Today's examples (plugins/ and the guide's minimal plugin), plus a broken package."""
    tmp = tmp_path_factory.mktemp("installed")
    sources = _copy_packages(REPO / "plugins", tmp, docs_minimal_plugin())
    broken = tmp / "src" / "hfsdp-broken"
    broken.mkdir()
    (broken / "hfsdp_broken.py").write_text("raise RuntimeError('this plugin is broken on purpose')\n")
    (broken / "pyproject.toml").write_text(docs_minimal_plugin()["pyproject.toml"].replace("hfsdp-hello", "hfsdp-broken")
                                           .replace("hfsdp_hello", "hfsdp_broken").replace("hello =", "broken ="))
    site = _install(tmp, [*sources, broken])
    return {"env": base_env(PYTHONPATH=str(site)), "site": site}


@pytest.fixture(scope="module")
def installed_v1(tmp_path_factory) -> dict:
    """The same examples as first published (tests/plugins_v1), written against the hooks of hfsdp 0.1.0."""
    tmp = tmp_path_factory.mktemp("installed_v1")
    v1 = REPO / "tests" / "plugins_v1"
    hello = {f.name: f.read_text() for f in (v1 / "hfsdp-hello").iterdir()}
    site = _install(tmp, _copy_packages(v1, tmp, hello))
    return {"env": base_env(PYTHONPATH=str(site)), "site": site}


def test_docs_minimal_plugin_is_short():
    code = docs_minimal_plugin()["hfsdp_hello.py"]
    assert len(code.strip().splitlines()) < 30


def test_installed_plugins_are_listed_with_their_distribution(installed):
    proc = run_cli("plugins", env=installed["env"], check=False)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line and not line.startswith(" ")}
    assert re.search(r"csv_qa\s+0\.2\.0\s+entry point \(hfsdp-csv-qa\)", rows["csv_qa"])
    assert re.search(r"eval_log\s+0\.2\.0\s+entry point \(hfsdp-eval-log\)", rows["eval_log"])
    assert re.search(r"hello\s+0\.1\.0\s+entry point \(hfsdp-hello\)", rows["hello"])
    assert "BROKEN" in rows["broken"] and "this plugin is broken on purpose" in rows["broken"]
    assert proc.returncode == 2  # a broken install is worth a non-zero exit of the listing
    # enabling the broken one is a config error naming it; not enabling it leaves other runs alone
    proc = run_cli("validate", str(tiny_config(installed["site"].parent, plugins=["broken"])), env=installed["env"],
                   check=False)
    assert proc.returncode == 2 and "plugin 'broken' failed to import" in proc.stderr


def test_installed_plugins_section_is_named_and_printed_without_enabling_it(installed, tmp_path):
    proc = run_cli("validate", str(tiny_config(tmp_path, eval_log={"style": "markdown"})), env=installed["env"],
                   check=False)
    assert proc.returncode == 2
    assert "eval_log: section of plugin 'eval_log', which is not enabled: enable plugin 'eval_log'" in proc.stderr
    reference = run_cli("config-reference", "eval_log", env=installed["env"]).stdout
    assert reference.startswith("### `eval_log` (plugin `eval_log`: enable with `plugins: [eval_log]`)")
    assert "| `eval_log.file` | `str` | `'eval_log.csv'` | table file, relative to train.output_dir |" in reference


def _qa_rows(rows: int) -> list[tuple[str, str]]:
    out = []
    for line in (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines()[:rows]:
        messages = json.loads(line)["messages"]
        out.append((messages[0]["content"], messages[1]["content"]))
    return out


def _qa_csv(path: Path, rows: int, delimiter: str = ",") -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(["question", "answer"])
        writer.writerows(_qa_rows(rows))
    return path


def test_data_path_is_checked_in_validation_and_a_plugin_reads_its_own_kind(installed, tmp_path):
    tsv = _qa_csv(tmp_path / "qa.tsv", 20, delimiter="\t")
    data = {"format": "qa", "path": str(tsv), "eval_path": None}
    proc = run_cli("validate", str(tiny_config(tmp_path, data={**data, "format": "chat"})), env=installed["env"],
                   check=False)  # no plugin reads .tsv: refused before anything loads, naming the hook that would
    assert proc.returncode == 2 and f"data.path: {tsv}: hfsdp reads .txt" in proc.stderr
    assert "not '.tsv'" in proc.stderr and "hfsdp_data_readers" in proc.stderr
    run_cli("validate", str(tiny_config(tmp_path, plugins=["csv_qa"], data=data)), env=installed["env"])
    missing = {**data, "path": str(tmp_path / "nope.tsv"), "eval_path": str(tmp_path / "nope.jsonl")}
    proc = run_cli("validate", str(tiny_config(tmp_path, plugins=["csv_qa"], data=missing)), env=installed["env"],
                   check=False)
    assert proc.returncode == 2 and "2 problem(s)" in proc.stderr
    assert f"data.path: {tmp_path / 'nope.tsv'} does not exist" in proc.stderr
    assert f"data.eval_path: {tmp_path / 'nope.jsonl'} does not exist" in proc.stderr


def _example_run(env: dict, nproc: int, tmp_path: Path, data_path: Path, plugins: list[str], **sections):
    config = tiny_config(
        tmp_path, plugins=plugins,
        data={"format": "qa", "path": str(data_path), "eval_path": None, "eval_fraction": 0.1, "max_eval_samples": 8},
        train={"max_steps": 4, "eval_every": 2, "learning_rate": 1e-2, "save_every": 4},
        eval_log={"file": "evals.md", "style": "markdown"}, hello={"greeting": "hi"}, **sections,
    )
    if nproc == 1:
        proc = run_cli("train", str(config), env=env)
    else:
        proc = run_torchrun(nproc, "train", str(config), env=env)
    run = tmp_path / "run"
    assert "data: train 180 rows" in proc.stdout + proc.stderr
    losses = step_losses(run)
    assert losses[4] < losses[1]
    table = (run / "evals.md").read_text().splitlines()
    assert table[0] == "| step | eval_loss | eval_ppl | time |" and table[1].startswith("| --- |")
    assert [row.split("|")[1].strip() for row in table[2:]] == ["0", "2", "4"]
    summary = json.loads((run / "summary.json").read_text())
    assert float(table[-1].split("|")[2]) == pytest.approx(summary["after"]["eval_loss"], rel=1e-5)
    assert (run / "hello.txt").read_text().startswith("hi after 4 steps, eval loss ")
    return run


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.full_matrix), 2])
def test_first_published_example_plugins_still_train(installed_v1, tmp_path, nproc):
    """Stability: the examples as written against hfsdp 0.1.0's hooks, unchanged, on one and two ranks."""
    run = _example_run(installed_v1["env"], nproc, tmp_path, _qa_csv(tmp_path / "qa.csv", 200), ["csv_qa", "eval_log", "hello"])
    assert not (run / "final" / "hello.txt").exists()  # the v1 plugins add nothing to exports


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_example_plugins_train_read_tsv_and_add_files_to_every_export(installed, tmp_path, nproc):
    """Today's examples: a .tsv read by csv_qa's reader, its section seen by tokenize, eval_log's table and hello's
    greeting added to the end-of-training export (full weights on one rank, a LoRA adapter on two) and to the
    merged export of `hfsdp export --merge-lora`; hfsdp_export.json lists the added files."""
    plugins = ["csv_qa", "eval_log", "hello"] + (["lora"] if nproc == 2 else [])
    tsv = _qa_csv(tmp_path / "qa.tsv", 200, delimiter="\t")
    run = _example_run(installed["env"], nproc, tmp_path, tsv, plugins, csv_qa={"system": "Answer briefly."})
    final = run / "final"
    writer = "lora" if nproc == 2 else "safetensors_export"
    assert (final / "hello.txt").read_text() == f"hi from {writer}\n"
    assert (final / "evals.md").read_text() == (run / "evals.md").read_text()
    assert (final / ("adapter_model.safetensors" if nproc == 2 else "model.safetensors")).is_file()
    assert {"hello.txt", "evals.md"} <= set(json.loads((final / "hfsdp_export.json").read_text())["files"])
    if nproc == 2:
        merged = tmp_path / "merged"
        run_cli("export", str(run / "checkpoints" / "step-4"), str(merged), "--merge-lora", env=installed["env"])
        assert (merged / "hello.txt").read_text() == "hi from lora\n" and (merged / "model.safetensors").is_file()
        assert (merged / "evals.md").is_file()


def test_tokenize_and_reader_get_their_plugins_section(installed, tmp_path, tiny_model_dir):
    """A tokenize function that declares `section` gets its plugin's validated section; one that does not (the
    built-ins, first-published plugins) is called as before."""
    import importlib

    sys.path.insert(0, str(installed["site"]))
    try:
        from transformers import AutoTokenizer

        from hfsdp.rules.table import load_checked

        tsv = _qa_csv(tmp_path / "qa.tsv", 3, delimiter="\t")
        config, host = load_checked(str(tiny_config(tmp_path, plugins=["csv_qa"], csv_qa={"system": "Be brief."},
                                                   data={"format": "qa", "path": str(tsv), "eval_path": None})))
        owner, tokenize = host.tokenize_function(config)
        assert owner == "csv_qa" and tokenize.section.system == "Be brief."
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        ids = tokenize({"question": ["Q?"], "answer": ["A."]}, tokenizer, config.data)["input_ids"][0]
        assert "Be brief." in tokenizer.decode(ids)
        (plugin, read), = host.data_readers(config).values()
        assert plugin == "csv_qa" and read(str(tsv), "train", config.data)[0]["question"] == _qa_rows(1)[0][0]
        chat_config, chat_host = load_checked(str(tiny_config(tmp_path)))
        assert chat_host.tokenize_function(chat_config)[1].wants_section is False  # the built-in chat format
    finally:
        sys.path.remove(str(installed["site"]))
        for name in [m for m in sys.modules if m.startswith("hfsdp_")]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_qa_format_trains_on_the_answer_only(tiny_model_dir):
    sys.path.insert(0, str(REPO / "plugins" / "hfsdp-csv-qa"))
    try:
        import hfsdp_csv_qa
    finally:
        sys.path.pop(0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = hfsdp_csv_qa.tokenize_qa({"question": ["What is 2+2?"], "answer": ["4"]}, tokenizer, None)
    ids, labels = out["input_ids"][0], out["labels"][0]
    trained = tokenizer.decode([t for t, label in zip(ids, labels) if label != -100])
    assert trained.startswith("4") and "2+2" not in trained


def test_pluggy_orders_and_calls_the_hooks(tmp_path, monkeypatch):
    """pluggy calls the hooks: ``tryfirst``/``trylast`` reorder the plugins of ``plugins:``, a hook wrapper sees
    every implementation's result, a chained hook passes each result on in that order, and a crash still names its
    plugin and hook."""
    from hfsdp.errors import ConfigError, PluginError
    from hfsdp.hooks.host import PluginHost

    mods = tmp_path / "mods"
    _module(mods, "p_first", HEADER + """
        @hookimpl(tryfirst=True)
        def hfsdp_dataset_formats():
            return {"first_fmt": len}

        @hookimpl
        def hfsdp_transform_dataset(dataset):
            return dataset + ["first"]
    """)
    _module(mods, "p_plain", HEADER + """
        @hookimpl
        def hfsdp_dataset_formats():
            return {"plain_fmt": len}

        @hookimpl(tryfirst=True)
        def hfsdp_transform_dataset(dataset, config):
            return dataset + ["plain"]

        @hookimpl
        def hfsdp_on_train_start(run):
            raise RuntimeError("boom")
    """)
    _module(mods, "p_wrapper", HEADER + """
        SEEN = []

        @hookimpl(wrapper=True)
        def hfsdp_dataset_formats():
            results = yield
            SEEN.append([sorted(r) for r in results])
            return results
    """)
    _module(mods, "p_wraps_chain", HEADER + """
        @hookimpl(wrapper=True)
        def hfsdp_modify_model(model):
            return (yield)
    """)
    monkeypatch.syspath_prepend(str(mods))
    host = PluginHost(["p_first", "p_plain", "p_wrapper"])
    order = host.implementers("hfsdp_dataset_formats")  # the wrapper first; tryfirst before the built-ins
    assert order[:2] == ["p_wrapper", "p_first"] and order[-1] == "p_plain", order
    formats = host.dataset_formats()
    assert {"first_fmt", "plain_fmt", "chat", "text", "instruction"} <= set(formats)
    assert formats["first_fmt"][0] == "p_first" and formats["plain_fmt"][0] == "p_plain"
    import p_wrapper

    assert len(p_wrapper.SEEN) == 1 and ["first_fmt"] in p_wrapper.SEEN[0] and ["plain_fmt"] in p_wrapper.SEEN[0]
    assert host.chain("hfsdp_transform_dataset", "dataset", [], config=None, tokenizer=None) == ["plain", "first"]
    with pytest.raises(PluginError, match="plugin 'p_plain' failed in hook 'hfsdp_on_train_start': RuntimeError: boom"):
        host.call("hfsdp_on_train_start", run=None)
    with pytest.raises(ConfigError, match="hfsdp_modify_model is chained .*: a hook wrapper cannot wrap it"):
        PluginHost(["p_wraps_chain"])


def test_a_plugins_rules_join_the_table_in_their_phase(tmp_path, monkeypatch):
    """``hfsdp_rules`` adds rules to hfsdp's own table: a ``config`` rule is reported by ``hfsdp validate`` with the
    core's problems (exit 2, one screen), a ``world`` rule by the table's world phase before the run is decided,
    with its key; a hook returning something else names the plugin."""
    from hfsdp.rules.table import Facts, enforce, load_checked
    from hfsdp.errors import ConfigError
    from hfsdp.layout.degrees import World

    mods = tmp_path / "mods"
    _module(mods, "p_rules", HEADER + """
        from hfsdp.rules.table import Rule

        def _steps(config, facts):
            return [("train.max_steps", "p_rules trains 100 steps at least")] if config.train.max_steps < 100 else []

        def _ranks(config, facts):
            return [("plugins", f"p_rules runs on one rank, not {facts.world.size}")] if facts.world.size > 1 else []

        @hookimpl
        def hfsdp_rules():
            return [Rule("config", ("train.max_steps",), _steps), Rule("world", ("plugins",), _ranks)]
    """)
    _module(mods, "p_bad_rules", HEADER + "@hookimpl\ndef hfsdp_rules():\n    return ['not a rule']\n")
    proc = _validate(tmp_path, ["p_rules"], train={"max_steps": 4, "optimizer_args": {"momentum": 0.9}})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "2 problem(s)" in proc.stderr and "train.max_steps: p_rules trains 100 steps at least" in proc.stderr
    assert "train.optimizer_args.momentum: unknown argument of adamw" in proc.stderr  # the core's, beside it

    monkeypatch.syspath_prepend(str(mods))
    config, host = load_checked(str(tiny_config(tmp_path, plugins=["p_rules"], train={"max_steps": 100})))
    world = World(rank=0, size=2, local_size=2, on_cpu=True)
    with pytest.raises(ConfigError) as refused:
        enforce(config, Facts(host, world), ("world",))
    assert refused.value.problems == [("plugins", "p_rules runs on one rank, not 2")]
    assert enforce(config, Facts(host, World(rank=0, size=1, local_size=1, on_cpu=True)), ("world",)).world.size == 1
    with pytest.raises(ConfigError, match="plugins.p_bad_rules: hfsdp_rules must return a list of"):
        load_checked(str(tiny_config(tmp_path, plugins=["p_bad_rules"])))
