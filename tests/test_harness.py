"""``hfsdp eval``: lm-evaluation-harness on the exported model, sharded over the ranks (hfsdp.tools.harness)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import CACHE_DIR, REPO, base_env, fake_checkpoint, run_cli, run_torchrun

TASK = "contacts_mc"


def _run_folder(tmp_path: Path, model: Path) -> Path:
    """A run folder as training leaves it: the export in final/ beside summary.json."""
    run = tmp_path / "run"
    shutil.copytree(model, run / "final")
    (run / "summary.json").write_text(json.dumps({"steps": 4}))
    return run


@pytest.fixture(scope="module")
def lm_evals_own(tiny_model_dir) -> dict:
    """``lm_eval.simple_evaluate`` on the folder, as its own command line would load it (``model=hf``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hfsdp.tools.harness import BUNDLED_TASKS, scores

    results = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(tiny_model_dir), "device": "cpu"}, tasks=[TASK],
                                      batch_size=8, task_manager=TaskManager(include_path=str(BUNDLED_TASKS)))
    return {"scores": scores(results), "n_samples": results["n-samples"]}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.full_matrix), 2])
def test_hfsdp_eval_gives_what_lm_eval_gives_on_the_exported_folder(tmp_path, tiny_model_dir, lm_evals_own, nproc):
    """The bundled multiple-choice task's accuracy, normalized accuracy and their standard errors, exactly lm-eval's
    on the same folder, on one process and on 2 gloo ranks (the model sharded, each rank half the requests); the
    results land beside the model and in the run's summary.json."""
    run = _run_folder(tmp_path, tiny_model_dir)
    args = ("eval", str(run), "--tasks", TASK, "--batch-size", "8")
    proc = run_cli(*args) if nproc == 1 else run_torchrun(nproc, *args)
    written = json.loads((run / "final" / "eval_results.json").read_text())
    assert written["scores"] == lm_evals_own["scores"], (written["scores"], lm_evals_own["scores"])
    assert written["n_samples"] == lm_evals_own["n_samples"] == {TASK: {"original": 64, "effective": 64}}
    assert 0 < written["scores"][TASK]["acc,none"] < 1  # a random tiny model: the claim is equality, not skill
    assert written["ranks"] == nproc
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["lm_eval"] == written
    assert f"|{TASK}|" in proc.stdout.replace(" ", "") and "eval_results.json" in proc.stdout


LOADING = threading.Lock()  # transformers' from_pretrained is not safe on two threads at once (its meta device)


def _sharded_on_threads(rank: int) -> dict:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from hfsdp.model.loading import resolve_model_path
    from hfsdp.layout.degrees import World
    from hfsdp.tools.harness import shard

    with LOADING:
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-tiny", CACHE_DIR))
    model = shard(model, World(rank=rank, size=2, local_size=2, on_cpu=True))
    params = list(model.parameters())
    return {"all_sharded": all(isinstance(p, DTensor) and p.placements[0].is_shard(0) for p in params),
            "local": sum(p.to_local().numel() for p in params), "whole": sum(p.numel() for p in params)}


def test_every_weight_is_sharded_over_the_ranks_each_keeping_about_half():
    """2 ranks (threads): every parameter a DTensor sharded on dim 0; a rank holds about half the elements."""
    from threaded_ranks import on_threads
    from transformers import AutoModelForCausalLM  # noqa: F401 (transformers' lazy import, once, before the threads)

    ranks = on_threads(2, _sharded_on_threads)
    assert all(r["all_sharded"] for r in ranks), ranks
    assert sum(r["local"] for r in ranks) == ranks[0]["whole"]
    assert all(abs(r["local"] / r["whole"] - 0.5) < 0.01 for r in ranks), ranks


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("not a model", "is not a model folder"),
    ("adapters only", "--merge-lora"),
    ("a LoRA run", "final holds LoRA adapters only"),
    ("unknown task", "no such lm-eval task (close: contacts_mc)"),
    ("include path", "not a folder"),
    ("hub task", "a task's documents could not be loaded (ConnectionError"),
])
def test_bad_eval_input_is_refused_before_any_weight_loads(tmp_path, tiny_model_dir, case, expected):
    """Each refused with what is wrong and its fix, exit 2, no traceback, nothing written."""
    folder, extra = tmp_path / "model", []
    if case == "not a model":
        folder.mkdir()
        (folder / "notes.txt").write_text("hi")
    elif case == "adapters only":
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
    elif case == "a LoRA run":
        (folder / "final").mkdir(parents=True)
        (folder / "final" / "adapter_config.json").write_text("{}")
    elif case in ("unknown task", "include path", "hub task"):
        folder = tiny_model_dir
    task = {"unknown task": "contacts_m", "hub task": "hellaswag"}.get(case, TASK)
    if case == "include path":
        extra = ["--include-path", str(tmp_path / "no-tasks-here")]
    # offline at once (the machines here have no hub; elsewhere the hub's retries would take a minute)
    proc = run_cli("eval", str(folder), "--tasks", task, *extra, check=False, env=base_env(HF_HUB_OFFLINE="1"))
    assert proc.returncode == 2
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr
    assert not (folder / "eval_results.json").exists()


