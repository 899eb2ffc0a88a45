"""Mixture-of-experts models (issue 71): the experts implementation a run asks for, the router's load-balancing loss
in the gradient as transformers computes it, its metrics, and ranks that train as one process does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (TINY_MOE, read_metrics, run_cli, run_torchrun, tiny_config, tiny_moe_config, tiny_moe_folder)

# LoRA on the tiny Qwen3-MoE's experts (and on the attention Linears, LoRA's default targets)
EXPERT_LORA = {"plugins": ["lora"], "lora": {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}}
TEXT = ("The Quick Brown Fox jumped over the lazy dog while the cat watched from the window, counting the "
        "birds that flew by the old oak tree.")


def moe_config(tmp_path: Path, model_type: str = "qwen3_moe", **sections) -> Path:
    model = {"name_or_path": str(tiny_moe_folder(model_type)), **sections.pop("model", {})}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return tiny_config(tmp_path, model=model, **sections)


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


@pytest.mark.parametrize("model_type", sorted(TINY_MOE))
def test_grouped_experts_compute_what_the_loop_of_experts_computes(model_type):
    """transformers' grouped_mm experts (a run's default) against its eager loop over the experts, on each
    architecture's tiny config: the same logits and gradients."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(model_type, vocab_size=512)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    results = {}
    for implementation in ("eager", "grouped_mm"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
        assert model.config._experts_implementation == implementation
        out = model(ids, labels=ids)
        out.loss.backward()
        results[implementation] = out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    (loop_logits, loop_grads), (grouped_logits, grouped_grads) = results["eager"], results["grouped_mm"]
    torch.testing.assert_close(grouped_logits, loop_logits, rtol=1e-5, atol=1e-6)
    assert loop_grads.keys() == grouped_grads.keys() and any("experts" in n for n in loop_grads)
    for name in loop_grads:
        torch.testing.assert_close(grouped_grads[name], loop_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _one_sgd_step(tmp_path: Path, coefficient: float | None) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "row.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n")
    config = moe_config(tmp_path, model={"router_aux_loss_coef": coefficient} if coefficient is not None else {},
                        data={"format": "text", "path": str(data), "eval_path": None, "max_seq_len": 64},
                        train={"max_steps": 1, "per_device_batch_size": 1, "optimizer": "sgd", "learning_rate": 1.0,
                               "lr_scheduler": "constant", "weight_decay": 0.0, "max_grad_norm": None,
                               "output_dir": str(tmp_path / "run"), "eval_at_start": False})
    run_cli("train", str(config))
    return AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "final")).state_dict()


