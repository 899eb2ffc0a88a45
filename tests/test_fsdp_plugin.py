"""The ``fsdp:`` section → Accelerate's FullyShardedDataParallelPlugin, field by field, for every combination of
version × strategy × precision × cpu_offload × state-dict type; and FSDP_* launcher variables never change it."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.fsdp import (
    BackwardPrefetch, CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, OffloadPolicy,
    ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from hfsdp.config.schema import STRATEGIES, FSDPConfig
from hfsdp.parallel.fsdp import build_fsdp_plugin
from hfsdp.parallel.size_policy import SizeUnits

LAYERS = ["LlamaDecoderLayer"]
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VERSIONS = [1, 2]
PER_PART = {"param": "bfloat16", "reduce": "float16", "buffer": "float16"}  # all different from the defaults
PRECISIONS = {"no": None, "bf16": ("bfloat16", "float32", "float32"), "fp16": ("float16", "float32", "float32"),
              "parts": ("bfloat16", "float16", "float16")}
STATE_DICTS = ["FULL_STATE_DICT", "SHARDED_STATE_DICT"]
TABLE = list(itertools.product(VERSIONS, STRATEGIES, PRECISIONS, [False, True], STATE_DICTS))


@pytest.fixture(autouse=True)
def _restore_environ():
    # The plugin writes FSDP_CPU_RAM_EFFICIENT_LOADING into os.environ itself; keep tests independent.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _cfg(version, strategy, precision, offload, state_dict, **extra) -> FSDPConfig:
    return FSDPConfig(version=version, sharding_strategy=strategy,
                      mixed_precision=PER_PART if precision == "parts" else precision,
                      cpu_offload=offload, state_dict_type=state_dict, **extra)


@pytest.mark.parametrize("version,strategy,precision,offload,state_dict", TABLE,
                         ids=["-".join(map(str, row)) for row in TABLE])
def test_plugin_fields(version, strategy, precision, offload, state_dict):
    if version == 2 and strategy == "NO_SHARD" and offload:
        with pytest.raises(ValidationError, match="runs as DDP, which has no cpu_offload"):
            _cfg(version, strategy, precision, offload, state_dict)
        return
    if version == 2 and strategy == "NO_SHARD" and precision == "parts":  # DDP cannot honour reduce: float16
        with pytest.raises(ValidationError, match="runs as DDP, which reduces gradients in float32"):
            _cfg(version, strategy, precision, offload, state_dict)
        return
    cfg = _cfg(version, strategy, precision, offload, state_dict)
    plugin = build_fsdp_plugin(cfg, LAYERS)
    if version == 2 and strategy == "NO_SHARD":
        assert plugin is None and cfg.runs_as_ddp  # FSDP2 has no NO_SHARD: it runs as DDP
        return
    assert plugin is not None and not cfg.runs_as_ddp
    assert plugin.fsdp_version == version
    # strategy
    if version == 1:
        assert plugin.sharding_strategy == ShardingStrategy[strategy]
        assert plugin.reshard_after_forward is None
    else:
        assert plugin.sharding_strategy is None
        assert plugin.reshard_after_forward is (strategy != "SHARD_GRAD_OP")
    # mixed precision
    dtypes = PRECISIONS[precision]
    if dtypes is None:
        assert plugin.mixed_precision_policy is None
    elif version == 1:
        assert plugin.mixed_precision_policy == MixedPrecision(
            param_dtype=DT[dtypes[0]], reduce_dtype=DT[dtypes[1]], buffer_dtype=DT[dtypes[2]])
    else:
        assert plugin.mixed_precision_policy == MixedPrecisionPolicy(param_dtype=DT[dtypes[0]],
                                                                     reduce_dtype=DT[dtypes[1]])
    # offload
    if version == 1:
        assert plugin.cpu_offload == CPUOffload(offload_params=offload)
    else:
        assert type(plugin.cpu_offload) is (CPUOffloadPolicy if offload else OffloadPolicy)
    assert plugin.state_dict_type == StateDictType[state_dict]
    # wrapping
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap == LAYERS
    assert plugin.min_num_params is None
    assert plugin.ignored_modules == []
    # FSDP1-only knobs get hfsdp's defaults on FSDP1 and are absent on FSDP2
    if version == 1:
        assert plugin.use_orig_params is True
        assert plugin.sync_module_states is False
        assert plugin.forward_prefetch is False
        assert plugin.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
        assert plugin.limit_all_gathers is True
    else:
        assert plugin.use_orig_params is None
        assert plugin.sync_module_states is None
        assert plugin.forward_prefetch is None
        assert plugin.backward_prefetch is None
    assert plugin.activation_checkpointing is False
    assert plugin.activation_checkpointing_offload is False
    assert plugin.cpu_ram_efficient_loading is False


@pytest.mark.parametrize("version", VERSIONS)
def test_wrap_policies_and_knobs(version):
    # hfsdp's size policy under both versions (Accelerate's picks the layer ModuleList under FSDP2 and splits tied
    # embeddings: test_multirank.py::test_size_wrap_policy_forms_the_units_plan_predicts runs it on 2 ranks)
    size = build_fsdp_plugin(FSDPConfig(version=version, wrap_policy="size", min_num_params=1000), LAYERS)
    assert isinstance(size.auto_wrap_policy, SizeUnits) and size.auto_wrap_policy.min_num_params == 1000
    assert size.transformer_cls_names_to_wrap is None
    none = build_fsdp_plugin(FSDPConfig(version=version, wrap_policy="none"), LAYERS)
    assert none.auto_wrap_policy is None and none.min_num_params is None
    custom = build_fsdp_plugin(FSDPConfig(version=version, transformer_layer_cls=["MyBlock"]), ["MyBlock"])
    assert custom.transformer_cls_names_to_wrap == ["MyBlock"]
    ac = build_fsdp_plugin(FSDPConfig(version=version, activation_checkpointing=True), LAYERS)
    assert ac.activation_checkpointing is True
    if version == 1:
        knobs = build_fsdp_plugin(FSDPConfig(version=1, use_orig_params=False, forward_prefetch=True,
                                             backward_prefetch="BACKWARD_POST", limit_all_gathers=False), LAYERS)
        assert (knobs.use_orig_params, knobs.forward_prefetch, knobs.limit_all_gathers) == (False, True, False)
        assert knobs.backward_prefetch == BackwardPrefetch.BACKWARD_POST
        # "NONE" is a valid config value; it must mean no prefetch (it used to raise KeyError in Accelerate)
        assert build_fsdp_plugin(FSDPConfig(version=1, backward_prefetch="NONE"), LAYERS).backward_prefetch is None


# Every FSDP_* variable Accelerate's plugin reads, set to a value different from what hfsdp decides.
LAUNCHER_ENV = {
    "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "NO_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "false",
    "FSDP_OFFLOAD_PARAMS": "true", "FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT",
    "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "NotALayer",
    "FSDP_MIN_NUM_PARAMS": "7", "FSDP_USE_ORIG_PARAMS": "false", "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_FORWARD_PREFETCH": "true", "FSDP_BACKWARD_PREFETCH": "BACKWARD_POST",
    "FSDP_IGNORED_MODULES": "model.embed_tokens", "FSDP_ACTIVATION_CHECKPOINTING": "true",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "ACCELERATE_MIXED_PRECISION": "fp16",
}
ENV_CASES = [
    dict(version=2),
    dict(version=2, sharding_strategy="SHARD_GRAD_OP", mixed_precision="bf16", state_dict_type="FULL_STATE_DICT"),
    dict(version=2, wrap_policy="none", cpu_offload=True),
    dict(version=2, wrap_policy="none", mixed_precision=PER_PART),
    dict(version=1),
    dict(version=1, sharding_strategy="SHARD_GRAD_OP", mixed_precision="fp16", backward_prefetch="NONE"),
    dict(version=1, sharding_strategy="NO_SHARD", wrap_policy="size", min_num_params=100, cpu_offload=True),
    dict(version=1, wrap_policy="none", state_dict_type="FULL_STATE_DICT", use_orig_params=False),
]


def _fields(plugin) -> dict[str, str]:
    return {f.name: repr(getattr(plugin, f.name)) for f in dataclasses.fields(plugin)}


@pytest.mark.parametrize("case", ENV_CASES, ids=[str(i) for i in range(len(ENV_CASES))])
def test_launcher_env_changes_no_field(case, monkeypatch):
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    clean = _fields(build_fsdp_plugin(FSDPConfig(**case), LAYERS))
    for key, value in LAUNCHER_ENV.items():
        monkeypatch.setenv(key, value)
    polluted = _fields(build_fsdp_plugin(FSDPConfig(**case), LAYERS))
    changed = {k: (clean[k], polluted[k]) for k in clean if clean[k] != polluted[k]}
    assert not changed, f"FSDP_* environment leaked into the plugin: {changed}"
    assert len(clean) >= 20  # the comparison really covers the plugin's fields


def _hybrid(fsdp: FSDPConfig, world: int, local: int):
    """HYBRID_SHARD's degrees on ``world`` ranks (``local`` per node) and what the launched world refuses of them."""
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.layout.degrees import ParallelDims

    config = HfsdpConfig(model={"name_or_path": "x"}, data={"path": "x"}, train={"output_dir": "x", "max_steps": 1},
                         fsdp=fsdp)
    dims = ParallelDims.of(config.fsdp, config.parallel, world, local)
    shape = (dims.dp_replicate, dims.dp_shard) if dims.hybrid else None
    return shape, dims.problems(config)


