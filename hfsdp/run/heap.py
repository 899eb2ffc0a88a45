"""CPU training keeps the memory a step frees for the next step instead of handing it back to the kernel.

glibc's malloc serves a block above its mmap threshold (at most 32 MiB, raised as such blocks are freed) with a
fresh ``mmap`` and unmaps it when freed, and trims the top of its heap when more than twice that is free. A CPU
training step allocates and frees the same large tensors every step (activations, the tied embedding's dense
gradient: 113 MB for SmolLM2-135M, the logits), so every step the kernel hands those pages over again, zeroed, one
page fault per 4 KiB: 100-200 thousand faults a step for SmolLM2-135M at 4 x 90 tokens, 2-3 us each on this
project's machines (docs/benchmarks.md, issue 56 part 4). :func:`keep_freed_memory` raises both thresholds for the
training loop (blocks up to 1 GiB come from the heap, which is trimmed only past 2 GiB of free top), so from the
second or third step on a step faults in almost nothing. What a one-off phase frees (an eval, a checkpoint save)
would stay in the process with those thresholds (the memory soak of issue 38 measured +545 MiB on a rank from an
eval and a save on): :func:`give_back_free_memory` returns the free memory after each of them and after the loop;
the next step faults in what it needs once. Numbers are
unchanged: the same ops on the same values, only where their memory comes from changes. Anywhere but Linux with
glibc it does nothing, and where the environment sets glibc's malloc itself (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ... or ``GLIBC_TUNABLES`` with ``glibc.malloc.``) that wins: ``hfsdp bench`` sets it so
that freed memory goes back and RSS follows what a rank holds (``hfsdp.tools.bench.MALLOC_RETURNS_FREED``).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_MMAP_THRESHOLD = 1 << 30
KEPT_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # glibc only (musl has no mallopt thresholds)
        return libc
    except (OSError, AttributeError):
        return None


def malloc_set_by_environment(env: Mapping[str, str]) -> bool:
    """Whether ``env`` (the CLI's environment) sets glibc's malloc itself, whose settings then win."""
    return any(k.startswith("MALLOC_") for k in env) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def keep_freed_memory(device) -> bool:
    """From now on freed blocks stay in the process for the next step (CPU devices with glibc; the caller leaves
    out an environment that sets malloc); whether it applied."""
    libc = _glibc() if getattr(device, "type", device) == "cpu" else None
    return bool(libc) and bool(libc.mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD))


def give_back_free_memory() -> None:
    """The heap's free memory back to the kernel (``malloc_trim``; glibc only)."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
