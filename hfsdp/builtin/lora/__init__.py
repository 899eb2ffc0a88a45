"""Plugin ``lora``: train LoRA adapters (peft) instead of the full model. Enable with ``plugins: [lora]``.

Config section ``lora:`` (all optional): its keys, types and defaults are those of :class:`LoraSection`
(``hfsdp config-reference lora``, docs/configuration.md).

Export (end of training and ``hfsdp export CHECKPOINT OUT``): ``adapter_model.safetensors`` + ``adapter_config.json``
+ tokenizer, loadable with ``peft.PeftModel.from_pretrained(base, OUT)``; with ``merge: true`` (or
``hfsdp export --merge-lora``) a plain Hugging Face folder whose weights are ``W + (B @ A) * alpha / r``.

FSDP pitfalls this plugin avoids:

* FSDP1 flattens a unit's parameters into one flat parameter, which then needs one ``requires_grad`` and one dtype:
  frozen base weights next to trainable adapters only work with ``use_orig_params: true`` (a config error otherwise).
* FSDP1 with a single shard (one process with ``fsdp.single_process: fsdp``, or NO_SHARD) of a model with tied
  embeddings trips a torch assertion once the flat parameter holding the tied weights is frozen; that combination is
  refused with a pointer to FSDP2 (FSDP1 on two or more ranks works, and one process runs unwrapped by default).
* peft upcasts adapters of a bf16/fp16 base to fp32 by default; FSDP (1 and 2) refuse units with mixed parameter
  dtypes. Adapters here always take the base weights' dtype; keep ``model.dtype: float32`` with
  ``fsdp.mixed_precision: bf16`` for fp32 master adapters with bf16 compute.
* Tied embeddings: an adapter or a trainable copy on ``embed_tokens``/``lm_head`` of a model that ties them would
  untie them silently, so the merged export could not reproduce the trained model; that is refused.
* The export receives the full state dict gathered from every rank (not the local shards), and every adapter tensor
  is checked against the shape the architecture implies before the folder is renamed into place.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.config.schema import Section
from hfsdp.errors import ConfigError, UserError
from hfsdp.model import vision
from hfsdp.rules.table import Rule

ADAPTER = "default"
PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraSection(Section):
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; updates are scaled by alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: list[str] | None = Field(
        None, description="module names to adapt; default: every Linear inside the decoder blocks (not lm_head)"
    )
    target_parameters: list[str] | None = Field(
        None, description="parameters to adapt that are not a Linear's weight, as peft's target_parameters: a "
                          "mixture of experts' fused expert weights, e.g. [mlp.experts.gate_up_proj, "
                          "mlp.experts.down_proj] (docs/guide.md: Mixture-of-experts); default: none")
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", description="biases trained: none, all, or those of adapted modules")
    modules_to_save: list[str] | None = Field(None, description="modules trained in full next to the adapters")
    merge: bool = Field(False, description="export merged full weights instead of the adapter")


@hookimpl
def hfsdp_config_section():
    return "lora", LoraSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("lora", "fsdp.use_orig_params", "parallel.tp_size"), config_problems),
            Rule("model", ("lora.target_modules", "lora.modules_to_save", "fsdp.version"), model_problems)]


def config_problems(config, facts) -> list[tuple[str, str]]:
    problems = []
    section: LoraSection = config.section("lora")
    if config.fsdp.version == 1 and config.fsdp.use_orig_params is False:
        problems.append(("fsdp.use_orig_params",
                         "LoRA under FSDP1 needs use_orig_params: true (the default): a flat parameter that mixes "
                         "frozen base weights and trainable adapters is only allowed with original parameters"))
    if section.target_modules is not None and not section.target_modules:
        problems.append(("lora.target_modules", "empty list: leave it out to adapt every Linear of the decoder blocks"))
    if config.parallel.tp_size > 1:
        problems.append(("parallel.tp_size", "LoRA's adapters are not split by the tensor-parallel plan (peft wraps "
                                             "the Linears the plan splits): remove the lora plugin, or set "
                                             "parallel.tp_size: 1"))
    return problems


def default_target_modules(model, fsdp) -> list[str]:
    """Names of the nn.Linear modules inside the decoder blocks, the layer classes FSDP wraps (never the output
    head): each module's own name, or with its parent's where it is a position in a ``Sequential`` (Qwen2.5-VL's
    projector ``merger.mlp.0``: ``mlp.0``, since peft would take ``0`` for every module named so, decoder layers
    included)."""
    import torch

    from hfsdp.model.loading import layer_classes

    classes = set(layer_classes(fsdp, model.config))
    blocks = [m for m in model.modules() if type(m).__name__ in classes] or [model]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        ".".join(name.split(".")[-2:]) if name.rsplit(".", 1)[-1].isdigit() else name.rsplit(".", 1)[-1]
        for block in blocks for name, module in block.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and name
    }
    if not names:
        raise ConfigError([("lora.target_modules", "found no Linear layer in the decoder blocks; name the modules")])
    return sorted(names)


def resolved_targets(model, config, section: LoraSection) -> list[str]:
    """The modules LoRA adapts in ``model``: ``lora.target_modules``, or :func:`default_target_modules`."""
    return section.target_modules or default_target_modules(model, config.fsdp)


def peft_config(section: LoraSection, target_modules: list[str], exclude_modules: str | None = None):
    from peft import LoraConfig

    return LoraConfig(
        r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, target_modules=list(target_modules),
        target_parameters=section.target_parameters, bias=section.bias, modules_to_save=section.modules_to_save,
        exclude_modules=exclude_modules, task_type="CAUSAL_LM",
    )


def _check_tied(model, targets: list[str], modules_to_save: list[str] | None) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    tied = {name for name, module in model.named_modules()
            if module is model.get_input_embeddings() or module is model.get_output_embeddings()}
    leaves = tied | {name.rsplit(".", 1)[-1] for name in tied}
    for key, names in (("lora.target_modules", targets), ("lora.modules_to_save", modules_to_save or [])):
        clash = sorted(set(names) & leaves)
        if clash:
            raise ConfigError([(key, f"{', '.join(clash)} is tied to the {'input' if 'embed' in clash[0] else 'output'} "
                                     "embeddings of this model (tie_word_embeddings); adapting it would untie them "
                                     "and the export could not reproduce the trained model: leave it out")])


def adapted(model, config, section: LoraSection):
    """``model`` with LoRA adapters (peft), or ConfigError for targets the model does not have or that would untie
    its embeddings. Adapters take the base weights' dtype (``autocast_adapter_dtype=False``), so that every FSDP
    unit has one parameter dtype."""
    from peft import get_peft_model

    targets = resolved_targets(model, config, section)
    _check_tied(model, targets, section.modules_to_save)
    names = [name for name, _ in model.named_parameters()]
    unmatched = [t for t in section.target_parameters or [] if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched:
        experts = sorted({n.split(".", 3)[-1] for n in names if ".experts." in n and n.count(".") >= 3})
        raise ConfigError([("lora.target_parameters", f"{', '.join(unmatched)} names no parameter of this model"
                                                      + (f" (its experts': {', '.join(experts)})" if experts else ""))])
    # a vision-language model's frozen tower and projector (model.freeze) get no adapters
    excluded = vision.excluded_modules(model, config.model.freeze) if config.model.freeze else None
    try:
        return get_peft_model(model, peft_config(section, targets, excluded), autocast_adapter_dtype=False)
    except ValueError as err:  # e.g. "Target modules {...} not found in the base model"
        said = str(err)
        if section.target_parameters and "lora_dropout" in said:
            raise ConfigError([("lora.dropout", f"{section.dropout:g} with lora.target_parameters: peft's adapters "
                                                f"of parameters take no dropout ({said}): set lora.dropout: 0")]) from None
        key = ("lora.target_parameters" if section.target_parameters and ("target_parameters" in said
                                                                         or "ParamWrapper" in said)
               else "lora.target_modules")
        raise ConfigError([(key, said)]) from None


def _meta_adapted(model_config, config, section: LoraSection):
    """:func:`adapted` on the meta device, adapters included: names and shapes, no memory, no weights."""
    import torch

    from hfsdp.model.loading import meta_model

    with torch.device("meta"):
        return adapted(meta_model(model_config, config.model.trust_remote_code), config, section)


_META_CHECKS: dict[str, list[tuple[str, str]]] = {}  # key of target_problems -> its problems


def target_problems(model_config, config, section: LoraSection) -> list[tuple[str, str]]:
    """:func:`adapted` on the meta device (no memory, no weights): the targets the model lacks, or that would untie
    its embeddings, before any weight loads. Remembered per architecture, section and layer classes (``hfsdp plan``
    asks for every row)."""
    import json

    key = json.dumps([model_config.to_json_string(), section.model_dump(mode="json"),
                      config.fsdp.transformer_layer_cls, config.model.trust_remote_code])
    if key not in _META_CHECKS:
        try:
            _meta_adapted(model_config, config, section)
            _META_CHECKS[key] = []
        except ConfigError as err:
            _META_CHECKS[key] = err.problems
    return _META_CHECKS[key]


def model_problems(config, facts) -> list[tuple[str, str]]:
    """What the architecture and the degrees refuse of the adapters, before any weight loads."""
    model_config, dims = facts.model_config, facts.world.dims
    problems = list(target_problems(model_config, config, config.section("lora")))
    single_shard = dims.shard_group * dims.tp == 1  # one process, or replicas only (NO_SHARD)
    if dims.wrapper == "fsdp1" and single_shard and getattr(model_config, "tie_word_embeddings", False):
        # torch's FSDP1 unshard path for a frozen flat parameter holding tied weights asserts
        # ("as_params=True type(prim_param)=<class 'torch.Tensor'>") on the first training forward.
        problems.append(("fsdp.version", "LoRA on a model with tied embeddings under FSDP1 with a single shard "
                                         "(one process or NO_SHARD) hits a torch FSDP1 bug with frozen shared "
                                         "weights: use fsdp.version: 2 (the default), or more than one rank"))
    return problems


@hookimpl
def hfsdp_modify_model(model, config, world):
    section: LoraSection = config.section("lora")
    base_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    peft_model = adapted(model, config, section)
    targets = sorted(peft_model.peft_config[ADAPTER].target_modules) + list(section.target_parameters or [])
    for p in peft_model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != base_dtype:
            p.data = p.data.to(base_dtype)
    if world.rank == 0:
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in peft_model.parameters())
        print(f"lora: r={section.r} alpha={section.alpha:g} on {', '.join(targets)}: {trainable:,} trainable of "
              f"{total:,} parameters ({100 * trainable / total:.2f}%), adapters in {str(base_dtype).removeprefix('torch.')}",
              flush=True)
    return peft_model


# ---- export


def _is_lora_key(key: str) -> bool:
    return any(part.startswith("lora_") for part in key.split("."))


def _meta_peft_model(model_config, config, section: LoraSection):
    """The peft-wrapped architecture on the meta device and its LoRA config."""
    model = _meta_adapted(model_config, config, section)
    lora_cfg = model.peft_config[ADAPTER]
    lora_cfg.base_model_name_or_path = config.model.name_or_path  # what adapter_config.json names as the base
    return model, lora_cfg


def write_adapter(state_dict: Mapping[str, Any], model_config, tokenizer, out_dir: Path, config) -> Path:
    """``adapter_model.safetensors`` + ``adapter_config.json`` (+ tokenizer) in peft's own format, verified, written
    into ``out_dir`` (the empty folder the ``hfsdp_export`` hook receives; hfsdp renames it into place)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    section: LoraSection = config.section("lora")
    meta_model, lora_cfg = _meta_peft_model(model_config, config, section)
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(meta_model, save_embedding_layers=False).items()}
    wanted = [k for k in state_dict if _is_lora_key(k) or ".modules_to_save." in k
              or (section.bias != "none" and k.endswith(".bias"))]
    if not any(_is_lora_key(k) for k in wanted):
        raise UserError("lora export: the weights hold no LoRA adapter (was this run trained with the lora plugin?)")
    adapter = get_peft_model_state_dict(meta_model, state_dict={k: state_dict[k] for k in wanted},
                                        save_embedding_layers=False)
    problems = [f"missing {k}" for k in sorted(set(expected) - set(adapter))]
    problems += [f"unexpected {k}" for k in sorted(set(adapter) - set(expected))]
    problems += [f"{k} has shape {list(v.shape)}, expected {list(expected[k])}"
                 for k, v in adapter.items() if k in expected and tuple(v.shape) != expected[k]]
    if problems:
        raise UserError(f"lora export: the adapter does not match the model ({len(problems)} problem(s)): "
                        + "; ".join(problems[:4]))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}, str(out_dir / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    lora_cfg.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    reread = load_file(str(out_dir / ADAPTER_WEIGHTS))
    if set(reread) != set(expected) or any(t.numel() == 0 for t in reread.values()):
        raise UserError(f"lora export: {ADAPTER_WEIGHTS} did not read back complete")
    return out_dir


class MergedWeights(Mapping):
    """The base model's weights with the adapters merged in (``W + (B @ A) * alpha / r``), computed lazily one
    tensor at a time from a peft state dict, under the base model's names."""

    def __init__(self, state_dict: Mapping[str, Any], section: LoraSection,
                 parameters: dict[str, tuple[str, str, int, bool]] | None = None):
        self.sd = state_dict
        self.section = section
        self.scaling = section.alpha / section.r
        self.parameters = parameters or {}  # lora.target_parameters' (parameter_merges)
        self.sources: dict[str, str] = {}
        keys = list(state_dict)
        keyset = set(keys)
        for key in keys:
            if not key.startswith(PREFIX):
                raise UserError(f"lora export: '{key}' is not a peft model weight (expected names under {PREFIX})")
            if _is_lora_key(key) or ".original_module." in key:
                continue
            name = re.sub(r"\.base_layer(?=\.)", "", key[len(PREFIX):]).replace(f".modules_to_save.{ADAPTER}.", ".")
            self.sources[name] = key
        self.merges: dict[str, tuple[str, str, bool]] = {}
        for name, key in self.sources.items():
            if name in self.parameters:
                continue
            if ".base_layer." not in key or not key.endswith(".weight"):
                continue
            module = key.rsplit(".base_layer.", 1)[0]
            linear = (f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight")
            embedding = (f"{module}.lora_embedding_A.{ADAPTER}", f"{module}.lora_embedding_B.{ADAPTER}")
            for (a, b), is_embedding in ((linear, False), (embedding, True)):
                if a in keyset and b in keyset:
                    self.merges[name] = (a, b, is_embedding)
        missing = [key for a, b, _, _ in self.parameters.values() for key in (a, b) if key not in keyset]
        if missing:
            raise UserError(f"lora export: the weights lack the adapters of lora.target_parameters: {missing[:2]}")
        if not self.merges and not self.parameters:
            raise UserError("lora export: the weights hold no LoRA adapter to merge")

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, name: str):
        weight = self.sd[self.sources[name]]
        if name in self.parameters:
            return self._merged_parameter(name, weight)
        if name not in self.merges:
            return weight
        a_key, b_key, is_embedding = self.merges[name]
        a, b = self.sd[a_key].float(), self.sd[b_key].float()
        if a.shape[0] != self.section.r:
            raise UserError(f"lora export: {a_key} has rank {a.shape[0]}, but lora.r is {self.section.r}")
        delta = b @ a
        if is_embedding:
            delta = delta.T
        if tuple(delta.shape) != tuple(weight.shape):
            raise UserError(f"lora export: cannot merge {a_key} into {name}: shapes {list(delta.shape)} "
                            f"vs {list(weight.shape)}")
        return (weight.float() + delta * self.scaling).to(weight.dtype)

    def _merged_parameter(self, name: str, weight):
        """A parameter peft adapted in place (``ParamWrapper``) merged as peft's ``get_delta_weight`` merges it: the
        adapters of ``experts`` stacked experts, each ``B_e @ A_e`` in the parameter's layout."""
        import torch

        a_key, b_key, experts, swapped = self.parameters[name]
        a, b = self.sd[a_key].float(), self.sd[b_key].float()
        if experts == 1:
            delta = b @ a
        else:
            a = a.reshape(experts, -1, a.shape[-1])  # experts x rank x in
            b = b.reshape(b.shape[0], -1, experts)  # out x rank x experts
            delta = torch.einsum("o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", b, a)
        if tuple(delta.shape) != tuple(weight.shape):
            raise UserError(f"lora export: cannot merge {a_key} into {name}: shapes {list(delta.shape)} "
                            f"vs {list(weight.shape)}")
        return (weight.float() + delta * self.scaling).to(weight.dtype)


def parameter_merges(model_config, config, section: LoraSection) -> dict[str, tuple[str, str, int, bool]]:
    """For ``lora.target_parameters``: each adapted parameter's name in the base model, its adapter's A and B keys,
    the experts it stacks and whether peft swapped its in and out features (a layout of experts x out x in), read
    off peft's wrappers on the meta device."""
    if not section.target_parameters:
        return {}
    from peft.tuners.lora.layer import ParamWrapper

    model, _ = _meta_peft_model(model_config, config, section)
    merges = {}
    for path, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            base = re.sub(r"\.base_layer(?=\.|$)", "", path)[len(PREFIX):]
            merges[f"{base}.{module.parameter_name}"] = (f"{path}.lora_A.{ADAPTER}.weight",
                                                         f"{path}.lora_B.{ADAPTER}.weight", module.num_experts,
                                                         module._did_swap_in_out_features)
    return merges


@hookimpl
def hfsdp_trains_adapters():
    return True


@hookimpl
def hfsdp_export(state_dict, model_config, tokenizer, out_dir, generation_config, config, max_shard_bytes,
                 merge_adapters):
    from hfsdp.export.hf_folder import write_hf_folder

    section: LoraSection = config.section("lora")
    if section.merge or merge_adapters:
        write_hf_folder(MergedWeights(state_dict, section, parameter_merges(model_config, config, section)),
                        model_config, tokenizer, Path(out_dir),
                        generation_config=generation_config, max_shard_bytes=max_shard_bytes)
    else:
        write_adapter(state_dict, model_config, tokenizer, Path(out_dir), config)
    return True
