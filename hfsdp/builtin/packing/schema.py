"""The ``packing:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp.config.schema import Section


class PackingSection(Section):
    scope: Literal["dataset", "micro_batch"] | None = Field(
        None, description="dataset: pack the training rows once, several samples a row (token rows only); "
                          "micro_batch: pack each micro-batch's sequences, the same rows per step as unpacked "
                          "(default: dataset for text, instruction and chat rows, micro_batch for preference, "
                          "unpaired and prompt rows)")
    max_len: int | None = Field(None, gt=1, description="tokens per packed row (dataset scope default: "
                                                        "data.max_seq_len; micro_batch scope: the most, or the "
                                                        "micro-batch's longest pair or completion if longer; "
                                                        "default: no limit, the rows that cost least)")
    pack_eval: bool = Field(False, description="dataset scope: also pack the eval split (same eval loss, faster); "
                                               "micro_batch scope packs eval micro-batches always")
    window: int = Field(10000, gt=0, description="dataset scope: samples packed together (best-fit decreasing "
                                                 "within each window of the split, in order)")
