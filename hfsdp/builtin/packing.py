"""Plugin ``packing``: concatenate tokenized samples into rows of up to ``max_len`` tokens. Enable with
``plugins: [packing]``.

Config section ``packing:`` (``max_len``, ``pack_eval``, ``window``): its keys, types and defaults are those of
:class:`PackingSection` (``hfsdp config-reference packing``, docs/configuration.md).

Each packed row carries ``position_ids`` that restart at 0 for every sample. Attention stays inside each sample:
when a batch has ``position_ids``, hfsdp gives the model no 2D attention mask (:func:`hfsdp.data.batches.model_inputs`),
and transformers then derives a block-diagonal causal mask from the restarts (``find_packed_sequence_indices`` in
``transformers.masking_utils``, used by sdpa and eager alike); padding restarts at 0 too, so it is a block of its own.
The first token of every packed sample gets no label: it would otherwise be predicted from the previous sample.
A packed row therefore has exactly the summed token loss of its samples trained one by one.
"""

from __future__ import annotations

from pydantic import Field

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.config.schema import Section
from hfsdp.errors import UserError


class PackingSection(Section):
    max_len: int | None = Field(None, gt=1, description="tokens per packed row (default: data.max_seq_len)")
    pack_eval: bool = Field(False, description="also pack the eval split (same eval loss, faster)")
    window: int = Field(10000, gt=0, description="samples packed together (datasets.map batch size)")


@hookimpl
def hfsdp_config_section():
    return "packing", PackingSection


@hookimpl
def hfsdp_validate_config(config):
    section: PackingSection = config.section("packing")
    if section.max_len is not None and section.max_len < config.data.max_seq_len:
        return [("packing.max_len", f"{section.max_len} is shorter than data.max_seq_len ({config.data.max_seq_len}): "
                                    "a sample would not fit in a packed row")]
    return None


def pack(input_ids: list[list[int]], labels: list[list[int]], max_len: int) -> dict[str, list[list[int]]]:
    """Greedy next-fit packing in order: a sample goes into the current row if it fits, else starts a new row."""
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []

    def flush() -> None:
        if cur_ids:
            rows["input_ids"].append(list(cur_ids))
            rows["labels"].append(list(cur_labels))
            rows["position_ids"].append(list(cur_pos))
            cur_ids.clear(), cur_labels.clear(), cur_pos.clear()

    for ids, labs in zip(input_ids, labels):
        n = len(ids)
        if n > max_len:
            raise UserError(f"packing: a sample has {n} tokens, more than packing.max_len ({max_len})")
        if len(cur_ids) + n > max_len:
            flush()
        cur_ids.extend(ids)
        cur_labels.extend([IGNORE_INDEX] + list(labs[1:]))
        cur_pos.extend(range(n))
    flush()
    return rows


@hookimpl
def hfsdp_transform_dataset(dataset, config):
    import datasets

    section: PackingSection = config.section("packing")
    max_len = section.max_len or config.data.max_seq_len
    out = {}
    for split, ds in dataset.items():
        if split == "train" or section.pack_eval:
            if "position_ids" in ds.column_names:
                raise UserError(f"packing: the {split} rows already have position_ids (packed twice?)")
            ds = ds.map(lambda batch: pack(batch["input_ids"], batch["labels"], max_len), batched=True,
                        batch_size=section.window, remove_columns=ds.column_names, desc=f"packing {split}")
        out[split] = ds
    return datasets.DatasetDict(out)