@pytest.mark.slow
def test_the_load_balancing_loss_enters_the_gradient_as_transformers_computes_it(tmp_path):
    """One SGD step of learning rate 1 on one text row: every weight moves by minus the gradient of transformers'
    own loss (next-token cross entropy plus router_aux_loss_coef x its load-balancing loss, labels given); with the
    coefficient 0, by the gradient of the cross entropy alone (the router's weights then move otherwise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_moe_folder("qwen3_moe")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]])
    for coefficient, name in ((0.25, "weighted"), (0.0, "off")):
        base = AutoModelForCausalLM.from_pretrained(str(folder), output_router_logits=bool(coefficient),
                                                    router_aux_loss_coef=coefficient)
        before = {n: p.detach().clone() for n, p in base.named_parameters()}
        out = base(ids, labels=ids)
        if coefficient:
            assert float(out.aux_loss.detach()) > 1.0  # Switch's loss: 1 when balanced (top-2 of 8: about 2 here)
        out.loss.backward()
        after = _one_sgd_step(tmp_path / name, coefficient)
        router = "model.layers.0.mlp.gate.weight"
        for param_name, param in base.named_parameters():
            torch.testing.assert_close(before[param_name] - after[param_name], param.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{name}: {param_name}")
        if coefficient:
            weighted_router = base.get_parameter(router).grad.clone()
        else:
            assert not torch.allclose(base.get_parameter(router).grad, weighted_router, rtol=1e-3)


@pytest.mark.slow
def test_two_ranks_train_as_one_process_with_the_same_router_metrics(tmp_path):
    """FSDP2 on 2 gloo ranks with activation checkpointing (each layer's experts computed again in backward) against
    one process accumulating the same 2 micro-batches: the same losses, gradient norms, load-balancing losses and
    tokens per expert (a recomputed layer is not counted twice)."""
    one = moe_config(tmp_path / "one", train={"max_steps": 3, "gradient_accumulation_steps": 2,
                                              "output_dir": str(tmp_path / "one" / "run")})
    two = moe_config(tmp_path / "two", train={"max_steps": 3, "output_dir": str(tmp_path / "two" / "run")},
                     fsdp={"version": 2, "activation_checkpointing": True})
    run_cli("train", str(one))
    proc = run_torchrun(2, "train", str(two))
    assert "experts: 8 per MoE layer, top 2, in 2 layers (grouped_mm) | router load-balancing loss x 0.001" in proc.stdout
    single, ranks = steps(tmp_path / "one" / "run"), steps(tmp_path / "two" / "run")
    assert single.keys() == ranks.keys() == {1, 2, 3}
    assert_saved_as_transformers_saves(tmp_path / "two" / "run" / "final", "qwen3_moe")
    for step in single:
        for key in ("loss", "grad_norm", "router/aux_loss", "router/imbalance", "router/imbalance/layer_0",
                    "router/imbalance/layer_1"):
            assert ranks[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
        assert 1.0 <= single[step]["router/imbalance"] <= 8 / 2  # at most every token of a layer on top_k experts
        assert single[step]["router/aux_loss"] > 1.0


def pytest_generate_tests(metafunc):
    """CI trains DeepSeek-V3 (latent attention, a shared expert, a dense first layer, no load-balancing loss) and
    Mixtral (its hub names renamed) on 2 ranks; ``--full-matrix`` gpt-oss too (eager attention, expert biases), to
    keep CI inside its budget. Expert parallelism on 2 ranks against one process: Mixtral in CI, every architecture
    with ``--full-matrix``. Every architecture's grouped experts are checked against the loop in CI."""
    if "ep_type" in metafunc.fixturenames:  # (CI: DeepSeek-V3 on 4 ranks; Qwen3-MoE at ep 2 against ep 1 in
        # tests/test_combinations.py, resumed across the two)
        metafunc.parametrize("ep_type", sorted(TINY_MOE) if metafunc.config.getoption("full_matrix") else
                             ["mixtral"])
    if "ep4_case" in metafunc.fixturenames:
        metafunc.parametrize("ep4_case", ["deepseek_v3", "qwen3_moe_expert_lora"]
                             if metafunc.config.getoption("full_matrix") else ["deepseek_v3"])
    if "trained_type" in metafunc.fixturenames:
        full = metafunc.config.getoption("full_matrix")
        metafunc.parametrize("trained_type", ["mixtral", "gpt_oss", "deepseek_v3"] if full else
                             ["mixtral", "deepseek_v3"])


@pytest.mark.slow
def test_every_architecture_trains_on_two_ranks_with_the_loop_of_experts(tmp_path, trained_type):
    """Mixtral, gpt-oss and DeepSeek-V3 (grouped routing, a shared expert, a dense first layer) through the same path
    on 2 FSDP2 ranks, their experts in transformers' eager loop: the loss falls, the router is watched (DeepSeek-V3
    has no load-balancing loss in transformers: none is added or reported), and the export reloads, in the layout
    transformers saves (Mixtral's and DeepSeek-V3's one tensor per expert, gpt-oss's fused)."""
    from transformers import AutoModelForCausalLM

    model_type = trained_type
    attention = {"attn_implementation": "eager"} if model_type == "gpt_oss" else {}  # (its sinks: no sdpa)
    config = moe_config(tmp_path, model_type, model={"experts_implementation": "eager", **attention},
                        train={"max_steps": 4, "learning_rate": 1e-2})
    proc = run_torchrun(2, "train", str(config))
    assert "(eager) |" in proc.stdout
    metrics = steps(tmp_path / "run")
    assert metrics[4]["loss"] < metrics[1]["loss"]
    assert ("router/aux_loss" in metrics[1]) == (model_type != "deepseek_v3")
    moe_layers = [0, 1] if model_type != "deepseek_v3" else [1]
    assert sorted(k for k in metrics[1] if k.startswith("router/imbalance/")) == [
        f"router/imbalance/layer_{i}" for i in moe_layers]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "final"))
    assert model.config.model_type == model_type
    assert_saved_as_transformers_saves(tmp_path / "run" / "final", model_type)


