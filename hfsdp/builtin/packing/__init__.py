"""Plugin ``packing``: lay tokenized samples end to end in rows of up to ``max_len`` tokens. Enable with
``plugins: [packing]``.

Config section ``packing:`` (``scope``, ``max_len``, ``pack_eval``, ``window``): its keys, types and defaults are
those of :class:`~hfsdp.builtin.packing.schema.PackingSection` (``hfsdp config-reference packing``,
docs/configuration.md).

Two scopes:

* ``dataset`` (the default for token rows: ``text``, ``instruction``, ``chat``): the training rows are packed once,
  before training, window by window (:func:`pack`: best-fit decreasing over each window's samples, as
  :func:`hfsdp.data.layout.best_fit_decreasing` chooses, each row's samples in their order), so a row holds several
  samples and a step trains on more of them; the data report's padding line says how many rows next-fit in order
  would have needed (the bundled chats in rows of 256 tokens: ``1000 samples packed into 378 rows; next-fit: 429``);
* ``micro_batch`` (the only one for rows scored whole: ``preference``, ``unpaired``, ``prompt``; a choice for token
  rows): each micro-batch's sequences are laid end to end when it is made (:mod:`hfsdp.data.layout`), a preference
  pair's chosen and rejected (a KTO row and its KL row) in one row, GRPO's prompt + completion rows each whole. A
  step trains on the rows it trains on without packing, with the same per-sequence log-probs, so the same losses;
  only the padding goes. A micro-batch whose packed rows would cost more than one sequence a row (little padding
  to save, rows whose masked attention computes a wider square: :func:`hfsdp.data.layout.layout_cost`) stays one
  sequence a row.

Each packed row carries ``position_ids`` that restart at 0 for every sample. Attention stays inside each sample:
when a batch has ``position_ids``, hfsdp gives the model no 2D attention mask (:func:`hfsdp.data.batches.model_inputs`),
and transformers then derives a block-diagonal causal mask from the restarts (``find_packed_sequence_indices`` in
``transformers.masking_utils``, used by sdpa and eager alike); padding restarts at 0 too, so it is a block of its own.
The first token of every packed sample gets no label: it would otherwise be predicted from the previous sample.
A packed row therefore has exactly the summed token loss of its samples trained one by one.
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.packing.schema import PackingSection
from hfsdp.errors import UserError
from hfsdp.rules.table import Rule


# The built-in formats whose rows are scored whole (a pair, a row beside its KL row, a prompt's completions): their
# micro-batches are packed, never their rows.
WHOLE_ROW_FORMATS = ("preference", "unpaired", "prompt")


def formats_of(config) -> set[str]:
    """The data formats of the run's sources."""
    return {s.format or config.data.format for s in config.data.datasets or []} or {config.data.format}


def scope_of(config) -> str:
    """The packing scope of the run: the section's, else micro_batch for rows scored whole, else dataset."""
    section: PackingSection = config.section("packing")
    if section.scope is not None:
        return section.scope
    return "micro_batch" if formats_of(config) & set(WHOLE_ROW_FORMATS) else "dataset"


@hookimpl
def hfsdp_config_section():
    return "packing", PackingSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("packing", "data.max_seq_len"), config_problems)]


def config_problems(config, facts):
    section: PackingSection = config.section("packing")
    problems = []
    if section.max_len is not None and section.max_len < config.data.max_seq_len:
        problems.append(("packing.max_len", f"{section.max_len} is shorter than data.max_seq_len "
                                            f"({config.data.max_seq_len}): a sample would not fit in a packed row"))
    whole = sorted(formats_of(config) & set(WHOLE_ROW_FORMATS))
    if section.scope == "dataset" and whole:
        problems.append(("packing.scope", f"{', '.join(whole)} rows are scored whole (a pair side by side, a row "
                                          "beside its KL row, a prompt's completions): they pack per micro-batch; "
                                          "set packing.scope: micro_batch or leave it out"))
    return problems


@hookimpl
def hfsdp_pack_micro_batches(config):
    if scope_of(config) == "micro_batch":
        return config.section("packing").max_len or 0
    return None


@hookimpl
def hfsdp_packed_row_tokens(config):
    if scope_of(config) == "dataset":
        return config.section("packing").max_len or config.data.max_seq_len
    return None


def pack(input_ids: list[list[int]], labels: list[list[int]], max_len: int) -> dict[str, list[list[int]]]:
    """The samples in rows of at most ``max_len`` tokens, chosen by best-fit decreasing
    (:func:`hfsdp.data.layout.best_fit_decreasing`: the longest first, each into the fullest row it fits), each
    row's samples in their original order, the rows in the order they were opened; ``position_ids`` restart at 0
    for every sample and its first token gets no label. A pure function of the samples."""
    from hfsdp.data.layout import best_fit_decreasing, pack_rows

    lengths = [len(ids) for ids in input_ids]
    for n in lengths:
        if n > max_len:
            raise UserError(f"packing: a sample has {n} tokens, more than packing.max_len ({max_len})")
    samples = [{"input_ids": ids, "labels": labs} for ids, labs in zip(input_ids, labels)]
    bins = best_fit_decreasing(lengths, max_len)
    rows, _ = pack_rows(samples, bins, [[i] for i in range(len(samples))])
    return {key: [row[key] for row in rows] for key in ("input_ids", "labels", "position_ids")}


def next_fit_rows(lengths, max_len: int, window: int) -> int:
    """How many rows next-fit in order (a sample into the current row if it fits, else into a new one) would need
    for these sample lengths, window by window: what the padding report compares :func:`pack`'s rows with."""
    rows = 0
    for start in range(0, len(lengths), window):
        room = 0
        for n in lengths[start:start + window]:
            if n > room:
                rows, room = rows + 1, max_len
            room -= n
    return rows


@hookimpl
def hfsdp_transform_dataset(dataset, config):
    import datasets

    from hfsdp.data.batches import NEXT_FIT_ROWS, row_lengths

    section: PackingSection = config.section("packing")
    if scope_of(config) != "dataset":
        return None
    max_len = section.max_len or config.data.max_seq_len
    out = {}
    for split, ds in dataset.items():
        if split == "train" or section.pack_eval:
            if "position_ids" in ds.column_names:
                raise UserError(f"packing: the {split} rows already have position_ids (packed twice?)")
            packed = ds.map(lambda batch: pack(batch["input_ids"], batch["labels"], max_len), batched=True,
                            batch_size=section.window, remove_columns=ds.column_names, desc=f"packing {split}")
            if split == "train":  # the data report shows what next-fit in order would have needed
                setattr(packed, NEXT_FIT_ROWS, next_fit_rows(row_lengths(ds).tolist(), max_len, section.window))
            ds = packed
        out[split] = ds
    return datasets.DatasetDict(out)
