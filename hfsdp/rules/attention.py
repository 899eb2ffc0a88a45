"""Which attention kernel can train here (``model.attn_implementation``), checked before any weight loads."""

from __future__ import annotations

import importlib.util


def attention_problems(config, on_cpu: bool) -> list[tuple[str, str]]:
    """What keeps ``model.attn_implementation`` from training here, checked before any weight loads: flash-attention
    needs a GPU, its package and a 16-bit compute dtype; FlexAttention needs torch >= 2.5 and has no backward on CPU.
    sdpa and eager run everywhere."""

    kernel, where = config.model.attn_implementation, "model.attn_implementation"
    problems = []
    if kernel == "flash_attention_2":
        if on_cpu:
            problems.append((where, "flash_attention_2 needs a CUDA GPU: use sdpa (torch's fused kernels) on CPU"))
        elif importlib.util.find_spec("flash_attn") is None:
            problems.append((where, "flash_attention_2 needs the flash-attn package: pip install flash-attn "
                                    "--no-build-isolation, or use sdpa"))
        sixteen_bit = config.model.dtype in ("bfloat16", "float16") or config.fsdp.precision_name in ("bf16", "fp16")
        if not sixteen_bit:
            problems.append((where, "flash_attention_2 computes in bf16/fp16 only, and this run computes in float32: "
                                    "set fsdp.mixed_precision: bf16 (or model.dtype: bfloat16), or use sdpa"))
    elif kernel == "flex_attention":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            problems.append((where, "flex_attention needs torch >= 2.5 (torch.nn.attention.flex_attention): "
                                    "upgrade torch or use sdpa"))
        elif on_cpu:
            problems.append((where, "flex_attention has no backward pass on CPU (torch's FlexAttention trains on "
                                    "GPUs only): use sdpa or eager on CPU"))
    return problems