def assert_saved_as_transformers_saves(folder: Path, model_type: str) -> None:
    """The exported weights hold the tensor names and shapes transformers' save_pretrained writes for the
    architecture (one tensor per expert and projection where the hub's checkpoints hold them so), as the tiny
    folder it started from does."""
    from safetensors import safe_open

    def shapes(path: Path) -> dict[str, list[int]]:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}

    assert shapes(folder) == shapes(tiny_moe_folder(model_type))


@pytest.mark.slow
def test_expert_keys_are_refused_where_the_architecture_cannot_take_them(tmp_path):
    """model.experts_implementation on a dense model, a router loss weight on DeepSeek-V3 (no load-balancing loss in
    transformers) and gpt-oss with sdpa (transformers' class has none), each named before any weight loads with what
    to do, no traceback; an unknown implementation at validation; nothing trains."""
    (tmp_path / "dense").mkdir()
    dense = tiny_config(tmp_path / "dense", model={"name_or_path": "smollm2-tiny", "experts_implementation": "eager"})
    proc = run_cli("train", str(dense), check=False)
    assert proc.returncode != 0
    assert "model.experts_implementation" in proc.stderr + proc.stdout
    assert "llama is a dense model" in proc.stderr + proc.stdout
    deepseek = moe_config(tmp_path / "deepseek", "deepseek_v3", model={"router_aux_loss_coef": 0.01})
    proc = run_cli("train", str(deepseek), check=False)
    output = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "deepseek_v3 has no auxiliary load-balancing loss" in output
    assert not (tmp_path / "deepseek" / "run" / "final").exists()
    gpt_oss = moe_config(tmp_path / "gpt_oss", "gpt_oss")  # sdpa, the default kernel
    proc = run_cli("train", str(gpt_oss), check=False)
    output = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "Traceback" not in output
    assert "gpt_oss (GptOssForCausalLM) does not implement sdpa in transformers: set model.attn_implementation: " \
           "eager" in output
    for lora, said in (({**EXPERT_LORA["lora"], "dropout": 0.05}, "lora.dropout: 0.05 with lora.target_parameters"),
                       ({"target_parameters": ["mlp.experts.gate_proj"]},
                        "lora.target_parameters: mlp.experts.gate_proj names no parameter of this model (its "
                        "experts': mlp.experts.down_proj, mlp.experts.gate_up_proj)")):
        adapters = moe_config(tmp_path / "lora", plugins=["lora"], lora=lora)
        proc = run_cli("train", str(adapters), check=False)
        assert proc.returncode == 2 and said in proc.stderr + proc.stdout, proc.stderr[-2000:]
    bad = yaml.safe_load(dense.read_text())
    bad["model"]["experts_implementation"] = "megablocks"
    dense.write_text(yaml.safe_dump(bad))
    proc = run_cli("validate", str(dense), check=False)
    assert proc.returncode != 0 and "grouped_mm" in proc.stderr + proc.stdout


def test_model_flops_count_the_experts_a_token_is_routed_to():
    """A step's model FLOPs (tflops, MFU) count of each MoE layer's routed experts the top_k a token computes with
    (2 of 8 here), not all of them; a shared expert and everything else in full."""
    from transformers import AutoModelForCausalLM

    from hfsdp.run.throughput import FlopsModel

    config = tiny_moe_config("qwen3_moe", vocab_size=512)
    model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    assert experts > 0
    flops = FlopsModel.of(model, config)
    assert flops.params == total - experts + experts * 2 // 8 and flops.trainable == flops.params
    assert embedding == 512 * 64  # tied: counted once, as the head



