"""The training config's schema: the pydantic sections, each key with its default, type and description (what
``hfsdp config-reference`` prints). Unknown keys are errors everywhere (``extra="forbid"``). Validating a raw config
is :mod:`hfsdp.config.validate`; reading config files is :mod:`hfsdp.config.files`.
This module imports neither torch nor transformers, so ``hfsdp validate`` and ``--help`` stay fast.
"""

from __future__ import annotations

import importlib.util
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


DType = Literal["float32", "bfloat16", "float16"]
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


def _dtype_alias(value: Any) -> Any:
    return _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


class MayChangeOnResume:
    """Marks a key a resume may change (:data:`Resumable`)."""


T = typing.TypeVar("T")
# A key that may change between a checkpoint and its resume: the same steps trained, reported, saved or computed
# otherwise (how long the run goes, how often it logs, evaluates and saves, the layout over the ranks, the batch keys
# while the global batch stays); a checkpoint's fingerprint of its config leaves these out (hfsdp.setup.record).
Resumable = typing.Annotated[T, MayChangeOnResume()]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, numbers given for strings are accepted."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_default=True)


# model.attn_implementation: the transformers attention kernels hfsdp runs; which are usable where is checked at
# start-up (hfsdp.rules.attention.attention_problems), before any weight loads.
ATTENTION_KERNELS = ("sdpa", "eager", "flash_attention_2", "flex_attention")
# transformers' implementations of a mixture-of-experts layer's experts (``model.experts_implementation``).
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


QuantStorage = Literal["uint8", "float32", "bfloat16", "float16"]


class QuantizationConfig(Section):
    """``model.quantization``: load the base model in 4 bits (bitsandbytes, through transformers'
    BitsAndBytesConfig) and train LoRA adapters on top (QLoRA; needs the lora plugin)."""

    bits: Literal[4, 8] = Field(description="4: bitsandbytes 4-bit Linear layers (QLoRA; FSDP2); 8 is refused under FSDP.")
    quant_type: Literal["nf4", "fp4"] | None = Field(None, description="4-bit data type (default nf4).")
    double_quant: bool | None = Field(None, description="quantize the per-block scales too (default true).")
    compute_dtype: DType | None = Field(
        None, description="dtype the 4-bit weights are dequantized to for each matmul; default: the mixed-precision "
                          "param dtype, else model.dtype.")
    quant_storage: QuantStorage | None = Field(
        None, description="dtype the packed 4-bit data is stored in; default: the dtype FSDP2 gathers in (the "
                          "mixed-precision param dtype, else model.dtype): sharded; uint8: kept whole on every rank.")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: _dtype_alias(v) if k in ("compute_dtype", "quant_storage") else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _eight_bit(self) -> "QuantizationConfig":
        if self.bits == 8:
            given = [k for k in ("quant_type", "double_quant", "quant_storage") if getattr(self, k) is not None]
            raise ValueError("bits 8 is not supported: bitsandbytes' 8-bit weights keep their scales on the "
                             "parameter, which FSDP replaces when it shards" +
                             (f", and {', '.join(given)} only apply to 4 bits" if given else "") + "; use bits: 4")
        return self


# The models hfsdp builds itself, without the hub (hfsdp.model.loading builds them): their names
BUILTIN_MODEL_NAMES = ("smollm2-135m-instruct", "smollm2-tiny", "smollm2-bench", "smolvlm-135m")