def test_check_world_and_hybrid_mesh_share_one_shard_size():
    hybrid = FSDPConfig(sharding_strategy="HYBRID_SHARD")
    assert _hybrid(hybrid, 8, 4) == ((2, 4), [])
    assert [p for p, _ in _hybrid(hybrid, 4, 4)[1]] == ["fsdp.sharding_strategy"]  # one node: nothing to replicate
    sized = FSDPConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=3)
    assert [p for p, _ in _hybrid(sized, 4, 4)[1]] == ["fsdp.hybrid_shard_size"]
    assert _hybrid(FSDPConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=4), 4, 4)[1] == []
    assert _hybrid(FSDPConfig(), 3, 3) == (None, [])
    # one process runs without a wrapper: a cluster's HYBRID_SHARD config still runs a smoke test there
    assert _hybrid(hybrid, 1, 1)[1] == [] and _hybrid(sized, 1, 1)[1] == []
    one_rank_fsdp = FSDPConfig(sharding_strategy="HYBRID_SHARD", single_process="fsdp")
    assert [p for p, _ in _hybrid(one_rank_fsdp, 1, 1)[1]] == ["fsdp.hybrid_shard_size"]


def test_hybrid_shard_groups_of_one_rank_are_refused():
    """Shard groups of one rank shard nothing; Accelerate raised a ValueError about tensor parallelism on every rank."""
    ones = FSDPConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=1)
    problems = _hybrid(ones, 2, 2)[1]
    assert [p for p, _ in problems] == ["fsdp.hybrid_shard_size"] and "NO_SHARD" in problems[0][1]
    # two nodes of one process each: the default group (processes per node) is one rank too
    problems = _hybrid(FSDPConfig(sharding_strategy="HYBRID_SHARD"), 2, 1)[1]
    assert [p for p, _ in problems] == ["fsdp.hybrid_shard_size"] and "processes per node" in problems[0][1]


