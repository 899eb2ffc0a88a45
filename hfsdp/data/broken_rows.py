"""Where a data file that ``datasets`` could not read is broken, in hfsdp's words: the file, the line (counted from 1)
and what is wrong there, found by reading the file again with Python's own readers once pyarrow has failed (its
messages count rows from 0 over the blocks it parsed, or name none: "Invalid encoding in string. in row 12" for a line
13 cut short inside a character). Nothing here runs unless a read failed.

JSON Lines (``.jsonl``, and a ``.json`` file that is not one JSON document): each line one JSON object; a ``.json``
document: where it stops parsing; CSV: a row with another number of fields than the header; text: the
first line that is not UTF-8; Parquet (no lines): the file or the row group pyarrow cannot read.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path


def first_problem(path: Path, loader: str) -> str | None:
    """What is wrong in the data file ``path`` for ``datasets``' ``loader`` (json, csv, text, parquet), as
    "PATH, line N: what" (None where hfsdp finds nothing: the reader's own message is then all there is)."""
    if loader == "parquet":
        return _parquet_problem(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        return (f"{path}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column}: a line cut "
                "short inside a character, or another encoding); save the file as UTF-8")
    if loader == "csv":
        return _csv_problem(path, text)
    if loader == "json":
        if path.suffix.lower() == ".json" and (document := _json_document_problem(path, text)) != "lines":
            return document
        return _json_lines_problem(path, text)
    return None


def _json_document_problem(path: Path, text: str) -> str | None:
    """A ``.json`` file read as one document; "lines" where it reads as JSON Lines (a second value after the first)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":
            return "lines"
        return f"{path}, line {err.lineno}: {_said(err, text.splitlines()[err.lineno - 1:err.lineno])}"
    return None


def _said(err: json.JSONDecodeError, line: list[str]) -> str:
    """The JSON parser's finding on a line, and a line that ends inside a value said to be cut short."""
    said = f"{err.msg} (column {err.colno})"
    if line and err.colno > len(line[0].rstrip()):
        said += ": the line ends inside a value, it may be cut short"
    return said + "; fix or remove that line"


def _json_lines_problem(path: Path, text: str) -> str | None:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{path}, line {number}: {_said(err, [line])}"
        if not isinstance(row, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(row), "a number or null")
            return (f"{path}, line {number}: {kind}, not a JSON object; each line of JSON Lines is one row: "
                    '{"column": value, ...}')
    return None


def _csv_problem(path: Path, text: str) -> str | None:
    reader = csv.reader(io.StringIO(text, newline=""))
    header, start = None, 1
    try:
        for row in reader:
            if row and header is None:
                header = row
            elif row and len(row) != len(header):
                return (f"{path}, line {start}: {len(row)} field(s), and the header (line 1) has {len(header)}: "
                        "quote a field that holds a comma, or fix the row")
            start = reader.line_num + 1
    except csv.Error as err:
        return f"{path}, line {start}: {err}; fix that row"
    return None


def _parquet_problem(path: Path) -> str | None:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid, OSError...
        return f"{path}: not a Parquet file pyarrow can read ({err}); write it again, or use JSON Lines"
    start = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        try:
            parquet.read_row_group(group)
        except Exception as err:
            return (f"{path}: row group {group} (rows {start + 1} to {start + rows}, counted from 1) cannot be read "
                    f"({err}); write the file again")
        start += rows
    return None
