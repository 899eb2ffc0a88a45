"""Mixture-of-experts models (issue 71): the experts implementation a run asks for, the router's load-balancing loss
in the gradient as transformers computes it, its metrics, and ranks that train as one process does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (TINY_MOE, read_metrics, run_cli, run_torchrun, tiny_config, tiny_moe_config, tiny_moe_folder)

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
    from safetensors.torch import load_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "row.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n")
    config = moe_config(tmp_path, model={"router_aux_loss_coef": coefficient} if coefficient is not None else {},
                        data={"format": "text", "path": str(data), "eval_path": None, "max_seq_len": 64},
                        train={"max_steps": 1, "per_device_batch_size": 1, "optimizer": "sgd", "learning_rate": 1.0,
                               "lr_scheduler": "constant", "weight_decay": 0.0, "max_grad_norm": None,
                               "output_dir": str(tmp_path / "run"), "eval_at_start": False})
    run_cli("train", str(config))
    return load_file(tmp_path / "run" / "final" / "model.safetensors")


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
    for step in single:
        for key in ("loss", "grad_norm", "router/aux_loss", "router/imbalance", "router/imbalance/layer_0",
                    "router/imbalance/layer_1"):
            assert ranks[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
        assert 1.0 <= single[step]["router/imbalance"] <= 8 / 2  # at most every token of a layer on top_k experts
        assert single[step]["router/aux_loss"] > 1.0


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_every_architecture_trains_on_two_ranks_with_the_loop_of_experts(tmp_path, model_type):
    """Mixtral, gpt-oss and DeepSeek-V3 (grouped routing, a shared expert, a dense first layer) through the same path
    on 2 FSDP2 ranks, their experts in transformers' eager loop: the loss falls, the router is watched (DeepSeek-V3
    has no load-balancing loss in transformers: none is added or reported), and the export reloads."""
    from transformers import AutoModelForCausalLM

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
