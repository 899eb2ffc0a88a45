"""The online objectives' sampler (``hfsdp.builtin.online.sampling.sample``: each distinct prompt prefilled once, its
KV cache copied to its completions, one seeded generator per completion) draws token for token what the path it
replaced drew, ``generate`` on the prompts repeated once per completion (``generate_sample`` of
benchmarks/sampling.py, which times the two): on the shrunk SmolLM2, with prompts of different lengths (repeated
apart too, as a multi-turn rollout's later turns are), temperatures, top-k and top-p, an EOS inside the
completions, ``max_new_tokens`` given; its log-probs are the trainer's (``token_logps`` of a teacher-forced
forward); on 2 FSDP2 ranks (threads) the ranks decode in lock-step, a rank without prompts or whose rows end first
stepping with the other, and draw what one process draws."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.online.rounds import per_row, prompt_completion_batch, token_logps
from hfsdp.builtin.online.sampling import sample

from conftest import REPO
from threaded_ranks import on_threads

PAD = 0
WIDTH = 15  # wider than the longest prompt here: the round's longest may be another rank's


def _reference():
    spec = importlib.util.spec_from_file_location("sampling_benchmark", REPO / "benchmarks" / "sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate_sample


generate_sample = _reference()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def section(max_new_tokens: int = 8, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return SimpleNamespace(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)


def prompts_and_seeds() -> tuple[list[list[int]], list[int]]:
    """Three prompts of 4, 9 and 13 tokens, a group of 3 completions each, and a second group of the first later
    on (a prompt repeated apart); one seed per completion."""
    drawn = torch.Generator().manual_seed(7)
    distinct = [torch.randint(1, 40_000, (n,), generator=drawn).tolist() for n in (4, 9, 13)]
    prompts = [p for p in distinct for _ in range(3)] + [distinct[0]] * 2
    return prompts, [1000 + i for i in range(len(prompts))]


def inline(model, prompts, seeds, drawn, eos, **kwargs):
    return sample(model, model, prompts, seeds, PAD, WIDTH, drawn, eos, gather=False, synced=False, **kwargs)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.8, 20, 0.95)])
def test_the_sampler_draws_what_generate_on_the_repeated_prompts_drew(model, temperature, top_k, top_p):
    prompts, seeds = prompts_and_seeds()
    drawn = section(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = generate_sample(model, prompts, seeds, PAD, WIDTH, drawn, [2])
    assert inline(model, prompts, seeds, drawn, [2]) == expected
    assert all(len(c) == 8 for c in expected)  # no EOS drawn: every token compared
    assert expected[0] != expected[1]  # a group's completions are drawn apart


def test_completions_that_draw_an_eos_end_there_as_generates_did(model):
    prompts, seeds = prompts_and_seeds()
    drawn = section()
    free = generate_sample(model, prompts, seeds, PAD, WIDTH, drawn, [2])
    eos = [free[0][2], free[4][5]]  # tokens those rows draw: with them as EOS, rows end inside
    expected = generate_sample(model, prompts, seeds, PAD, WIDTH, drawn, eos)
    assert inline(model, prompts, seeds, drawn, eos) == expected
    assert len(expected[0]) == 3 and len(expected[4]) <= 6 and expected[0][-1] in eos
    assert any(len(c) == 8 for c in expected)  # the rows that did not end went on


@pytest.mark.parametrize("most", [3, 0])
def test_max_new_tokens_given_bounds_the_completions_as_generates_did(model, most):
    prompts, seeds = prompts_and_seeds()
    drawn = section()
    expected = generate_sample(model, prompts, seeds, PAD, WIDTH, drawn, [2], max_new_tokens=most)
    assert inline(model, prompts, seeds, drawn, [2], max_new_tokens=most) == expected
    assert {len(c) for c in expected} == {max(most, 1)}  # 0 samples one token, as before


def test_the_log_probs_are_the_trainers_of_the_logits_over_the_temperature_before_top_k(model):
    prompts, seeds = prompts_and_seeds()
    drawn = section(temperature=0.7, top_k=20, top_p=0.9)
    free = inline(model, prompts, seeds, drawn, [2])
    eos = [free[3][4]]
    completions, logps = inline(model, prompts, seeds, drawn, eos, logps=True)
    assert completions == inline(model, prompts, seeds, drawn, eos)
    assert [len(lp) for lp in logps] == [len(c) for c in completions] and len(completions[3]) == 5
    batch = prompt_completion_batch(prompts, completions, PAD, torch.device("cpu"), select_logits=False)
    with torch.no_grad():
        forward = per_row(token_logps(model, batch, drawn.temperature)[0], batch.sequence_targets != IGNORE_INDEX)
    assert max(abs(a - b) for x, y in zip(logps, forward) for a, b in zip(x, y)) < 1e-5
    assert min(v for row in logps for v in row) < -3  # not the top-k renormalised log-probs (those of 20 tokens)


def test_no_prompts_sample_nothing(model):
    assert inline(model, [], [], section(), [2]) == []
    assert inline(model, [], [], section(), [2], logps=True) == ([], [])


def _sharded_sample(model, prompts, seeds, eos, whole: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    out = sample(model, model, prompts, seeds, PAD, WIDTH, section(), eos, gather=whole, synced=True)
    return out, model.training


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("second", ["none", "ends_first"])
def test_fsdp2_ranks_sample_in_lock_step_what_one_process_samples(tiny_model_dir, model, whole, second):
    """Rank 0 samples the first prompt's group; rank 1 none (it steps on a padding row) or the second's, whose
    rows end at their second token (the EOS) while rank 0's go on: both take every step of rank 0's."""
    prompts, seeds = prompts_and_seeds()
    share = {0: (prompts[:3], seeds[:3]), 1: ([], []) if second == "none" else (prompts[3:6], seeds[3:6])}
    free = generate_sample(model, prompts[3:6], seeds[3:6], PAD, WIDTH, section(), [2])
    eos = [2] if second == "none" else sorted({c[1] for c in free})
    expected = {rank: generate_sample(model, *share[rank], PAD, WIDTH, section(), eos) if share[rank][0] else []
                for rank in share}
    assert all(len(c) == 8 for c in expected[0])
    assert second == "none" or all(len(c) <= 2 for c in expected[1])
    models = [AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32) for _ in range(2)]
    results = on_threads(2, lambda rank: _sharded_sample(models[rank], *share[rank], eos, whole))
    assert [out for out, _ in results] == [expected[0], expected[1]]
    assert all(training for _, training in results)  # back in its mode
