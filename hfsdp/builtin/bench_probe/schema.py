"""The ``bench_probe:`` section."""

from __future__ import annotations

from pydantic import Field

from hfsdp.config.schema import Section


class BenchProbeSection(Section):
    activations: bool = Field(False, description="count the bytes autograd keeps for backward at the end of each "
                                                 "forward, and their peak (saved_activations_peak); a hook on every "
                                                 "saved tensor, which slows the steps a little.")
    profile: bool = Field(False, description="split every step with torch.profiler (hfsdp bench --profile; CPU "
                                             "runs): forward, backward, FSDP hooks, clipping, optimizer, the rest, "
                                             "and collectives in flight.")
