"""Data at scale (issue 25): ``data.datasets`` mixtures, shards, and a preprocessing that no collective waits on.

* The mixture plan, as a pure function (:class:`hfsdp.data.batches.Mixture` in :class:`hfsdp.data.batches.BatchPlan`): shares
  realised over 1,000 steps within 2 % of the weights (by weight and by epochs), the same global batches on any
  world size and from a fresh plan at any step, and a one-source list that is the single-source plan itself.
* Real processes: 2 gloo ranks with ``train.collective_timeout_s: 20`` and a source whose format (a test plugin)
  takes longer than that to tokenize still train; the summary reports each source; the run's step-1 checkpoint
  resumed on 1 rank (another world size; the same world is in test_combinations' resume matrix) gives the same
  losses as the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from conftest import PRESET_DATA, base_env, read_metrics, run_cli, run_torchrun, step_losses, tiny_config
from hfsdp.data import batches
from hfsdp.data import cache as data_cache
from hfsdp.config.schema import DataConfig

STEPS = 1000


def _plan(rows: list[int], datasets: list[dict], world: int = 1, accumulation: int = 1, lengths=None):
    cfg = DataConfig(datasets=[{"path": f"s{i}.jsonl", **d} for i, d in enumerate(datasets)])
    return batches.BatchPlan(sum(rows), 2, world, accumulation, seed=3, lengths=lengths,
                          mixture=batches.Mixture.of(cfg, rows))


@pytest.mark.parametrize("rows, datasets, expected", [
    ([3000, 500], [{"weight": 3}, {"weight": 1}], [0.75, 0.25]),  # the small source repeats: weights decide
    ([700, 300, 90], [{"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}], [0.5, 0.3, 0.2]),
    ([600, 300], [{"epochs": 1}, {"epochs": 2}], [0.5, 0.5]),  # no weights: each source's rows, epochs times
])
def test_shares_over_1000_steps_are_the_weights(rows, datasets, expected):
    plan = _plan(rows, datasets, world=2, accumulation=2)  # global batch 8: 8,000 rows
    counts = plan.source_counts(STEPS)
    assert sum(counts) == STEPS * plan.global_batch
    for count, share in zip(counts, expected):
        assert abs(count / sum(counts) - share) < 0.02
    # counted from the rows the plan hands out, rank by rank and micro-batch by micro-batch
    seen = [0] * len(rows)
    for step in range(STEPS):
        for micro in range(2):
            for rank in range(2):
                for source in plan.mixture.source_of(plan.rows(step, micro, rank)):
                    seen[source] += 1
    assert seen == counts


def test_rows_of_a_step_depend_only_on_seed_step_and_global_batch():
    datasets = [{"weight": 3}, {"weight": 1}]
    one = _plan([50, 30], datasets, world=1, accumulation=4)
    two = _plan([50, 30], datasets, world=2, accumulation=2)
    late = _plan([50, 30], datasets, world=4, accumulation=1)  # a fresh plan asked for late steps first
    for step in (37, 5, 0, 120):
        expected = [r for m in range(4) for r in one.rows(step, m, 0)]
        assert [r for m in range(2) for k in range(2) for r in two.rows(step, m, k)] == expected
        assert [r for k in range(4) for r in late.rows(step, 0, k)] == expected
    # an epoch (80 positions) of weights 3:1: 60 rows of source 0 (all 50, 10 twice), 20 of source 1's 30
    order = one._order(0)
    assert {r for r in order if r < 50} == set(range(50)) and len({r for r in order if r >= 50}) == 20


def test_one_source_list_is_the_single_source_plan():
    lengths = [(7 * i) % 23 + 1 for i in range(45)]
    for grouped in (None, lengths):
        alone = batches.BatchPlan(45, 2, 2, 1, seed=3, lengths=grouped)
        listed = _plan([45], [{}], world=2, lengths=grouped)
        assert [alone.rows(s, 0, r) for s in range(60) for r in (0, 1)] == \
            [listed.rows(s, 0, r) for s in range(60) for r in (0, 1)]


# A test plugin (on PYTHONPATH): the chat format, slower than the collective timeout once per batch of rows.
SLOW_PLUGIN = '''
    import time
    from hfsdp import hookimpl
    from hfsdp.builtin.chat import tokenize_chat

    def tokenize_slowly(batch, tokenizer, data_config):
        time.sleep(22)  # > train.collective_timeout_s: 20
        return tokenize_chat(batch, tokenizer, data_config)

    @hookimpl
    def hfsdp_dataset_formats():
        return {"slow_chat": tokenize_slowly}
'''
TRAIN = {"max_steps": 3, "save_every": 1, "keep_last": None, "lr_scheduler": "constant", "eval_at_start": False,
         "max_eval_batches": 1, "export_final": False, "per_device_batch_size": 2, "collective_timeout_s": 20}


@pytest.fixture(scope="module")
def slow_mixture(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("mixture")
    (root / "mods").mkdir()
    (root / "mods" / "slow_format.py").write_text(textwrap.dedent(SLOW_PLUGIN))
    rows = (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines(keepends=True)
    for k in range(3):  # a source of three shards
        (root / "shards").mkdir(exist_ok=True)
        (root / "shards" / f"part-{k}.jsonl").write_text("".join(rows[k * 100:(k + 1) * 100]))
    (root / "slow.jsonl").write_text("".join(rows[600:700]))
    env = base_env(PYTHONPATH=str(root / "mods"), HFSDP_CACHE_DIR=str(root / "cache"))  # a cold cache
    shutil.copytree(tiny_model_dir, root / "cache" / "smollm2-tiny")  # (built first where no test has yet)
    sections = {"plugins": ["slow_format"], "train": TRAIN,
                # num_proc 1: the claim is the collective timeout, not the pool; a datasets pool forked on a rank
                # with gloo's threads running hung CI 3 times in 14 (a defunct worker, its task never returned).
                "data": {"path": None, "num_proc": 1,
                         "datasets": [{"path": str(root / "shards" / "*.jsonl"), "weight": 3},
                                      {"path": str(root / "slow.jsonl"), "format": "slow_chat", "weight": 1}]}}
    (root / "x2").mkdir()
    first = run_torchrun(2, "train", str(tiny_config(root / "x2", **sections)), env=env)
    resumed_dir = root / "x1"
    shutil.copytree(root / "x2" / "run" / "checkpoints" / "step-1", resumed_dir / "run" / "checkpoints" / "step-1")
    resumed = run_cli("train", str(tiny_config(resumed_dir, **sections)), "--resume", env=env)
    return {"root": root, "first": first.stdout + first.stderr, "resumed": resumed.stdout + resumed.stderr}


@pytest.mark.slow
def test_two_ranks_train_through_a_preprocessing_longer_than_the_collective_timeout(slow_mixture):
    run = slow_mixture["root"] / "x2" / "run"
    assert [m["step"] for m in read_metrics(run) if "loss" in m] == [1, 2, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["preprocess_s"] > 22  # the slow source was tokenized in this run, not read from a cache
    sources = summary["data"]["sources"]
    assert [(s["path"].split("/")[-1], s["rows"], s["share_planned"]) for s in sources] == \
        [("*.jsonl", 300, 0.75), ("slow.jsonl", 100, 0.25)]
    assert sum(s["share_realised"] for s in sources) == pytest.approx(1.0)
    assert all(s["tokens"] > 50 * s["rows"] for s in sources)  # chat rows of ~80 tokens
    realised = f"{sources[1]['share_realised']:.1%} of the rows of the run's 3 steps"
    assert f"source 1: {slow_mixture['root']}/slow.jsonl (slow_chat): 100 rows" in slow_mixture["first"]
    assert f"share planned 25.0%, {realised}" in slow_mixture["first"]


@pytest.mark.slow
def test_a_mixture_resumed_on_another_world_size_trains_on_the_same_rows(slow_mixture):
    root = slow_mixture["root"]
    assert "resuming a run of 2 rank(s) on 1" in slow_mixture["resumed"]
    assert "preprocessing cache hit" in slow_mixture["resumed"]
    reference, resumed = step_losses(root / "x2" / "run"), step_losses(root / "x1" / "run")
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5)


def _tiny_entry():
    import datasets

    return datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]})}), \
        {"sources": [1]}


def test_waiters_poll_for_the_builders_entry_and_share_its_failure(tmp_path):
    """The node's builder writes the entry (temp folder, fsync, rename) while a waiter polls the folder; a builder
    that fails leaves no entry, and its error reaches the waiters of the same run through the failure marker."""
    from concurrent.futures import ThreadPoolExecutor

    from hfsdp.errors import UserError

    def failing():
        raise UserError("data: row 3 is broken")

    with pytest.raises(UserError, match="row 3 is broken"):
        data_cache.load_or_build(tmp_path, "k1", failing, data_cache.Preprocessing(builder=True, run="r1"))
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == ["k1.failed-r1", "k1.lock"]  # no entry
    with pytest.raises(UserError, match="row 3 is broken"):
        data_cache.load_or_build(tmp_path, "k1", failing, data_cache.Preprocessing(builder=False, run="r1"))
    with ThreadPoolExecutor(1) as pool:  # a waiter of another run, started before its builder
        waiter = pool.submit(data_cache.load_or_build, tmp_path, "k1", failing, data_cache.Preprocessing(builder=False, run="r2"))
        built = data_cache.load_or_build(tmp_path, "k1", _tiny_entry, data_cache.Preprocessing(builder=True, run="r2"))
        waited = waiter.result(timeout=60)
    assert built[2] is False and waited[2] is True
    assert waited[0]["train"]["input_ids"] == [[1, 2]] and waited[1] == {"sources": [1]}
    assert not [p for p in (tmp_path / "datasets").iterdir() if ".tmp-" in p.name]  # the temp folder is gone


def test_packing_packs_every_source_of_a_mixture(tmp_path, tiny_model_dir):
    """plugins: [packing] with a file and a folder of shards (issue 34: the second source was compared, unpacked,
    with the first one packed, and the run refused): each source is packed on its own, so every row stays one
    source's and the mixture's shares are of packed rows."""
    from transformers import AutoTokenizer

    from hfsdp.data import prepare as data
    from hfsdp.rules.table import load_checked

    rows = (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "shards").mkdir()
    for k in range(2):
        (tmp_path / "shards" / f"part-{k}.jsonl").write_text("".join(rows[k * 60:(k + 1) * 60]))
    (tmp_path / "a.jsonl").write_text("".join(rows[200:500]))
    config, host = load_checked(str(tiny_config(
        tmp_path, plugins=["packing"],
        data={"path": None, "max_seq_len": 256, "datasets": [{"path": str(tmp_path / "a.jsonl"), "weight": 2},
                                                             {"path": str(tmp_path / "shards"), "weight": 1}]})))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, _, _, report = data.prepare_datasets(config, host, tokenizer, tmp_path / "cache")
    assert sorted(train.column_names) == ["input_ids", "labels", "position_ids"]
    sources = report["sources"]
    assert [s["share_planned"] for s in sources] == pytest.approx([2 / 3, 1 / 3])
    assert 0 < sources[0]["rows"] < 300 and 0 < sources[1]["rows"] < 120, sources  # ~3 samples a packed row
    assert len(train) == sources[0]["rows"] + sources[1]["rows"]
    # a packed row of source 1 holds source 1's samples only: its tokens are the shards' tokens, packed
    packed = train.select(range(sources[0]["rows"], len(train)))
    starts = sum(pos.count(0) for pos in packed["position_ids"])
    assert starts == 120  # every sample of the two shards, each starting at position 0