class ModelConfig(Section):
    name_or_path: str = Field(description="HF model folder, hub id, or a built-in model: smollm2-135m-instruct, "
                                          "smollm2-tiny, smollm2-bench, smolvlm-135m (see hfsdp.model.loading).")
    dtype: DType = Field("float32", description="dtype the weights are loaded in (master weights).")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="allow model code from the hub (transformers option).")
    attn_implementation: Literal[ATTENTION_KERNELS] = Field(
        "sdpa", description="attention kernel: sdpa (torch's fused kernels), eager (plain matmuls), "
                            "flash_attention_2 (GPUs, package flash-attn), flex_attention (torch's FlexAttention).")
    experts_implementation: Resumable[Literal[EXPERTS_IMPLEMENTATIONS] | None] = Field(
        None, description="mixture-of-experts models: how each layer's experts run: grouped_mm (one grouped matmul "
                          "per projection over the tokens sorted by expert), eager (a loop over the experts), "
                          "batched_mm (each token's experts' weights gathered: for a few tokens at a time, slow to "
                          "train). Default: transformers' choice, grouped_mm where torch has it, else eager.")
    router_aux_loss_coef: float | None = Field(
        None, ge=0, description="mixture-of-experts models: weight of the router's load-balancing loss added to the "
                                "training loss (default: the model config's router_aux_loss_coef; 0 turns it off). "
                                "Metrics router/aux_loss and router/imbalance (max / mean tokens per expert).")
    quantization: QuantizationConfig | None = Field(
        None, description="QLoRA: load the base's Linears in 4 bits (bitsandbytes) and train LoRA on them "
                          "(docs/guide.md: QLoRA): {bits: 4, quant_type: nf4|fp4 (nf4), double_quant (true), "
                          "compute_dtype (default: "
                          "the mixed-precision param dtype, else dtype), quant_storage (default: the same: sharded by "
                          "FSDP2; uint8: whole on every rank)}.")

    freeze: list[Literal["vision", "projector", "language"]] = Field(
        [], description="vision-language models: the parts whose weights stay as loaded (no gradient, no optimizer "
                        "state): any of vision (the vision tower), projector (what maps its features into the "
                        "language model), language (the decoder and its head). E.g. [vision, language]: train the "
                        "projector only; [vision] with LoRA: adapters on the language model only.")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dtype" in data:
            data = {**data, "dtype": _dtype_alias(data["dtype"])}
        return data


ChatRole = Literal["system", "user", "assistant", "tool"]


class MessageKeys(Section):
    role: str = Field("role", description="key of a message's role.")
    content: str = Field("content", description="key of a message's text.")


# The keys a data.datasets source may set for itself; a key it leaves unset takes the data section's value.
SOURCE_KEYS = ("path", "format", "name", "split", "text_field", "messages_field", "message_keys", "roles")


class DataSource(Section):
    path: str = Field(description="like data.path; also a folder or glob (e.g. shards/*.jsonl) of JSONL/Parquet shards.")
    format: str | None = Field(None, description="this source's format (default data.format).")
    name: str | None = Field(None, description="datasets config name (default data.name).")
    split: str | None = Field(None, description="split read for training (default data.split).")
    text_field: str | None = Field(None, description="text format: the column holding the text (default data.text_field).")
    messages_field: str | None = Field(None, description="chat format: the messages column (default data.messages_field).")
    message_keys: MessageKeys | None = Field(None, description="chat format: role and text keys (default data.message_keys).")
    roles: dict[str, ChatRole] | None = Field(None, description="chat format: role names (default data.roles).")
    weight: float | None = Field(None, description="share of the mixture, relative to the other sources' weights "
                                                   "(give every source a weight, or none).")
    epochs: float | None = Field(None, description="without weights: passes over this source per epoch of the "
                                                   "mixture (default 1: every row once).")


