"""The decisions made before anything loads, as pure functions: what wraps the model (``RunSetup``), which world
sizes a strategy can run on (``check_world``), how a checkpoint keeps its global batch on another world size
(``keep_global_batch``), and ``hfsdp plan``'s estimate. Fast: no model, no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfsdp.checkpoint import store as checkpoint
from hfsdp.setup.record import Record, keep_global_batch, run_fingerprint
from hfsdp.config.schema import FSDPConfig, HfsdpConfig
from hfsdp.errors import ConfigError, UserError
from hfsdp.hooks.host import PluginHost
from hfsdp.layout.degrees import ParallelDims, World
from hfsdp.rules.table import Facts, enforce
from hfsdp.setup.decide import decide


def _config(tmp_path: Path, **sections) -> HfsdpConfig:
    base = {"model": {"name_or_path": "x"}, "data": {"path": "x"},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "per_device_batch_size": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return HfsdpConfig.model_validate(base)


def _world(size: int, local: int | None = None) -> World:
    return World(rank=0, size=size, local_size=local or size, on_cpu=True)


def _checkpoint(config: HfsdpConfig, *, world_size: int, global_batch: int, by_fsdp: bool) -> Path:
    path = Path(config.train.output_dir) / "checkpoints" / "step-2"
    (path / "pytorch_model_fsdp_0" if by_fsdp else path).mkdir(parents=True)
    (path / checkpoint.RECORD).write_text(json.dumps({"step": 2, "world_size": world_size, "global_batch": global_batch,
                                                      "config_hash": run_fingerprint(config)}))
    return path


@pytest.mark.parametrize("size, local, fsdp, tp, sp, dims", [
    (1, 1, {}, 1, 1, (1, 1, 1)),  # one process: nothing to shard or replicate
    (4, 4, {}, 1, 1, (1, 4, 1)),  # FULL_SHARD over every rank
    (4, 4, {"sharding_strategy": "SHARD_GRAD_OP"}, 1, 1, (1, 4, 1)),
    (8, 4, {"sharding_strategy": "HYBRID_SHARD"}, 1, 1, (2, 4, 1)),  # shard in a node, replicate across nodes
    (8, 8, {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}, 1, 1, (4, 2, 1)),
    (4, 4, {"sharding_strategy": "NO_SHARD"}, 1, 1, (4, 1, 1)),  # DDP: every rank a whole copy
    (4, 4, {"version": 1, "sharding_strategy": "NO_SHARD"}, 1, 1, (4, 1, 1)),
    (8, 8, {}, 2, 1, (1, 4, 2)),  # FSDP2 over the data-parallel ranks, tensor-parallel pairs inside
    (8, 8, {}, 1, 2, (1, 4, 1)),  # 4 data-parallel ranks of sequence-parallel pairs (FSDP2 shards over all 8)
])
def test_the_parallel_degrees_are_one_value_from_the_config_and_the_world(tmp_path, size, local, fsdp, tp, sp, dims):
    config = _config(tmp_path, fsdp=fsdp, parallel={"tp_size": tp, "sp_size": sp})
    world = decide(config, _world(size, local), resume=None).world
    got = world.dims
    assert (got.dp_replicate, got.dp_shard, got.tp) == dims and got.world_size == size and got.sp == sp
    assert got.dp_size == size // tp // sp and got.replicas == dims[0]
    assert [got.dp_rank(r) for r in range(size)] == [r // (tp * sp) for r in range(size)]
    assert [got.sp_rank(r) for r in range(size)] == [r // tp % sp for r in range(size)]
    assert got.gradient_ranks == got.dp_size * sp and got.row_copies == tp * sp


@pytest.mark.parametrize("size, fsdp, parallel, dims, wrapper, fsdp1", [
    (8, {}, {"dp_replicate_size": 2}, (2, 4), "fsdp2", "HYBRID_SHARD"),  # HSDP by degrees, no strategy name
    (8, {"sharding_strategy": "SHARD_GRAD_OP"}, {"dp_replicate_size": 4}, (4, 2), "fsdp2", "HYBRID_SHARD"),
    (4, {}, {"dp_replicate_size": 4}, (4, 1), "ddp", "NO_SHARD"),  # replicas only: FSDP2 is DDP, FSDP1 NO_SHARD
    (8, {}, {"dp_replicate_size": 2, "dp_shard_size": 4}, (2, 4), "fsdp2", "HYBRID_SHARD"),  # given, and the rest
    (8, {}, {"dp_shard_size": -1}, (1, 8), "fsdp2", "FULL_SHARD"),  # -1: the rest
])
def test_every_data_parallel_degree_is_a_key_of_the_parallel_section(tmp_path, size, fsdp, parallel, dims, wrapper,
                                                                     fsdp1):
    """``parallel.dp_replicate_size`` and ``dp_shard_size`` give the data-parallel degrees as the strategy names
    spell them: replicas and shards make HSDP (FSDP1's HYBRID_SHARD), replicas alone DDP (FSDP1's NO_SHARD)."""
    config = _config(tmp_path, fsdp=fsdp, parallel=parallel)
    got = ParallelDims.of(config.fsdp, config.parallel, size, size)
    assert ((got.dp_replicate, got.dp_shard), got.wrapper, got.fsdp1_strategy(config.fsdp.sharding_strategy)) == (
        dims, wrapper, fsdp1)
    assert got.problems(config) == [] and got.dp_replicate * got.dp_shard * got.sp * got.tp == size
    assert got.hybrid == (fsdp1 == "HYBRID_SHARD")


@pytest.mark.parametrize("size, fsdp, parallel, key, says", [
    (8, {}, {"dp_replicate_size": 3}, "parallel.dp_replicate_size", "3 does not divide the 8 data-parallel ranks"),
    (8, {}, {"dp_replicate_size": 2, "dp_shard_size": 2}, "parallel.dp_shard_size",
     "2 x dp_replicate_size 2 is 4, not the world size 8: set it to 4, or remove it"),
    (8, {}, {"dp_shard_size": 4}, "parallel.dp_shard_size",
     "4 is not the world size 8: remove it (FSDP shards over every rank), or set parallel.dp_replicate_size"),
])
def test_degrees_the_world_does_not_make_are_refused_with_their_key(tmp_path, size, fsdp, parallel, key, says):
    config = _config(tmp_path, fsdp=fsdp, parallel=parallel)
    with pytest.raises(ConfigError) as err:
        enforce(config, Facts(PluginHost(config.plugins), _world(size)), ("world",))
    assert [k for k, _ in err.value.problems] == [key] and says in err.value.problems[0][1], err.value.problems


@pytest.mark.parametrize("size, local, ep, efsdp", [
    (2, 2, 2, 1),  # each rank half the experts, whole
    (4, 4, 2, 2),  # 2 groups of 2: each expert on 2 ranks, FSDP2 shards it over them
    (8, 4, 4, 2),  # a group per node
])
def test_expert_parallelism_splits_the_shard_ranks(tmp_path, size, local, ep, efsdp):
    """``parallel.ep_size`` splits FSDP2's shard ranks as ``efsdp x ep``, the expert-parallel ranks consecutive:
    each rank still trains on its own rows (the data-parallel degrees are unchanged) and FSDP shards the rest over
    every rank; the mesh names the split and flattens it back for FSDP."""
    from hfsdp.parallel.mesh import SHARD

    config = _config(tmp_path, parallel={"ep_size": ep})
    dims = decide(config, _world(size, local), resume=None).world.dims
    assert (dims.dp_shard, dims.ep, dims.efsdp, dims.dp_size, dims.shard_group) == (size, ep, efsdp, size, size)
    assert dims.mesh_dims == ("dp_replicate", "efsdp", "ep", "cp", "sp", "tp")
    assert dims.sharded_over == ("efsdp", "ep", "cp", "sp")
    assert dims.splits_groups and dims.problems(config) == [] and dims.row_copies == 1
    assert [dims.dp_rank(r) for r in range(size)] == list(range(size))
    assert SHARD == "dp_shard_cp"


@pytest.mark.parametrize("size, local, parallel, fsdp, key, says", [
    (4, 4, {"ep_size": 3}, {}, "parallel.ep_size", "3 does not divide the 4 ranks FSDP shards over"),
    (1, 1, {"ep_size": 2}, {}, "parallel.ep_size", "2 does not divide the 1 ranks FSDP shards over"),
    (8, 2, {"ep_size": 4}, {}, "parallel.ep_size", "expert-parallel group must stay inside one node"),
    (2, 2, {"ep_size": 2}, {"version": 1}, "fsdp.version", "expert parallelism needs FSDP2"),
    (4, 4, {"ep_size": 2, "dp_replicate_size": 2}, {}, "parallel.dp_replicate_size", "(HSDP x EP) are not composed"),
    (4, 4, {"ep_size": 2, "tp_size": 2}, {}, "parallel.tp_size", "tensor x expert parallelism is not built yet"),
    (4, 4, {"ep_size": 2, "sp_size": 2}, {}, "parallel.sp_size", "sequence x expert parallelism is not built yet"),
    (2, 2, {"ep_size": 2}, {"sharding_strategy": "NO_SHARD"}, "fsdp.sharding_strategy", "NO_SHARD is not composed"),
    (2, 2, {"ep_size": 2}, {"cpu_ram_efficient_loading": True}, "fsdp.cpu_ram_efficient_loading",
     "every rank reads the weights and keeps its own experts"),
])
def test_expert_parallel_degrees_the_config_or_world_cannot_take_are_refused(tmp_path, size, local, parallel, fsdp,
                                                                             key, says):
    config = _config(tmp_path, parallel=parallel, fsdp=fsdp)
    with pytest.raises(ConfigError) as err:
        enforce(config, Facts(PluginHost(config.plugins), _world(size, local)), ("config", "world"))
    assert err.value.problems[0][0] == key and says in err.value.problems[0][1], err.value.problems


def test_expert_parallelism_needs_experts_it_divides(tmp_path):
    """The model's rules: a dense model has no experts to split, and ep must divide each layer's experts."""
    from transformers import AutoConfig

    from hfsdp.rules import parallel as parallel_rules

    moe = AutoConfig.for_model("qwen3_moe", num_experts=6, num_experts_per_tok=2)
    dense = AutoConfig.for_model("llama")
    assert parallel_rules.model_problems(_config(tmp_path, parallel={"ep_size": 2}), moe) == []
    [(key, says)] = parallel_rules.model_problems(_config(tmp_path, parallel={"ep_size": 4}), moe)
    assert key == "parallel.ep_size" and "4 does not divide the model's 6 experts per layer" in says
    [(key, says)] = parallel_rules.model_problems(_config(tmp_path, parallel={"ep_size": 2}), dense)
    assert "llama is a dense model" in says


@pytest.mark.parametrize("fsdp, parallel, key", [
    ({"sharding_strategy": "HYBRID_SHARD"}, {"dp_replicate_size": 2}, "parallel.dp_replicate_size"),
    ({"sharding_strategy": "NO_SHARD"}, {"dp_shard_size": 4}, "parallel.dp_shard_size"),
])
def test_the_data_parallel_degrees_are_given_in_one_place(tmp_path, fsdp, parallel, key):
    """A strategy name that spells the degrees (HYBRID_SHARD, NO_SHARD) and the same degree given as a key: which
    one is meant is asked, not guessed."""
    from hfsdp.rules import parallel as parallel_rules

    problems = parallel_rules.config_problems(_config(tmp_path, fsdp=fsdp, parallel=parallel))
    assert [k for k, _ in problems] == [key] and "spells the data-parallel degrees itself" in problems[0][1]


def test_what_the_degrees_wrap_the_model_in_is_checked_in_the_world(tmp_path):
    """Replicas only (DDP by the degrees) write one file per checkpoint: background saves are refused there, as for
    NO_SHARD; FSDP1 with replicas is HYBRID_SHARD, which CPU rehearsal cannot run."""
    ddp = _config(tmp_path, train={"async_save": True}, parallel={"dp_replicate_size": 2})
    with pytest.raises(ConfigError, match="train.async_save: the parallel degrees shard nothing"):
        enforce(ddp, Facts(PluginHost([]), _world(2)), ("world",))
    fsdp1 = _config(tmp_path, fsdp={"version": 1}, parallel={"dp_replicate_size": 2})
    with pytest.raises(ConfigError, match="fsdp.version 1 with HYBRID_SHARD: needs a GPU"):
        enforce(fsdp1, Facts(PluginHost([]), _world(4)), ("world",))


@pytest.mark.parametrize("size, fsdp, wrapper", [
    (1, {}, "none"), (2, {}, "fsdp2"), (1, {"single_process": "fsdp"}, "fsdp2"), (2, {"version": 1}, "fsdp1"),
    (2, {"sharding_strategy": "NO_SHARD"}, "ddp"), (1, {"sharding_strategy": "NO_SHARD"}, "none"),
    (2, {"version": 1, "sharding_strategy": "NO_SHARD"}, "fsdp1"),
])
def test_run_setup_decides_the_wrapper(tmp_path, size, fsdp, wrapper):
    setup = decide(_config(tmp_path, fsdp=fsdp), _world(size), resume=None)
    assert setup.wrapper == wrapper and setup.fsdp == wrapper.startswith("fsdp") and setup.resume is None


def test_run_setup_reports_every_problem_at_once(tmp_path):
    config = _config(tmp_path, fsdp={"sharding_strategy": "HYBRID_SHARD", "cpu_offload": True},
                     model={"attn_implementation": "flash_attention_2"})
    with pytest.raises(ConfigError) as err:
        enforce(config, Facts(PluginHost(config.plugins), _world(4)), ("world",), source="my.yaml")
    keys = [key for key, _ in err.value.problems]
    assert keys == ["fsdp.sharding_strategy", "model.attn_implementation", "model.attn_implementation",
                    "fsdp.cpu_offload"], err.value.problems
    assert str(err.value).startswith("my.yaml: 4 problem(s)")


def test_one_process_resuming_an_fsdp_checkpoint_keeps_fsdp_and_the_global_batch(tmp_path):
    saved = _config(tmp_path)
    path = _checkpoint(saved, world_size=2, global_batch=4, by_fsdp=True)
    setup = decide(saved, _world(1), resume="latest")
    assert setup.wrapper == "fsdp2" and setup.config.fsdp.single_process == "fsdp"
    assert setup.resume.path == path and setup.config.train.gradient_accumulation_steps == 2
    assert setup.notes == ("resuming a run of 2 rank(s) on 1: train.gradient_accumulation_steps 1 -> 2 keeps its "
                           "global batch of 4 (2 per device x 2 x 1 ranks)",)


def test_a_resume_that_cannot_continue_the_run_is_refused_by_the_decision(tmp_path):
    saved = _config(tmp_path, train={"gradient_accumulation_steps": 2})
    _checkpoint(saved, world_size=1, global_batch=4, by_fsdp=False)
    changed = _config(tmp_path, train={"gradient_accumulation_steps": 2, "learning_rate": 0.1})
    with pytest.raises(UserError, match="the config changed in keys that change the run"):
        decide(changed, _world(1), resume="latest")
    with pytest.raises(UserError, match="cannot resume from .* under FSDP: one process without a wrapper"):
        decide(saved, _world(2), resume="latest")
    assert decide(saved, _world(1), resume="latest").wrapper == "none"  # the same run resumes as it was saved


def test_a_checkpoint_written_before_still_resumes_its_run():
    """The fingerprint a checkpoint keeps of its config (the keys a resume may not change, as the schema marks the
    others ``Resumable``) is the one hfsdp wrote before the parallel section gained its degrees: ``b1f4d05f1baa4cc0``,
    computed at 2269ada for this config. (A resume compares the checkpoint's own config first; the fingerprint
    decides where today's schemas cannot read it.)"""
    config = HfsdpConfig.model_validate({"model": {"name_or_path": "smollm2-tiny"}, "data": {"path": "x.jsonl"},
                                         "train": {"output_dir": "run", "max_steps": 4}})
    assert run_fingerprint(config) == "b1f4d05f1baa4cc0"


def test_a_checkpoint_of_a_config_without_a_key_added_since_resumes_and_a_changed_key_is_named(tmp_path):
    """The checkpoint's own config is read by today's schemas: a key hfsdp added after it was written (here
    train.deterministic, left out of the saved file) takes its default, so the run resumes whatever its record's
    fingerprint; a key the user changed is named, with both values."""
    import yaml

    from hfsdp.disk.checkpoints import CONFIG_NAME

    saved = _config(tmp_path)
    path = _checkpoint(saved, world_size=1, global_batch=2, by_fsdp=False)
    older = saved.to_yaml_dict()
    del older["train"]["deterministic"]
    (path / CONFIG_NAME).write_text(yaml.safe_dump(older))
    record = json.loads((path / checkpoint.RECORD).read_text())
    (path / checkpoint.RECORD).write_text(json.dumps({**record, "config_hash": "of an older schema"}))
    assert decide(saved, _world(1), resume="latest").resume.path == path
    changed = _config(tmp_path, train={"learning_rate": 0.1})
    with pytest.raises(UserError, match=r"the config changed in keys that change the run: train.learning_rate "
                                        r"\(2e-05 in the checkpoint, 0.1 now\)"):
        decide(changed, _world(1), resume="latest")


def test_no_complete_checkpoint_yet_starts_from_step_0(tmp_path):
    setup = decide(_config(tmp_path), _world(2), resume="latest")
    assert setup.resume is None and setup.resume_asked


@pytest.mark.parametrize("size, local, hybrid, problem", [
    (4, 2, None, None),
    (4, 4, None, "HYBRID_SHARD on one node of 4 ranks has nothing to replicate across"),
    (4, 4, 2, None),
    (4, 1, None, "HYBRID_SHARD with one rank per shard group shards nothing"),
    (6, 2, 4, "4 ranks per shard group does not divide the world size 6"),
    (1, 1, 2, None),  # one process runs without a wrapper: a cluster's config still runs a smoke test
])
def test_check_world(tmp_path, size, local, hybrid, problem):
    config = _config(tmp_path, fsdp={"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": hybrid})
    problems = _world(size, local).with_dims(config).dims.problems(config)
    assert (problems[0][1] if problems else None) == problem or problem in problems[0][1]


def _dims(config: HfsdpConfig, world_size: int) -> ParallelDims:
    return ParallelDims.of(config.fsdp, config.parallel, world_size, world_size)


def _record(world_size: int, global_batch: int | None) -> Record:
    return Record(step=1, world_size=world_size, config_hash="x", global_batch=global_batch)


@pytest.mark.parametrize("saved_world, saved_batch, world, per_device, accumulation, expected", [
    (2, 8, 2, 2, 2, 2),  # same world: unchanged
    (2, 8, 4, 2, 2, 1),  # more ranks: less accumulation
    (4, 8, 1, 2, 1, 4),  # fewer ranks: more accumulation
])
def test_keep_global_batch_adapts_the_accumulation(tmp_path, saved_world, saved_batch, world, per_device,
                                                   accumulation, expected):
    config = _config(tmp_path, train={"per_device_batch_size": per_device,
                                      "gradient_accumulation_steps": accumulation})
    kept, note = keep_global_batch(_record(saved_world, saved_batch), config, _dims(config, world), Path("c"))
    assert kept.train.gradient_accumulation_steps == expected
    assert (note is None) == (expected == accumulation)
    assert kept.train.per_device_batch_size * expected * world == saved_batch


def test_keep_global_batch_refuses_what_no_accumulation_keeps(tmp_path):
    with pytest.raises(UserError, match="set one of: per_device_batch_size 1 with gradient_accumulation_steps 3; "
                                        "per_device_batch_size 3 with gradient_accumulation_steps 1"):
        keep_global_batch(_record(3, 3), _config(tmp_path), _dims(_config(tmp_path), 1), Path("c"))
    with pytest.raises(UserError, match="supported with fsdp.version 2 only"):
        config = _config(tmp_path, fsdp={"version": 1})
        keep_global_batch(_record(2, 4), config, _dims(config, 1), Path("c"))
    with pytest.raises(UserError, match="does not record its global batch"):
        keep_global_batch(_record(2, None), _config(tmp_path), _dims(_config(tmp_path), 1), Path("c"))


def test_plan_estimate_shards_params_grads_and_optimizer_state():
    from hfsdp.tools.plan.facts import Activations, ModelFacts, Param
    from hfsdp.tools.plan.estimate import Setup, estimate

    params = (Param(numel=1000, rows=100, itemsize=4, trainable=True, unit=0),
              *(Param(numel=4096, rows=64, itemsize=4, trainable=True, unit=u) for u in (1, 2)))
    facts = ModelFacts(name="toy", params=params, units=("root", "layer0", "layer1"), layer_classes=("Block",),
                       vocab_size=100, num_layers=2, tied_embeddings=False, tied_trainable_numel=0)
    acts = Activations(outside_layers=1000, per_layer=(5000, 5000), layer_inputs=(800, 800), logits_bytes=4000)
    total = sum(p.numel for p in params) * 4

    def at(nproc: int, **fsdp) -> "Estimate":  # noqa: F821
        return estimate(facts, acts, Setup(fsdp=FSDPConfig(**fsdp), nproc_per_node=nproc, nodes=1, plugins=(),
                                           accumulation=1))

    one, full, ddp = at(1), at(2), at(2, sharding_strategy="NO_SHARD")
    assert one.setup.wrapper == "none" and (one.params, one.grads, one.optimizer) == (total, total, 2 * total)
    assert (full.params, full.grads, full.optimizer) == (total // 2, total // 2, total)  # rows divide evenly
    assert ddp.setup.wrapper == "ddp" and ddp.params == total and ddp.optimizer == 2 * total
    assert full.device_peak < ddp.device_peak
    checkpointed = at(2, activation_checkpointing=True)
    assert checkpointed.activations < full.activations


def test_a_key_added_since_the_fingerprint_changes_it_only_when_set():
    """model.router_aux_loss_coef (issue 71) joined the schema after checkpoints began recording the fingerprint:
    at its default the fingerprint is the one written before; set, it differs (a run that changes it does not
    resume a checkpoint that knew nothing of it)."""
    base = {"model": {"name_or_path": "smollm2-tiny"}, "data": {"path": "x.jsonl"},
            "train": {"output_dir": "run", "max_steps": 4}}
    assert run_fingerprint(HfsdpConfig.model_validate(base)) == "b1f4d05f1baa4cc0"
    weighted = {**base, "model": {**base["model"], "router_aux_loss_coef": 0.01}}
    assert run_fingerprint(HfsdpConfig.model_validate(weighted)) != "b1f4d05f1baa4cc0"
    sized = {**base, "data": {**base["data"], "image_max_pixels": 3136}}  # (issue 72)
    assert run_fingerprint(HfsdpConfig.model_validate(sized)) != "b1f4d05f1baa4cc0"
