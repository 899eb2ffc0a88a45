"""Packed micro-batches (issue 51, :mod:`hfsdp.data.layout`): which sequences share a row (best-fit decreasing, a
pair never split), and that a packed forward of the shrunk SmolLM2 gives each sequence the log-probs (DPO's, ORPO's
NLL, GRPO's per token) and the reward (the reward model's) it gets one sequence per row. The runs that compare
whole trainings, packed against unpacked, on 1 process and on 2 ranks, are
tests/test_combinations.py::test_packed_micro_batches_compute_the_unpacked_steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import PRESET_DATA

from hfsdp import IGNORE_INDEX
from hfsdp.data.layout import best_fit_decreasing
from hfsdp.objective import MicroBatchLayout


def test_best_fit_decreasing_puts_each_item_in_the_fullest_row_it_fits():
    # longest first: 8 opens row 0, 7 row 1, 5 row 2; 3 fits rows 2 (room 5) and 1 (room 3): the fullest, row 1;
    # 2 fits rows 0 (room 2) and 2: row 0; 1 fits only row 2
    assert best_fit_decreasing([5, 3, 8, 2, 7, 1], 10) == [[2, 3], [1, 4], [0, 5]]
    # an item longer than a row gets one of its own; ties keep the items' order; the result is a pure function
    assert best_fit_decreasing([12, 4, 4, 4], 10) == [[0], [1, 2], [3]]
    lengths = [(37 * i) % 91 + 1 for i in range(500)]
    rows = best_fit_decreasing(lengths, 128)
    assert rows == best_fit_decreasing(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    next_fit, used = 1, 0
    for n in lengths:
        next_fit, used = (next_fit + 1, n) if used + n > 128 else (next_fit, used + n)
    assert len(rows) < next_fit, (len(rows), next_fit)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def pairs(tokenizer, n: int) -> list[dict]:
    """The first ``n`` bundled preference pairs, tokenized (chosen and rejected of other lengths)."""
    from hfsdp.builtin.preference import tokenize_preference
    from hfsdp.config.schema import DataConfig

    rows = [json.loads(line) for line in (PRESET_DATA / "contacts_pref_train.jsonl").read_text().splitlines()[:n]]
    out = tokenize_preference({k: [r[k] for r in rows] for k in rows[0]}, tokenizer,
                              DataConfig(format="preference", path="unused", max_seq_len=256))
    return [{k: out[k][i] for k in out} for i in range(n)]


def packed_and_not(objective, rows, pad_id, select_logits):
    plain = objective.micro_batch(rows, pad_id, torch.device("cpu"), select_logits)
    objective.lay_out(MicroBatchLayout(pack_len=256))
    packed = objective.micro_batch(rows, pad_id, torch.device("cpu"), select_logits)
    objective.lay_out(MicroBatchLayout())
    return plain, packed


@pytest.mark.parametrize("select_logits", [False, True])
def test_a_pair_shares_one_row_and_each_sequence_reads_back_its_own_targets(tiny, select_logits):
    from hfsdp.objective import PreferenceObjective

    _, tokenizer = tiny
    rows = pairs(tokenizer, 5)
    plain, packed = packed_and_not(PreferenceObjective(), rows, tokenizer.pad_token_id, select_logits)
    assert packed.inputs["input_ids"].size(0) < plain.inputs["input_ids"].size(0) == 10
    assert packed.inputs["input_ids"].size(1) <= 256
    row_of = [int(packed.packing.last[s]) // packed.inputs["input_ids"].size(1) for s in range(10)]
    assert all(row_of[i] == row_of[5 + i] for i in range(5)), row_of  # chosen and rejected of a pair: one row
    assert packed.lengths == plain.lengths and packed.num_targets == plain.num_targets
    # each sequence's targets, read back from the packed rows, are its own, in order (the unpacked rows' labelled
    # positions, shifted to start at column 0 where logits_to_keep dropped leading columns)
    for s in range(10):
        mine = packed.sequence_targets[s]
        theirs = plain.sequence_targets[s]
        assert mine[mine != IGNORE_INDEX].tolist() == theirs[theirs != IGNORE_INDEX].tolist()
    assert packed.completion_tokens.tolist() == plain.completion_tokens.tolist()


def test_packed_forwards_give_each_pair_its_unpacked_log_probs(tiny):
    """DPO's completion log-probs (sums of about -350 over a completion), ORPO's NLL over the chosen rows (prompt
    included) and SimPO's average log-probs: within 1e-6 relative, float32's noise of other matrix shapes."""
    from hfsdp.builtin.reference_free.loss import ORPO, SimPO

    model, tokenizer = tiny
    rows = pairs(tokenizer, 4)
    orpo = ORPO(SimpleNamespace(beta=0.1))
    simpo = SimPO(SimpleNamespace(beta=2.0, gamma=0.5, nll_weight=1.0))
    with torch.no_grad():
        for objective in (orpo, simpo):
            plain, packed = packed_and_not(objective, rows, tokenizer.pad_token_id, select_logits=True)
            want, got = (torch.cat(objective.completion_logps(model, batch)) for batch in (plain, packed))
            assert float(want.abs().min()) > 100
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            objective.nll_scale = plain.pairs / plain.nll_tokens  # start_step's: the pairs per NLL token
            losses = [float(objective.loss(model, batch)) for batch in (plain, packed)]
            assert losses[1] == pytest.approx(losses[0], rel=1e-6), losses
            assert packed.nll_tokens == plain.nll_tokens


def test_packed_forwards_give_each_completion_its_unpacked_token_log_probs(tiny):
    """GRPO's rows: prompts with completions of other lengths, left-padded one per row as TRL lays them out, or
    laid end to end: each completion's per-token log-probs and entropies, in order."""
    from hfsdp.builtin.online.rounds import prompt_completion_batch, token_logps
    from hfsdp.objective import Objective

    model, tokenizer = tiny
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (n,), generator=generator).tolist() for n in (9, 14, 9, 14, 20, 20)]
    completions = [torch.randint(5, 400, (n,), generator=generator).tolist() for n in (3, 17, 8, 1, 12, 5)]
    plain = prompt_completion_batch(prompts, completions, tokenizer.pad_token_id, torch.device("cpu"), True)
    objective = Objective()
    objective.lay_out(MicroBatchLayout(pack_len=64))
    packed = objective.collate([{"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c}
                                for p, c in zip(prompts, completions)], [[i] for i in range(6)],
                               tokenizer.pad_token_id, torch.device("cpu"), True)
    assert packed.inputs["input_ids"].numel() < plain.inputs["input_ids"].numel()
    with torch.no_grad():
        values = [token_logps(model, batch, 0.7) for batch in (plain, packed)]
    for batch in (plain, packed):
        assert (batch.sequence_targets != IGNORE_INDEX).sum(1).tolist() == [len(c) for c in completions]
    for s in range(6):
        kept = [(v[0][s][b.sequence_targets[s] != IGNORE_INDEX], v[1][s][b.sequence_targets[s] != IGNORE_INDEX])
                for v, b in zip(values, (plain, packed))]
        torch.testing.assert_close(kept[1][0], kept[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kept[1][1], kept[0][1], rtol=1e-5, atol=1e-5)


def test_a_packed_reward_model_scores_each_sequence_at_its_last_token(tiny):
    """The reward model's head at every position of the packed rows, read at each sequence's last token that is not
    the pad token: where transformers' pooling reads each row of the unpacked micro-batch."""
    from hfsdp.builtin.reward_model.loss import RewardModel, reward_head
    from hfsdp.builtin.reward_model.model import sequence_classifier

    causal, tokenizer = tiny
    model = sequence_classifier(causal, tokenizer.pad_token_id, seed=0).eval()
    objective = RewardModel(SimpleNamespace(margin=False, center_rewards_coefficient=None))
    objective.head = reward_head(model)
    plain, packed = packed_and_not(objective, pairs(tokenizer, 4), tokenizer.pad_token_id, select_logits=False)
    with torch.no_grad():
        want, got = (objective.rewards(model, batch) for batch in (plain, packed))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(want.std()) > 1e-3  # rewards that differ: a wrong position would show


def test_packing_an_objective_that_reads_one_sequence_per_row_is_refused_naming_it(tmp_path):
    """A third-party objective packs when it says so (``packs_micro_batches``, reading per-sequence values through
    ``MicroBatch.per_sequence``); one that does not is refused before any weight loads, naming it. The preference
    objectives' shared base packs, so a third-party loss built on ``completion_logps`` packs too."""
    from conftest import tiny_config

    from hfsdp.rules.table import load_checked
    from hfsdp.errors import ConfigError
    from hfsdp.hooks.host import PluginHost
    from hfsdp.objective import Objective, PreferenceObjective, TokenCrossEntropy, micro_batch_packing

    class OnePerRow(Objective):
        def loss(self, model, batch):
            return model(**batch.inputs).logits[:, -1].sum()

    config, _ = load_checked(str(tiny_config(tmp_path, plugins=["packing"], packing={"scope": "micro_batch"})))
    host = PluginHost(config.plugins)
    assert micro_batch_packing(host, config, TokenCrossEntropy()) == 0  # no limit: the rows that cost least
    assert micro_batch_packing(host, config, PreferenceObjective()) == 0
    with pytest.raises(ConfigError, match="packing packs micro-batches, but the objective OnePerRow reads one "
                                          "sequence per row"):
        micro_batch_packing(host, config, OnePerRow())
    config, _ = load_checked(str(tiny_config(tmp_path, plugins=["packing"])))  # chat rows: packed before training
    assert micro_batch_packing(PluginHost(config.plugins), config, OnePerRow()) is None


def test_a_micro_batch_is_packed_only_where_its_rows_cost_less(tiny):
    """Pairs of about 90 tokens each side pad little one sequence a row; packed, each pair is a row twice as wide,
    whose masked attention computes its whole square: with the shrunk model's attention cost per (query, key) pair
    the micro-batch stays one sequence a row, with flash attention's (each sequence's own, 0) it packs. Prompts
    with completions of very different lengths pad much: they pack at that cost too."""
    from hfsdp.data.layout import layout_cost
    from hfsdp.objective import Objective, PreferenceObjective

    _, tokenizer = tiny
    objective = PreferenceObjective()
    rows = pairs(tokenizer, 4)
    for attention, packs in ((0.0, True), (5e-3, False)):
        objective.lay_out(MicroBatchLayout(pack_len=256, pack_attention=attention))
        batch = objective.micro_batch(rows, tokenizer.pad_token_id, torch.device("cpu"), True)
        assert (batch.packing is not None) == packs, attention
    lengths = [12, 90, 20, 85, 15, 30, 18, 60]
    plain = Objective()
    plain.lay_out(MicroBatchLayout(pack_len=96, pack_attention=5e-3))
    batch = plain.micro_batch([{"input_ids": [7] * n, "labels": [7] * n} for n in lengths], tokenizer.pad_token_id,
                              torch.device("cpu"), False)
    assert batch.packing is not None and batch.inputs["input_ids"].shape == (4, 90)  # 90 | 85 | 60+30 | 20+18+15+12
    assert layout_cost([96] * 4, 5e-3) < layout_cost([90] * 8, 5e-3)
    # packing.max_len bounds the rows: where attention costs nothing more in a wider row (sdpa one sequence at a
    # time, flash attention), the cheapest is one row of all; with max_len 96, rows of at most 96
    samples = [{"input_ids": [7] * n, "labels": [7] * n} for n in lengths]
    for pack_len, shape in ((0, (1, sum(lengths))), (96, (4, 90))):
        plain.lay_out(MicroBatchLayout(pack_len=pack_len))
        batch = plain.micro_batch(samples, tokenizer.pad_token_id, torch.device("cpu"), False)
        assert batch.inputs["input_ids"].shape == shape, pack_len


def test_two_plugins_that_replace_the_objective_are_refused_naming_both(tmp_path):
    """hook ``hfsdp_objective`` (and ``hfsdp_pack_micro_batches``, through the same check): at most one enabled
    plugin returns something; two are refused before any weight loads, named in the config's order."""
    from conftest import tiny_config

    from hfsdp.rules.table import load_checked
    from hfsdp.errors import ConfigError
    from hfsdp.hooks.host import PluginHost
    from hfsdp.objective import objective_of

    pairs = {"format": "preference", "path": str(PRESET_DATA / "contacts_pref_train.jsonl"), "eval_path": None}
    config, _ = load_checked(str(tiny_config(tmp_path, plugins=["simpo"], data=pairs)))
    with pytest.raises(ConfigError, match="two plugins replace the training objective: simpo, reward_model; enable "
                                          "one of them"):
        objective_of(PluginHost(["simpo", "reward_model"]), config, tokenizer=None)