class DataConfig(Section):
    format: str = Field("text", description="text, instruction, chat, or a format a plugin registers.")
    path: str | None = Field(None, description="local file (.txt/.jsonl/.json/.csv/.parquet), folder or glob of "
                                                "shards, or datasets-loadable name (or give data.datasets).")
    datasets: list[DataSource] | None = Field(
        None, description="several sources mixed into one training set (instead of data.path); each takes the keys "
                          "above it leaves unset from this section.")
    name: str | None = Field(None, description="datasets config name, for hub-style datasets.")
    split: str = Field("train", description="split of `path` used for training.")
    text_field: str = Field("text", description="text format: the column holding the text.")
    messages_field: str | None = Field(
        None, description="chat format: the column holding the messages list; default: messages, or conversations "
                          "(ShareGPT) when the rows have that column instead.")
    message_keys: MessageKeys | None = Field(
        None, description="chat format: a message's role and text keys, e.g. {role: from, content: value}; default: "
                          "role/content, or from/value (ShareGPT) when the messages have those instead.")
    roles: dict[str, ChatRole] | None = Field(
        None, description="chat format: the rows' role names as system/user/assistant/tool, e.g. {human: user, gpt: "
                          "assistant}, added to the defaults (system, user, assistant, tool, and ShareGPT's human, gpt, "
                          "observation, function_call).")
    chat_template: str | None = Field(
        None, description="chat formats: the chat template, instead of the tokenizer's: a .jinja file, or a template "
                          "hfsdp ships by name (chatml_tools; a model family's, e.g. qwen3_training, llama3_training). "
                          "Saved with the tokenizer.")
    train_earlier_thinking: bool = Field(
        True, description="chat format: train the thinking (reasoning_content) of assistant turns before the last user "
                          "message, where the template renders it; false keeps it as context only.")
    max_seq_len: int = Field(512, gt=1, description="tokens per sample; longer samples follow too_long.")
    too_long: Literal["truncate", "drop"] = Field("truncate", description="policy for longer samples (counted in the log).")
    eval_path: str | None = Field(None, description="separate eval file (set one of eval_path, eval_split, eval_fraction).")
    eval_split: str | None = Field(None, description="split of `path` used for eval.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="fraction of train held out for eval.")
    max_eval_samples: int | None = Field(None, gt=0, description="cap on eval rows.")
    num_proc: int | None = Field(None, gt=0, description="processes for reading and tokenizing (default: the cores "
                                                          "this process may use).")
    image_max_pixels: int | None = Field(
        None, gt=0, description="vision-language models: an image of more pixels (width x height) is scaled down to "
                                "this many, its aspect ratio kept, before the processor reads it, so that it expands "
                                "to fewer image tokens (LLaMA-Factory's image_max_pixels; default: only the image "
                                "processor's own limit).")

    @model_validator(mode="after")
    def _one_eval_source(self) -> "DataConfig":
        sources = [k for k in ("eval_path", "eval_split") if getattr(self, k)] + (
            ["eval_fraction"] if self.eval_fraction > 0 else []
        )
        if len(sources) > 1:
            raise ValueError(f"set only one of eval_path, eval_split, eval_fraction (got {', '.join(sources)})")
        return self

    @model_validator(mode="after")
    def _one_training_source(self) -> "DataConfig":
        if (self.path is None) == (self.datasets is None):
            raise ValueError("give data.path (one source) or data.datasets (a list of sources), not "
                             + ("both" if self.path is not None else "neither"))
        if self.datasets is not None:
            problems = [f"data.datasets[{i}]: give weight or epochs, not both" for i, s in enumerate(self.datasets)
                        if s.weight is not None and s.epochs is not None]
            problems += [f"data.datasets[{i}].{key}: {value:g}; it must be more than 0 (a source that should not "
                         "train is removed from the list)" for i, s in enumerate(self.datasets)
                         for key, value in (("weight", s.weight), ("epochs", s.epochs))
                         if value is not None and not value > 0]
            weighted = [s.weight is not None for s in self.datasets]
            if any(weighted) and not all(weighted):
                problems.append(f"data.datasets: sources {[i for i, w in enumerate(weighted) if not w]} have no "
                                "weight: give every source a weight, or none (then each source's epochs decide)")
            if not self.datasets:
                problems.append("data.datasets: the list is empty; give at least one source")
            if problems:
                raise ValueError("; ".join(problems))
        return self

    def sources(self) -> list["DataConfig"]:
        """The training sources, each as a whole data section (a data.datasets entry over this section's keys;
        without data.datasets, this section itself)."""
        if self.datasets is None:
            return [self]
        return [self.model_copy(update={"datasets": None, **{k: getattr(s, k) for k in SOURCE_KEYS
                                                             if getattr(s, k) is not None}})
                for s in self.datasets]


class MixedPrecisionParts(Section):
    param: DType = "bfloat16"
    reduce: DType = "float32"
    buffer: DType = "float32"

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        return {k: _dtype_alias(v) for k, v in data.items()} if isinstance(data, dict) else data


ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
STRATEGIES: tuple[str, ...] = typing.get_args(ShardingStrategy)
FSDP1_ONLY = ("forward_prefetch", "backward_prefetch", "sync_module_states", "use_orig_params", "limit_all_gathers")


class FSDPConfig(Section):
    version: Literal[1, 2] = Field(2, description="1: FullyShardedDataParallel, 2: fully_shard (per-parameter DTensor).")
    sharding_strategy: ShardingStrategy = Field("FULL_SHARD", description="what is sharded; see the strategy table.")
    wrap_policy: Literal["transformer", "size", "none"] = Field(
        "transformer", description="how FSDP units are formed: transformer (each decoder layer), size (modules of "
                                   "min_num_params or more; tied embeddings stay in the root unit), none (the root "
                                   "only).")
    transformer_layer_cls: list[str] | None = Field(
        None, description="layer classes wrapped as FSDP units; default: the model's _no_split_modules."
    )
    min_num_params: int | None = Field(None, gt=0, description="size policy: a module with at least this many "
                                       "parameters not already in a smaller unit becomes a unit (e.g. 100000000).")
    mixed_precision: Literal["no", "bf16", "fp16"] | MixedPrecisionParts = Field(
        "no", description="bf16/fp16 compute with fp32 reduction, or {param, reduce, buffer} dtypes (buffer: FSDP1 "
              "only; NO_SHARD under FSDP2 runs as DDP and reduces in float32).")
    cpu_offload: bool = Field(False, description="keep parameters (and optimizer state) in host memory; GPU only (NCCL + gloo).")
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = Field(
        "SHARDED_STATE_DICT", description="checkpoint layout: one gathered file, or per-rank shards (DCP).")
    activation_checkpointing: bool = Field(False, description="recompute layer activations in backward.")
    cpu_ram_efficient_loading: bool = Field(False, description="only rank 0 reads weights; others get them.")
    hybrid_shard_size: int | None = Field(
        None, gt=0, description="HYBRID_SHARD: ranks per shard group (default: processes per node)."
    )
    single_process: Resumable[Literal["auto", "fsdp"]] = Field(
        "auto", description="one process: auto runs the model without a wrapper unless an option needs FSDP "
                            "(cpu_offload); fsdp wraps it anyway, as N ranks would.")
    gather_for_generation: bool = Field(
        True, description="sampling (grpo's rounds, generation_eval) gathers the whole model once per generate call "
                          "and reshards it after, as FSDP1 always does (TRL's ds3_gather_for_generation); false: "
                          "FSDP2 gathers each layer at each decode step (less memory, an all-gather per layer per "
                          "token).")
    # FSDP1-only knobs: None means "not set", so setting one under version 2 can be reported.
    forward_prefetch: bool | None = Field(None, description="FSDP1: issue the next all-gather early (default false).")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"] | None = Field(
        None, description="FSDP1: when to prefetch in backward (default BACKWARD_PRE).")
    sync_module_states: bool | None = Field(
        None, description="FSDP1: broadcast rank 0's weights (default: cpu_ram_efficient_loading).")
    use_orig_params: bool | None = Field(None, description="FSDP1: keep original parameters (default true; LoRA needs it).")
    limit_all_gathers: bool | None = Field(None, description="FSDP1: rate-limit all-gathers (default true).")

    @model_validator(mode="after")
    def _consistent(self) -> "FSDPConfig":
        problems = []
        if self.version == 2:
            given = [k for k in FSDP1_ONLY if getattr(self, k) is not None]
            if given:
                problems.append(f"{', '.join(given)} only exist in FSDP1: remove them or set fsdp.version: 1")
        if self.wrap_policy == "size" and self.min_num_params is None:
            problems.append("wrap_policy 'size' needs fsdp.min_num_params (e.g. 100000000)")
        if self.wrap_policy != "size" and self.min_num_params is not None:
            problems.append("min_num_params only applies to wrap_policy 'size'")
        if self.wrap_policy != "transformer" and self.transformer_layer_cls:
            problems.append("transformer_layer_cls only applies to wrap_policy 'transformer'")
        if self.hybrid_shard_size is not None and self.sharding_strategy != "HYBRID_SHARD":
            problems.append("hybrid_shard_size only applies to sharding_strategy HYBRID_SHARD")
        if self.version == 1 and self.cpu_ram_efficient_loading and self.sync_module_states is False:
            problems.append("cpu_ram_efficient_loading needs sync_module_states (ranks > 0 start empty)")
        if self.runs_as_ddp:
            ddp = "NO_SHARD with FSDP2 runs as DDP, which"
            if self.cpu_offload:
                problems.append(f"{ddp} has no cpu_offload: use FULL_SHARD or version 1")
            if self.cpu_ram_efficient_loading:
                problems.append(f"{ddp} loads the weights on every rank (no cpu_ram_efficient_loading): "
                                "use FULL_SHARD or version 1")
            if isinstance(self.mixed_precision, MixedPrecisionParts) and self.mixed_precision.reduce != "float32":
                problems.append(f"{ddp} reduces gradients in float32 (the master weights' dtype), so "
                                "mixed_precision.reduce must be float32: use FULL_SHARD or version 1")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def runs_as_ddp(self) -> bool:
        """FSDP2 has no NO_SHARD; the seeds define NO_SHARD as DDP, so that is what runs (no FSDP plugin)."""
        return self.version == 2 and self.sharding_strategy == "NO_SHARD"

    @property
    def precision_name(self) -> str:
        if isinstance(self.mixed_precision, str):
            return self.mixed_precision
        return "bf16" if self.mixed_precision.param == "bfloat16" else "fp16" if self.mixed_precision.param == "float16" else "no"


