"""Ranks as threads of the test process, on torch's threaded process group (how torch's own DTensor and FSDP tests
run ranks on a CPU): for claims about arithmetic on sharded tensors and collectives, where starting processes would
be most of the test's time. Launching is proven where it is the claim (real gloo processes: conftest.run_torchrun).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_threads(world_size: int, fn: Callable[[int], T], timeout: float = 300) -> list[T]:
    """``fn(rank)`` on ``world_size`` threads, each a rank of one process group (backend ``threaded``; a
    ``DeviceMesh`` on ``"cpu"`` works over it); the ranks' results in rank order. The first rank's exception is
    raised here (the others are woken from their collectives). Random numbers: use a ``torch.Generator`` of your
    own, the global one is shared by the threads."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: list = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    store = dist.HashStore()

    def rank_thread(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 (raised in the caller's thread)
            errors.append((rank, err))
            ProcessLocalGroup.exception_handle(err)  # wakes the ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_thread, args=(rank,), daemon=True) for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"a rank thread did not finish in {timeout:.0f} s")
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        rank, err = min(errors, key=lambda e: e[0])
        raise AssertionError(f"rank {rank} failed: {type(err).__name__}: {err}") from err
    return results