@pytest.mark.slow
@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.full_matrix), 2])
def test_lora_on_the_experts_trains_on_two_ranks_resumes_and_exports_what_peft_loads(tmp_path, ep):
    """LoRA on the fused expert weights (peft's target_parameters) besides the attention Linears: 2 FSDP2 ranks
    train as one process accumulating the same micro-batches, a resume from step 2 ends bit for bit where the run
    ended, the exported adapter loads in peft on the base, and the merged export (hfsdp export --merge-lora) is the
    model peft merges: the same logits. With expert parallelism (ep 2: each rank its 4 experts and their factors)
    too, whose checkpoint also resumes at ep 1."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from test_combinations import assert_resumed_exactly, resume_from

    train = {"max_steps": 4, "save_every": 2, "lr_scheduler": "constant", "learning_rate": 1e-2}
    one = moe_config(tmp_path / "one", plugins=EXPERT_LORA["plugins"], lora=EXPERT_LORA["lora"],
                     train={**train, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "one" / "run")})
    two = moe_config(tmp_path / "two", plugins=EXPERT_LORA["plugins"], lora=EXPERT_LORA["lora"],
                     train={**train, "output_dir": str(tmp_path / "two" / "run")},
                     **({"parallel": {"ep_size": ep}, "fsdp": {"version": 2}} if ep > 1 else {}))
    run_cli("train", str(one))
    proc = run_torchrun(2, "train", str(two))
    assert "on k_proj, o_proj, q_proj, v_proj, mlp.experts.gate_up_proj, mlp.experts.down_proj:" in proc.stdout
    assert ("4 on each rank (expert parallel over 2 ranks)" in proc.stdout) == (ep > 1)
    run = tmp_path / "two" / "run"
    single, ranks = steps(tmp_path / "one" / "run"), steps(run)
    for step in (1, 2, 3, 4):
        for key in ("loss", "grad_norm", "router/imbalance"):
            assert ranks[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
    assert_resumed_exactly(resume_from(tmp_path / "resumed", run, 2, step=2), run)
    if ep > 1:  # the factors are saved whole, in peft's layout: the checkpoint resumes without expert parallelism
        other = resume_from(tmp_path / "at_ep1", run, 2, step=2, changes={"parallel": {"ep_size": 1}})
        resumed_steps, run_steps = steps(other), steps(run)
        for step in (3, 4):
            for key in ("loss", "grad_norm"):
                assert resumed_steps[step][key] == pytest.approx(run_steps[step][key], rel=1e-5), (step, key)

    adapter = load_file(run / "final" / "adapter_model.safetensors")
    experts_b = [k for k in adapter if ".mlp.experts." in k and "lora_B" in k]
    assert len(experts_b) == 4 and all(adapter[k].abs().max() > 0 for k in experts_b)  # 2 layers x 2 weights
    base = AutoModelForCausalLM.from_pretrained(str(tiny_moe_folder("qwen3_moe")))
    peft_model = PeftModel.from_pretrained(base, str(run / "final"))
    ids = torch.randint(0, 49152, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model(ids).logits
    run_cli("export", str(run / "checkpoints" / "step-4"), str(tmp_path / "merged"), "--merge-lora")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        got = merged(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(str(tiny_moe_folder("qwen3_moe"))).state_dict()
    unloaded = peft_model.merge_and_unload().state_dict()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        torch.testing.assert_close(merged.state_dict()[name], unloaded[name], rtol=1e-5, atol=1e-6)
        assert not torch.equal(merged.state_dict()[name], original[name])  # the experts' adapters merged in


@pytest.mark.slow
def test_plan_says_the_parameters_a_token_computes_with(tmp_path):
    """``hfsdp plan`` of Qwen3-30B-A3B (the architecture hfsdp ships): its 30.5B parameters and the 3.35B a token
    computes with (8 of each layer's 128 experts), as Qwen's model card gives them (30.5B, 3.3B activated); with
    the example's LoRA on the experts, the adapters of the experts a token is routed to count as active too."""
    from conftest import REPO

    example = REPO / "examples" / "qwen3-30b-a3b-lora-chat.yaml"
    full = yaml.safe_load(example.read_text())
    del full["plugins"], full["lora"]
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(full))
    plan = json.loads(run_cli("plan", str(tmp_path / "full.yaml"), "--nproc", "8", "--json").stdout)
    assert round(plan["parameters"] / 1e9, 1) == 30.5 and round(plan["active_parameters"] / 1e9, 2) == 3.35
    text = run_cli("plan", str(example), "--nproc", "8", "--strategies", "FULL_SHARD").stdout
    assert "31.17B parameters (3.41B active a token, 642.5M trainable)" in text


