"""llama.cpp itself on hfsdp's GGUF files of the architectures transformers' GGUF loader cannot check: the logits
llama.cpp computes from each file against transformers' logits of the Hugging Face folder it was written from.

    python benchmarks/llama_cpp_architectures.py [--quant f16] [--out DIR]

Tiny random models (tests/test_gguf.py's builder: the tiny model's shape and tokenizer, biases not zero) of Qwen2,
Mistral, a Llama with attention biases, a Llama with Llama 3.1's scaled rotary embedding (its rope_freqs factors;
a file written without them beside it, to show they are read) and a Qwen3-MoE (8 experts of width 64, top 2: its
expert width is one transformers' GGUF loader does not read); one 79-token text. Prints, per file, the largest
logit difference over the largest logit and the share of positions with the same argmax; writes DIR/*.gguf.

llama-cpp-python is not a dependency of hfsdp (see benchmarks/llama_cpp_generation.py for its build).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {"qwen2": ("Qwen2", {"tie_word_embeddings": True}),
         "mistral": ("Mistral", {"tie_word_embeddings": False}),
         "llama-attention-bias": ("Llama", {"tie_word_embeddings": False, "attention_bias": True}),
         "llama3-rope": ("Llama", {"tie_word_embeddings": True, "rope_parameters": ROPE}),
         # llama.cpp's qwen3moe: each layer's experts stacked per projection, the router, the experts' width
         "qwen3moe": ("Qwen3Moe", {"tie_word_embeddings": True, "norm_topk_prob": True, "num_experts": 8,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 64})}
TEXT = "Return this contact as JSON. Kofi Novak, 52, lives in Toulouse and works as a dentist. " * 3


def compare(folder: Path, gguf_file: Path) -> tuple[int, float, float]:
    import numpy as np
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(TEXT).input_ids
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(torch.tensor([ids])).logits[0].numpy()
    llm = Llama(str(gguf_file), n_ctx=512, logits_all=True, verbose=False)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)])
    llm.close()
    return len(ids), float(np.abs(got - want).max() / np.abs(want).max()), float((got.argmax(-1) == want.argmax(-1)).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", default="f16")
    p.add_argument("--out", type=Path, default=Path("llama-cpp-architectures"))
    a = p.parse_args()
    import hfsdp.export.gguf_file as gguf_file
    from conftest import CACHE_DIR
    from hfsdp.model.loading import resolve_model_path
    from test_gguf import _tiny_of

    tiny = Path(resolve_model_path("smollm2-tiny", CACHE_DIR))
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    rows = []
    for name, (kind, changes) in CASES.items():
        folder = _tiny_of(kind, tiny, a.out / name, **changes)
        path = gguf_file.write_gguf(folder, a.out / f"{name}-{a.quant}.gguf", a.quant, name=f"tiny-{name}")
        rows.append((name, *compare(folder, path)))
    written = gguf_file.rope_factors
    gguf_file.rope_factors = lambda config, head_dim: None  # the same file without Llama 3.1's factors
    try:
        path = gguf_file.write_gguf(a.out / "llama3-rope", a.out / f"llama3-rope-no-factors-{a.quant}.gguf", a.quant,
                                    name="tiny-llama3-rope-no-factors")
    finally:
        gguf_file.rope_factors = written
    rows.append(("llama3-rope, written without rope_freqs", *compare(a.out / "llama3-rope", path)))
    print(f"| model ({a.quant}) | tokens | max logit difference / max logit | same argmax |\n|---|---|---|---|")
    for name, tokens, error, same in rows:
        print(f"| {name} | {tokens} | {error:.2e} | {same:.3f} |")


if __name__ == "__main__":
    main()
