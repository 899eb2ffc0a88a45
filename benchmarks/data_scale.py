"""Preprocessing a large chat corpus: hfsdp's (``data.datasets``, 2 sources 3:1) next to plain ``datasets``.

    python benchmarks/data_scale.py [--rows 200000 1000000] [--shards 20] [--num-proc 2]

For each corpus size, generates that many synthetic chat rows in ``--shards`` JSONL files (the first 3/4 of the
shards are source 0, the rest source 1, mixed 3:1), then preprocesses them twice, each in a fresh process with
empty caches (the JSON -> Arrow conversion counts in both):

* hfsdp: ``hfsdp.data.prepare.prepare_datasets`` of a config with ``data.datasets`` (the two globs, weights 3 and 1) and
  ``data.num_proc``: reading the shards, tokenizing each source with the chat format and the length policy, and
  storing the preprocessing cache entry (temp folder, fsync, rename);
* baseline: ``datasets.load_dataset("json", data_files=<the 20 shards>).map(tokenize_chat, batched=True,
  num_proc=...)``: the same tokenisation (hfsdp's chat format function) as a user would write it.

Prints wall time and peak host memory (the RSS of the process and its workers, summed, sampled every 50 ms) side
by side, their ratios, and the ratio of hfsdp's peak RSS between the largest and smallest corpus.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the a contact engineer city lives works called years old from meet extract person return json name age "
         "job librarian teacher doctor nurse pilot Lisbon Oslo Lima Tokyo Cairo Quito Paris Seoul Accra Dublin").split()


def generate(folder: Path, rows: int, shards: int) -> None:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = rows // shards
    for k in range(shards):
        with open(folder / f"part-{k:02d}.jsonl", "w") as f:
            for _ in range(per_shard):
                question = " ".join(rng.choices(WORDS, k=rng.randint(8, 30)))
                answer = " ".join(rng.choices(WORDS, k=rng.randint(4, 20)))
                f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}]}) + "\n")


def child(kind: str, corpus: Path, shards: int, num_proc: int, work: Path, tokenizer_dir: str) -> None:
    import os

    os.environ["HF_DATASETS_CACHE"] = str(work / "hf-datasets")
    import datasets
    from transformers import AutoTokenizer

    from hfsdp.builtin.chat import tokenize_chat

    files = sorted(str(p) for p in corpus.glob("*.jsonl"))
    t0 = time.perf_counter()
    if kind == "baseline":
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        cfg_data = type("Data", (), {"messages_field": None, "message_keys": None, "roles": None})()
        raw = datasets.load_dataset("json", data_files=files, split="train", num_proc=num_proc)
        out = raw.map(lambda batch: tokenize_chat(batch, tokenizer, cfg_data), batched=True, num_proc=num_proc,
                      remove_columns=raw.column_names)
        rows = len(out)
    else:
        from hfsdp.data import prepare as data
        from hfsdp.config.files import load_config

        split = shards * 3 // 4
        for name, part in (("a", files[:split]), ("b", files[split:])):
            (work / name).mkdir()
            for f in part:
                os.symlink(f, work / name / Path(f).name)
        (work / "config.yaml").write_text(json.dumps({
            "model": {"name_or_path": tokenizer_dir},
            "data": {"format": "chat", "max_seq_len": 512, "num_proc": num_proc,
                     "datasets": [{"path": str(work / "a" / "*.jsonl"), "weight": 3},
                                  {"path": str(work / "b" / "*.jsonl"), "weight": 1}]},
            "train": {"output_dir": str(work / "run"), "max_steps": 1}}))
        cfg, host = load_config(str(work / "config.yaml"))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        t0 = time.perf_counter()
        train, *_ = data.prepare_datasets(cfg, host, tokenizer, work / "cache")
        rows = len(train)
    print(json.dumps({"seconds": time.perf_counter() - t0, "rows": rows}))


def measure(kind: str, corpus: Path, shards: int, num_proc: int, tokenizer_dir: str) -> dict:
    import psutil

    with tempfile.TemporaryDirectory(dir=corpus.parent) as work:
        proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(corpus), str(shards), str(num_proc),
                                 work, tokenizer_dir], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        root, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)
        out = proc.stdout.read()
        if proc.returncode != 0:
            raise SystemExit(f"{kind} failed ({proc.returncode}): {out}")
        return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_gib": peak / 2**30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000])
    p.add_argument("--shards", type=int, default=20)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, corpus, shards, num_proc, work, tokenizer_dir = a.child
        return child(kind, Path(corpus), int(shards), int(num_proc), Path(work), tokenizer_dir)

    from hfsdp.model import loading
    from hfsdp.cli import cache_dir

    tokenizer_dir = loading.resolve_model_path("smollm2-tiny", cache_dir())
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rows in a.rows:
            corpus = Path(tmp) / f"corpus-{rows}"
            generate(corpus, rows, a.shards)
            base = measure("baseline", corpus, a.shards, a.num_proc, tokenizer_dir)
            ours = measure("hfsdp", corpus, a.shards, a.num_proc, tokenizer_dir)
            peaks[rows] = ours["peak_rss_gib"]
            print(f"{rows:>9} rows, {a.shards} shards, num_proc {a.num_proc}: "
                  f"hfsdp {ours['seconds']:.1f} s, peak RSS {ours['peak_rss_gib']:.2f} GiB ({ours['rows']} rows) | "
                  f"datasets.load_dataset().map() {base['seconds']:.1f} s, peak RSS {base['peak_rss_gib']:.2f} GiB "
                  f"({base['rows']} rows) | time x{ours['seconds'] / base['seconds']:.2f}, "
                  f"RSS x{ours['peak_rss_gib'] / base['peak_rss_gib']:.2f}", flush=True)
            corpus_files = sorted(corpus.glob("*"))
            for f in corpus_files:
                f.unlink()
    if len(peaks) > 1:
        small, large = min(peaks), max(peaks)
        print(f"hfsdp peak RSS, {large} rows / {small} rows: x{peaks[large] / peaks[small]:.2f}")


if __name__ == "__main__":
    main()