@pytest.mark.slow
def test_the_model_card_says_what_was_trained_and_takes_the_eval_results(tmp_path, tiny_model_dir):
    """``hfsdp export`` writes README.md, a card huggingface_hub reads (its metadata, its training table);
    ``hfsdp eval`` puts its scores into the card's model-index and text, and the export's record lists what eval
    wrote, so ``--overwrite`` may replace the folder (an edited card it refuses: tests/test_export.py)."""
    import torch
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    ckpt = fake_checkpoint(tmp_path / "run" / "checkpoints" / "step-1", tiny_model_dir)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    torch.save(weights, ckpt / "pytorch_model_fsdp.bin")
    out = tmp_path / "exported"
    run_cli("export", str(ckpt), str(out), "--set", "train.warmup_steps=1")
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and "hfsdp" in card.data.tags
    assert "| base model | `smollm2-tiny` |" in card.text and "| optimizer steps | 1" in card.text
    # the bundled data by its name (not a path inside site-packages), one warm-up step in the singular
    assert "| data | `contacts_train.jsonl` (bundled with hfsdp) (chat) |" in card.text, card.text
    assert "| learning rate | 0.003 (cosine, 1 warm-up step), adamw |" in card.text, card.text
    assert "Not evaluated with lm-evaluation-harness yet" in card.text

    run_cli("eval", str(out), "--tasks", TASK, "--limit", "8")
    scores = json.loads((out / "eval_results.json").read_text())["scores"][TASK]
    card = ModelCard.load(out / "README.md")
    assert {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results} == {
        (TASK, "acc"): scores["acc,none"], (TASK, "acc_norm"): scores["acc_norm,none"]}
    assert f"| {TASK} | acc | {scores['acc,none']:.4f} | {scores['acc_stderr,none']:.4f} |" in card.text
    assert "Not evaluated" not in card.text and "## Use" in card.text

    run_cli("export", str(ckpt), str(out), "--overwrite")  # eval's files are the export's: replaced
    assert not (out / "eval_results.json").exists()
    assert "Not evaluated with lm-evaluation-harness yet" in (out / "README.md").read_text()


@pytest.mark.slow
def test_a_generation_task_of_your_own_on_two_ranks_gives_what_lm_eval_gives(tmp_path, tiny_untied_model_dir):
    """A task from --include-path that generates (greedy, until an "e" or an "a"): 2 ranks, each generating for its
    share of the prompts, the one whose answers end first stepping on until the other's have (FSDP gathers in every
    forward: without transformers' synced_gpus the job fails), score as lm-eval on one process. The random tiny
    model (untied: its answers differ from prompt to prompt) answers nonsense; the claim is the same answers."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hfsdp.tools.harness import scores

    data = REPO / "hfsdp" / "config" / "presets" / "data" / "contacts_prompts_eval.jsonl"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "contacts_gen.yaml").write_text(f"""task: contacts_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt[0].content}}}}\\nJSON:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["e", "a"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: chrf
    aggregation: chrf
    higher_is_better: true
metadata:
  version: 1.0
""")
    model = tmp_path / "model"
    shutil.copytree(tiny_untied_model_dir, model)
    run_torchrun(2, "eval", str(model), "--tasks", "contacts_gen", "--include-path", str(tasks),
                 "--limit", "6", "--batch-size", "4")
    ours = json.loads((model / "eval_results.json").read_text())
    theirs = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(tiny_untied_model_dir), "device": "cpu"},
                                     tasks=["contacts_gen"], batch_size=4, limit=6,
                                     task_manager=TaskManager(include_path=str(tasks)))
    ours, theirs = ours["scores"]["contacts_gen"], scores(theirs)["contacts_gen"]
    # chrF's standard error is lm-eval's bootstrap over the samples, which come back in the ranks' order: close only
    bootstrapped = "chrf_stderr,none"
    assert {k: v for k, v in ours.items() if k != bootstrapped} == {k: v for k, v in theirs.items() if k != bootstrapped}
    assert ours[bootstrapped] == pytest.approx(theirs[bootstrapped], rel=0.1)
    assert ours["chrf,none"] > 0  # characters in common: the answers' text is compared, not only exact matches


def test_scores_that_cannot_be_written_are_printed_then_said(tmpfs, tiny_model_dir):
    """A model folder on a read-only disk: the table is printed, then one error line says the scores could not be
    written and where to evaluate instead; exit 2, no traceback."""
    disk = tmpfs("disk", 64)
    model = disk / "model"
    shutil.copytree(tiny_model_dir, model)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    proc = run_cli("eval", str(model), "--tasks", TASK, "--limit", "4", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"|{TASK}|" in proc.stdout.replace(" ", "")
    assert "the scores are above, but they could not be written into" in proc.stderr
    assert "Read-only file system" in proc.stderr and not (model / "eval_results.json").exists()