def test_the_router_loss_is_computed_in_training_forwards_only():
    """A run's MoE model computes its load-balancing loss in a forward with autograd on (training) and never while
    it samples: a padded batch's decoding steps have fewer router logits than the padding mask has positions, which
    transformers' loss would refuse (a GRPO round, an evaluation's generation)."""
    from hfsdp.config.schema import ModelConfig
    from hfsdp.model import experts
    from hfsdp.model.loading import load_model

    cfg = ModelConfig(name_or_path=str(tiny_moe_folder("qwen3_moe")))
    model = load_model(cfg.name_or_path, cfg)
    router = experts.Router(model, coefficient=0.001)
    ids = torch.tensor([[5, 6, 7, 8], [2, 2, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=2)
    assert out.shape == (2, 7) and router.take_loss(1) is None
    router.start_step()
    model(input_ids=ids, attention_mask=mask)
    loss = router.take_loss(2)
    assert loss is not None and loss.requires_grad and float(loss) == pytest.approx(0.001 / 2 * float(
        model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss), rel=1e-6)
    assert router.metrics_of(router.sums())["router/imbalance"] >= 1


def _ep_pair(tmp_path: Path, model_type: str, ranks_sections: dict, **sections):
    """Configs of one process accumulating as many micro-batches as ``ranks`` ranks' and of the ranks' run."""
    ranks = ranks_sections.pop("ranks")
    one = moe_config(tmp_path / "one", model_type, **sections,
                     train={"max_steps": 4, "gradient_accumulation_steps": ranks, "learning_rate": 1e-2,
                            "output_dir": str(tmp_path / "one" / "run")})
    split = moe_config(tmp_path / "ep", model_type, **sections, **ranks_sections,
                       train={"max_steps": 4, "learning_rate": 1e-2, "output_dir": str(tmp_path / "ep" / "run")})
    return one, split


@pytest.mark.slow
def test_expert_parallel_ranks_train_as_one_process(tmp_path, ep_type):
    """ep 2 on 2 gloo ranks (each rank holds 4 of the 8 experts of each layer and trains on its own rows, tokens sent
    to their experts' rank and back) against one process accumulating the same 2 micro-batches, on each
    architecture: the same losses, gradient norms and router metrics over 4 steps, and the export holds every expert
    in the layout transformers saves."""
    attention = {"model": {"attn_implementation": "eager"}} if ep_type == "gpt_oss" else {}  # (its sinks: no sdpa)
    one, split = _ep_pair(tmp_path, ep_type, {"ranks": 2, "parallel": {"ep_size": 2}, "fsdp": {"version": 2}},
                          **attention)
    run_cli("train", str(one))
    proc = run_torchrun(2, "train", str(split))
    assert "4 on each rank (expert parallel over 2 ranks)" in proc.stdout
    single, ranks = steps(tmp_path / "one" / "run"), steps(tmp_path / "ep" / "run")
    assert single.keys() == ranks.keys() == {1, 2, 3, 4}
    layers = [0, 1] if ep_type != "deepseek_v3" else [1]
    for step in single:
        for key in ("loss", "grad_norm", *(f"router/imbalance/layer_{i}" for i in layers),
                    *(("router/aux_loss",) if ep_type != "deepseek_v3" else ())):
            assert ranks[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
    assert_saved_as_transformers_saves(tmp_path / "ep" / "run" / "final", ep_type)


@pytest.mark.slow
def test_expert_parallel_groups_with_expert_shards_train_as_one_process(tmp_path, ep4_case):
    """ep 2 x dp 2 on 4 gloo ranks (2 groups of 2 ranks, each expert held by 2 ranks that FSDP2 shards it over)
    against one process accumulating the same 4 micro-batches: the same losses and gradient norms over 4 steps. CI:
    DeepSeek-V3 (a dense first layer, a shared expert, grouped routing); with ``--full-matrix`` also Qwen3-MoE with
    LoRA on its experts (each rank's experts' factors of the whole ones, their gradients summed over the group)."""
    model_type, sections = {"deepseek_v3": ("deepseek_v3", {}), "qwen3_moe_expert_lora": ("qwen3_moe", EXPERT_LORA)}[
        ep4_case]
    one, split = _ep_pair(tmp_path, model_type, {"ranks": 4, "parallel": {"ep_size": 2}, "fsdp": {"version": 2}},
                          **sections)
    run_cli("train", str(one))
    proc = run_torchrun(4, "train", str(split))
    assert "over dp 4, experts over expert parallel 2 x efsdp 2" in proc.stdout
    layers = [1] if model_type == "deepseek_v3" else [0, 1]
    assert (f"experts: 8 per MoE layer, top 2, in {len(layers)} layers, 4 on each rank (expert parallel over 2 "
            "ranks)") in proc.stdout
    single, ranks = steps(tmp_path / "one" / "run"), steps(tmp_path / "ep" / "run")
    assert single.keys() == ranks.keys() == {1, 2, 3, 4}
    for step in single:
        for key in ("loss", "grad_norm", *(f"router/imbalance/layer_{i}" for i in layers)):
            assert ranks[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
