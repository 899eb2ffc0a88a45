"""llama.cpp itself on hfsdp's GGUF: the exported file's greedy answers to the held-out prompts against hfsdp's own
generation eval of the same model; writes DIR/llama_cpp_generation.md and .json.

    python benchmarks/llama_cpp_generation.py --run runs/default [--quant q8_0] [--out DIR] [--limit 32]

RUN is a finished hfsdp run (its config.yaml and final/): `make demo` makes one (SmolLM2-135M-Instruct on the bundled
contacts task). Its final/ folder is written as GGUF (hfsdp.export.gguf_file, as `hfsdp export --format gguf` writes
it); then, on the first LIMIT conversations of the run's eval file, split as its generation eval splits them (the
chat format's prompt: the conversation before its last assistant turn, the chat template's generation prompt):

* hfsdp: `hfsdp.run.generation.generate_eval` on the final/ model (transformers, greedy, the run's
  generation_eval.max_new_tokens);
* llama.cpp: llama-cpp-python's `Llama` on the GGUF file, the same prompt tokens, greedy (temperature 0, top-k 1),
  as many new tokens.

It prints how many answers are the same text (whitespace-normalised), and each side's exact match against the
references. The issue's target (55): the same answer on at least 90 % of the prompts with q8_0.

llama-cpp-python is not a dependency of hfsdp: `pip install llama-cpp-python==0.3.36` builds llama.cpp from its
source with the machine's compiler and cmake (measured on this 2-core machine: see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a finished hfsdp run folder (config.yaml, final/)")
    p.add_argument("--quant", default="q8_0")
    p.add_argument("--out", type=Path, default=Path("llama-cpp-generation"))
    p.add_argument("--limit", type=int, default=32)
    a = p.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36 (builds llama.cpp from "
                 "source)")
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.chat import generation_prompt
    from hfsdp.config.files import load_config
    from hfsdp.export.gguf_file import write_gguf
    from hfsdp.run.generation import _normalise, generate_eval, prompts_and_references

    config, _ = load_config(str(a.run / "config.yaml"), [], check_data=False)
    final = a.run / "final"
    a.out.mkdir(parents=True, exist_ok=True)
    gguf = write_gguf(final, a.out / f"model-{a.quant}.gguf", a.quant, name=final.name)
    tokenizer = AutoTokenizer.from_pretrained(final)
    raw = datasets.load_dataset("json", data_files=str(config.data.eval_path), split="train")
    items = prompts_and_references(raw, config.data, tokenizer, a.limit, generation_prompt)
    new_tokens = config.generation_eval.max_new_tokens if config.generation_eval else 40
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ours = generate_eval(model, model, tokenizer, items, new_tokens)
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=2, verbose=False)
    theirs = []
    for item in items:
        prompt = tokenizer(item.text, add_special_tokens=False)["input_ids"]
        done = llm.create_completion(prompt=prompt, max_tokens=new_tokens, temperature=0.0, top_k=1)
        theirs.append(done["choices"][0]["text"])
    rows = [{"prompt": item.shown, "reference": item.reference, "hfsdp": mine, "llama_cpp": other,
             "same": _normalise(mine) == _normalise(other), "hfsdp_hit": item.hit(mine),
             "llama_cpp_hit": item.hit(other)}
            for item, (_, _, mine), other in zip(items, ours.examples, theirs)]
    same, ours_hit, theirs_hit = (sum(r[k] for r in rows) / len(rows) for k in ("same", "hfsdp_hit", "llama_cpp_hit"))
    text = (f"{a.run} final/ as GGUF {a.quant}, {len(rows)} held-out prompts, {new_tokens} new tokens, greedy: the same "
            f"answer from llama.cpp as from hfsdp's generation eval on {same:.1%}; exact match hfsdp {ours_hit:.1%}, "
            f"llama.cpp {theirs_hit:.1%}")
    (a.out / "llama_cpp_generation.json").write_text(json.dumps({"same": same, "rows": rows}, indent=2))
    (a.out / "llama_cpp_generation.md").write_text(text + "\n")
    print(text)
    for r in rows:
        if not r["same"]:
            print(f"  differs: {r['prompt']!r}\n    hfsdp:     {r['hfsdp']!r}\n    llama.cpp: {r['llama_cpp']!r}")


if __name__ == "__main__":
    main()
