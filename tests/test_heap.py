"""hfsdp.run.heap: on CPU with glibc a training loop's freed memory stays in the process, so a step that allocates
what the last one freed takes no page faults (docs/benchmarks.md, issue 56 part 4)."""

import subprocess
import sys
import textwrap

import pytest

from conftest import base_env

PROBE = textwrap.dedent("""
    import resource, sys, torch
    from hfsdp.run import heap

    def step():  # a tied embedding's dense gradient (113 MB) and a few activations, freed at the step's end
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.ones(49152, 576)] + [torch.ones(356, 1536) for _ in range(50)]
        del tensors
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    applied = heap.keep_freed_memory(torch.device(sys.argv[1])) if sys.argv[1] != "none" else False
    faults = [step() for _ in range(4)]
    heap.give_back_free_memory()
    print(applied, faults[0], faults[-1])
""")


def _run(device: str, **env: str) -> tuple[bool, int, int]:
    proc = subprocess.run([sys.executable, "-c", PROBE, device], capture_output=True, text=True,
                          env=base_env(**env), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied, first, last = proc.stdout.split()
    return applied == "True", int(first), int(last)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_steps_reuse_freed_memory_without_page_faults():
    applied, first, last = _run("cpu")
    assert applied
    assert first > 10_000 and last < first / 20, (first, last)  # 113 MB is ~28,000 pages of 4 KiB


def test_other_devices_are_left_alone_and_an_environment_that_sets_malloc_wins():
    from hfsdp.run.heap import malloc_set_by_environment
    from hfsdp.tools.bench import MALLOC_RETURNS_FREED

    assert not _run("meta")[0]
    # hfsdp bench's CPU runs return freed memory, so that RSS follows live tensors: the CLI then keeps the heap as
    # the environment sets it (hfsdp.run.state.Options.malloc_set)
    assert malloc_set_by_environment(MALLOC_RETURNS_FREED)
    assert malloc_set_by_environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not malloc_set_by_environment({"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.rtld.nns=4"})


TRIM_PROBE = textwrap.dedent("""
    import torch
    from hfsdp.run import heap

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    assert heap.keep_freed_memory(torch.device("cpu"))
    before = rss_mib()
    phase = [torch.ones(2**20, 16) for _ in range(6)]  # an eval's or a save's 384 MiB, freed when it ends
    del phase
    kept = rss_mib()
    heap.give_back_free_memory()
    print(round(kept - before), round(rss_mib() - before))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_what_a_one_off_phase_frees_goes_back_after_it():
    """The memory soak's failure (issue 38's target): with the thresholds raised, an eval's or a save's freed
    memory stayed in the process; the loop gives it back after each of them."""
    proc = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, env=base_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept, after = map(int, proc.stdout.split())
    assert kept > 300 and after < 50, (kept, after)