@pytest.mark.parametrize("offload,state_dict,strategy,backend", [
    (False, "SHARDED_STATE_DICT", "FULL_SHARD", "nccl"),
    (True, "SHARDED_STATE_DICT", "FULL_SHARD", "cuda:nccl,cpu:gloo"),  # offloaded parameters: CPU collectives
    (False, "FULL_STATE_DICT", "FULL_SHARD", "cuda:nccl,cpu:gloo"),  # full state dicts gathered to host memory
    (False, "FULL_STATE_DICT", "NO_SHARD", "nccl"),  # FSDP2 NO_SHARD is DDP: no FSDP state dict gathers
])
def test_process_group_backend_and_cublas_workspace_are_requested_from_the_config(offload, state_dict, strategy,
                                                                                  backend):
    """What hfsdp asks of torch/Accelerate on CUDA, from the YAML alone (issue 15 item 9); the GPU checks run it."""
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.parallel.world import World, process_group_backend, runtime_env

    def config(deterministic=False):
        return HfsdpConfig(model={"name_or_path": "x"}, data={"path": "x"},
                           train={"output_dir": "x", "max_steps": 1, "deterministic": deterministic},
                           fsdp=FSDPConfig(version=2, sharding_strategy=strategy, cpu_offload=offload,
                                           state_dict_type=state_dict))

    gpu, cpu = (World(rank=0, size=2, local_size=2, on_cpu=on_cpu).with_dims(config()) for on_cpu in (False, True))
    assert process_group_backend(config(), gpu) == backend
    assert process_group_backend(config(), cpu) is None  # Accelerate's gloo
    assert runtime_env(config(deterministic=True), gpu) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert runtime_env(config(deterministic=True), cpu) == {} and runtime_env(config(), gpu) == {}


def test_size_units_are_torchs_size_rule_with_tied_parameters_left_to_the_root():
    """torch's size_based_auto_wrap_policy (post-order; parameters already in a unit below do not count; containers
    never wrap), except that no module holding a tied parameter becomes a unit."""
    from torch import nn

    from hfsdp.parallel.size_policy import size_units

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.big, self.small = nn.Linear(10, 10), nn.Linear(2, 2)  # 110 and 6 parameters

    class Model(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed = nn.Embedding(30, 10)  # 300
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(10, 30, bias=False)  # 300
            if tied:
                self.head.weight = self.embed.weight

    assert size_units(Model(tied=False), 100) == ["embed", "blocks.0.big", "blocks.1.big", "head"]
    assert size_units(Model(tied=True), 100) == ["blocks.0.big", "blocks.1.big"]
    # a block is a unit when what is left of it (6 parameters here) reaches the threshold; the ModuleList never is
    assert size_units(Model(tied=True), 5) == ["blocks.0.big", "blocks.0.small", "blocks.1.big", "blocks.1.small"]
    assert size_units(Model(tied=True), 111) == ["blocks.0", "blocks.1"]
    assert size_units(Model(tied=True), 10**6) == []
