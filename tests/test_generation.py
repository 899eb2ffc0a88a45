"""Sampling under FSDP2 (``hfsdp.run.generation.generating``: GRPO's rounds, generation eval): with
``fsdp.gather_for_generation`` every unit is gathered once for the whole ``generate`` and the model holds its shards
again after; without it each decode step gathers each unit again. The tokens are the same either way. Ranks are
threads (torch's threaded process group): the claim is which collectives run, not the launch."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from transformers import AutoModelForCausalLM

from hfsdp.run.generation import generating
from threaded_ranks import on_threads

NEW_TOKENS = 5


def _sample(model, whole: bool) -> dict:
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    gathers = []
    unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        if not group.is_unsharded:  # an all-gather happens
            gathers.append(group)
        return unshard(group, *args, **kwargs)

    FSDPParamGroup.unshard = counted  # threads share the class: each counts its own groups below
    try:
        prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
        with generating(model, whole):
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    finally:
        FSDPParamGroup.unshard = unshard
    mine = {id(g) for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups}
    units = len(mine)
    sharded_after = all(not g.is_unsharded for m in model.modules() if isinstance(m, FSDPModule)
                        for g in m._get_fsdp_state()._fsdp_param_groups)
    return {"tokens": out[:, prompt.size(1):].tolist(), "gathers": sum(id(g) in mine for g in gathers),
            "units": units, "sharded_after": sharded_after, "training": model.training}


@pytest.mark.parametrize("whole", [True, False])
def test_generation_gathers_each_unit_once_or_at_every_decode_step(tiny_model_dir, whole):
    models = [AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32) for _ in range(2)]
    ranks = on_threads(2, lambda rank: _sample(models[rank], whole))
    for result in ranks:
        units, layers = result["units"], result["units"] - 1  # the root unit and one per decoder layer
        # once: every unit once; per token: the root once (kept gathered by the root's own rule) and each layer at
        # the prefill and at each of the later decode steps
        expected = units if whole else 1 + layers * NEW_TOKENS
        assert result["gathers"] == expected, (whole, result)
        assert result["sharded_after"] and result["training"]  # back to its shards and its mode
    assert ranks[0]["tokens"] == ranks[1]["tokens"]


def test_the_tokens_do_not_depend_on_how_the_model_is_gathered(tiny_model_dir):
    def sampled(whole: bool) -> list:
        models = [AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32) for _ in range(2)]
        return on_threads(2, lambda rank: _sample(models[rank], whole))

    once, per_token = sampled(True), sampled(False)
    assert once[0]["tokens"] == per_token[0]["tokens"]
