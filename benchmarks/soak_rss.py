"""hfsdp plugin for benchmarks/memory_soak.py: every rank appends its resident memory after every optimizer step to
``<output_dir>/rss_rank<r>.jsonl`` (``{"step": N, "rss": bytes}``). Enable it with ``plugins: [soak_rss]`` and this
folder on PYTHONPATH."""

import json

import psutil

from hfsdp import hookimpl

__version__ = "0.0.1"

_files = {}


@hookimpl
def hfsdp_on_step_end(run, step):
    rank = run.accelerator.process_index
    if rank not in _files:
        _files[rank] = open(run.output_dir / f"rss_rank{rank}.jsonl", "w")  # this run's steps only
    _files[rank].write(json.dumps({"step": step, "rss": psutil.Process().memory_info().rss}) + "\n")
    _files[rank].flush()