# Experiment trackers that Accelerate drives (its `log_with` names): the module each needs, and the pip package that
# provides it. A tracker named but not installed is a config error (Accelerate itself would silently skip it).
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
}
Tracker = Literal[tuple(TRACKERS)]


class CompileConfig(Section):
    """``train.compile`` as a mapping: how each transformer block is compiled (``torch.compile`` arguments)."""

    backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile backend: inductor (generated kernels), aot_eager (traced, no code "
                                "generation: for checking), eager (dynamo only).")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="inductor mode (reduce-overhead and max-autotune use CUDA graphs: GPUs only).")

    @model_validator(mode="after")
    def _mode_needs_inductor(self) -> "CompileConfig":
        if self.mode is not None and self.backend != "inductor":
            raise ValueError(f"compile.mode only applies to backend inductor (backend is {self.backend})")
        return self

    @property
    def cuda_graphs(self) -> bool:
        return self.mode in ("reduce-overhead", "max-autotune")


# The values of train.optimizer; hfsdp.rules.optimizers.CHOICES holds each one's implementation, in this order.
OPTIMIZER_NAMES = ("adamw", "adamw_8bit", "adafactor", "muon", "schedule_free_adamw", "sgd")


class TrainConfig(Section):
    output_dir: Resumable[str] = Field(description="run folder: config.yaml, metrics.jsonl, checkpoints/, final/.")
    max_steps: Resumable[int | None] = Field(None, gt=0, description="optimizer steps; wins over epochs.")
    epochs: Resumable[float | None] = Field(None, gt=0, description="passes over the train set (when max_steps is unset).")
    per_device_batch_size: Resumable[int] = Field(1, gt=0, description="samples per micro-batch per rank.")
    gradient_accumulation_steps: Resumable[int] = Field(1, gt=0, description="micro-batches per optimizer step.")
    group_by_length: bool = Field(
        False, description="put rows of similar length into the same micro-batches (less padding); the order "
                           "stays a function of seed and step.")
    optimizer: Literal[OPTIMIZER_NAMES] = Field(
        "adamw", description="adamw (torch), adamw_8bit (bitsandbytes' AdamW8bit: 8-bit moments), adafactor (torch: "
                             "factored second moment), muon (torch's Muon on the hidden 2-D matrices, AdamW on "
                             "embeddings, head, norms and biases), schedule_free_adamw (schedulefree's "
                             "AdamWScheduleFree: no LR schedule; evaluation, checkpoints and export use its averaged "
                             "weights), sgd (torch). docs/guide.md: where each runs.")
    optimizer_args: dict[str, Any] = Field(
        {}, description="other keyword arguments of the optimizer (e.g. {momentum: 0.9} for sgd), checked against its "
                        "signature; lr, weight_decay, betas and eps come from the keys here.")
    learning_rate: float = Field(2e-5, gt=0, description="peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="decoupled decay on matrices (not norms/biases).")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="beta1 of the Adam family (adamw, adamw_8bit, muon's "
                                                           "AdamW, schedule_free_adamw).")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="beta2 of the Adam family.")
    adam_epsilon: float = Field(1e-8, gt=0, description="epsilon of the Adam family.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="decay after warmup (to 0 at the last step).")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="null disables clipping.")
    seed: int = Field(42, description="seeds data order, init and dropout.")
    log_every: Resumable[int] = Field(10, gt=0, description="steps between metrics.jsonl records.")
    eval_every: Resumable[int | None] = Field(None, gt=0, description="steps between evals; eval also runs at start and end.")
    eval_at_start: Resumable[bool] = Field(True, description="evaluate before the first step (the before/after report).")
    max_eval_batches: Resumable[int | None] = Field(None, gt=0, description="cap on eval batches per rank.")
    save_every: Resumable[int | None] = Field(None, gt=0, description="steps between checkpoints (null: only on preemption).")
    keep_last: Resumable[int | None] = Field(3, gt=0, description="complete checkpoints kept (null keeps all).")
    async_save: Resumable[bool] = Field(
        False, description="write SHARDED checkpoints in the background while training continues (staged to a "
                           "host-memory copy first; FSDP-wrapped models); a checkpoint counts only once complete.")
    export_final: Resumable[bool] = Field(True, description="write the consolidated model to <output_dir>/final.")
    loss_plot: Resumable[bool] = Field(
        True, description="draw <output_dir>/loss.png from metrics.jsonl at the end of the run (main process; "
                          "needs matplotlib; `hfsdp plot` draws it later from the same file).")
    report_to: Resumable[list[Tracker]] = Field(
        ["tensorboard"], description="experiment trackers (through Accelerate) besides metrics.jsonl, or none; "
        "replaces train.tensorboard (false: none).")
    peak_tflops: float | None = Field(
        None, gt=0, description="peak dense TFLOP/s of one device for MFU; default: the table of known GPUs in docs/guide.md.")
    compile: Resumable[CompileConfig | None] = Field(
        None, description="torch.compile each transformer block in place (before FSDP2 shards it; FSDP1: refused): "
                          "true (Inductor), false, or {backend: inductor|aot_eager|eager, mode: default|"
                          "max-autotune-no-cudagraphs|reduce-overhead|max-autotune}. Off by default (docs/benchmarks.md: "
                          "what it gains on CPU).")
    chunked_loss: Resumable[bool] = Field(
        True, description="compute the output projection and cross entropy inside the model's forward, chunk by "
                          "chunk, each chunk's gradients made there (no recomputation), so the full logits never "
                          "exist; used where it is exact (checked at start-up, else the plain loss); false: the plain "
                          "loss.")
    tiled_mlp: Resumable[int | None] = Field(
        None, gt=0, description="compute each decoder layer's dense MLP over a micro-batch's positions this many at "
                                "a time, each tile recomputed in the backward (axolotl's TiledMLP): a long row's MLP "
                                "intermediates are never held whole; the same values, the MLP's forward once more. "
                                "null: off.")
    deterministic: bool = Field(False, description="torch deterministic algorithms (bit-exact resume; on CUDA also "
                                                   "CUBLAS_WORKSPACE_CONFIG).")
    on_nonfinite: Resumable[Literal["stop", "skip"]] = Field(
        "stop", description="non-finite loss or grad norm: stop (exit 3) or skip the step.")
    max_consecutive_skips: Resumable[int] = Field(3, gt=0, description="skip policy: stop after this many in a row.")
    collective_timeout_s: Resumable[int] = Field(
        600, gt=0, description="seconds a rank waits in a collective for the others before the job fails "
                               "(a hung or frozen rank); also bounds rank 0's first-time tokenization.")
    save_timeout_s: Resumable[float | None] = Field(
        3600, gt=0, description="seconds a checkpoint may take from the start of its save until it is complete; "
                                "a save that takes longer (storage too slow or hung) stops every rank with the step, "
                                "the path and the time instead of hanging (null: no limit).")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_switch(cls, value: Any) -> Any:
        """``compile: true`` is the default mapping, ``false`` is off."""
        return ({} if value else None) if isinstance(value, bool) else value

    @model_validator(mode="before")
    @classmethod
    def _report_to(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "tensorboard" in data:  # the key report_to replaced: old configs keep validating
            legacy = data.pop("tensorboard")
            if "report_to" in data:
                raise ValueError("tensorboard is replaced by report_to: remove tensorboard")
            if not isinstance(legacy, bool):
                raise ValueError("tensorboard (deprecated) must be true or false; better: report_to")
            data["report_to"] = ["tensorboard"] if legacy else []
        value = data.get("report_to", ["tensorboard"])
        if value is None or value == "none":
            value = []
        elif isinstance(value, str):
            value = [value]
        if isinstance(value, list) and "none" in value:
            if len(value) > 1:
                raise ValueError("report_to: 'none' cannot be combined with trackers")
            value = []
        data["report_to"] = value
        return data

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        missing = [name for name in value if importlib.util.find_spec(TRACKERS[name][0]) is None]
        if missing:
            raise ValueError("; ".join(f"tracker '{name}' is not installed: pip install {TRACKERS[name][1]}"
                                       for name in missing) + " (or remove it from train.report_to)")
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _length(self) -> "TrainConfig":
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs")
        return self


class GenerationEvalConfig(Section):
    """Greedy generation on held-out prompts before and after training: exact-match accuracy and examples."""

    num_samples: int = Field(32, ge=0, description="eval rows generated (greedy) before and after training.")
    max_new_tokens: int = Field(64, gt=0, description="generation length cap.")
    show: int = Field(2, ge=0, description="examples printed before/after.")




class ParallelConfig(Section):
    """The parallel degrees, one key each; their product is the world size (``hfsdp.layout.degrees``). Ranks are laid
    out as dp_replicate x dp_shard x cp x sp x tp, the tensor-parallel ranks innermost (dp_shard split as efsdp x ep
    when ep_size > 1, the expert-parallel ranks consecutive). ``fsdp.sharding_strategy``
    HYBRID_SHARD (with ``fsdp.hybrid_shard_size``) and NO_SHARD are accepted spellings of the two data-parallel
    degrees."""

    dp_replicate_size: int = Field(1, gt=0, description="copies of the model's state: FSDP shards within groups of "
                                                         "world / dp_replicate_size ranks and replicates across them "
                                                         "(HSDP: FULL_SHARD or SHARD_GRAD_OP with this is HYBRID_SHARD "
                                                         "by degrees). 1: FSDP shards over every data-parallel rank.")
    dp_shard_size: int = Field(-1, description="ranks FSDP shards each parameter over within a replica; -1: the "
                                               "rest (world / (dp_replicate_size x cp_size x sp_size x tp_size)); "
                                               "given, it is "
                                               "checked at launch.")
    tp_size: int = Field(1, gt=0, description="ranks that split each layer's matrices (tensor parallel, the "
                                              "architecture's tp_plan: attention heads and MLP columns/rows); "
                                              "consecutive ranks, inside a node. 1: FSDP alone.")
    sp_size: int = Field(1, gt=0, description="ranks that split each sequence (sequence parallel, DeepSpeed-Ulysses: "
                                              "each holds 1/sp_size of every row's tokens, and an all-to-all around "
                                              "attention trades that split for a split of the heads); consecutive "
                                              "ranks, inside a node. 1: off.")
    cp_size: int = Field(1, gt=0, description="ranks that split each sequence in a ring (context parallel, ring "
                                              "attention: each holds 1/cp_size of every row's tokens, in order, and "
                                              "the keys and values pass around the ring in every layer; the heads "
                                              "need not divide by it). With sp_size, Ulysses splits the heads inside "
                                              "each sequence-parallel group and the ring runs across the groups; "
                                              "consecutive groups of sp_size x tp_size ranks, inside a node. 1: off.")
    ep_size: int = Field(1, gt=0, description="ranks that split each mixture-of-experts layer's experts (expert "
                                              "parallel): each holds 1/ep_size of them, and an all-to-all sends "
                                              "each token to its experts' ranks and back. Carved from the "
                                              "data-parallel shard ranks (they still train on their own rows); "
                                              "FSDP2 shards the experts over the dp_shard_size / ep_size ranks "
                                              "that hold the same ones. 1: off.")

    @field_validator("dp_shard_size", mode="before")
    @classmethod
    def _the_rest(cls, value: Any) -> Any:
        """``null`` (configs written before -1 meant the rest) is the rest."""
        return -1 if value is None else value

    @field_validator("dp_shard_size")
    @classmethod
    def _positive_or_rest(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"{value}: give the ranks FSDP shards over (1 or more), or -1 for the rest")
        return value


class HfsdpConfig(Section):
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    fsdp: FSDPConfig = FSDPConfig()
    parallel: Resumable[ParallelConfig] = ParallelConfig()
    generation_eval: Resumable[GenerationEvalConfig | None] = Field(
        None, description="off unless the section is given; chat and instruction formats.")
    plugins: list[str] = Field(default_factory=list, description="plugins to enable, by name or dotted path.")
    plugin_config: dict[str, Any] = Field(
        default_factory=dict, description="validated plugin sections (filled by load_config, not set in YAML)."
    )

    def section(self, name: str) -> Any:
        return self.plugin_config.get(name)

    def to_yaml_dict(self) -> dict[str, Any]:
        """The resolved config as the user would write it (plugin sections back at top level)."""
        out = self.model_dump(mode="json", exclude={"plugin_config"})
        for name, section in self.plugin_config.items():
            out[name] = section.model_dump(mode="json") if isinstance(section, BaseModel) else section
        return out


CORE_SECTIONS = set(HfsdpConfig.model_fields) - {"plugin_config"}


