"""Input rows from Parquet (a file, a directory of files, or a glob), read with pyarrow."""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .jobspec import ROW_OVERRIDES, InputSpec


class InputError(ValueError):
    """The input cannot be read or lacks what the job needs; the message names the path, column or row."""


@dataclass
class InputRow:
    """One input row.

    Attributes:
        index: position in the input (0-based, files in sorted path order).
        id: the row's id (the id column's value, or ``index``).
        prompt: user text, or None.
        messages: chat conversation (list of ``{"role", "content"}``), or None.
        overrides: the row's non-null generation overrides, ``{column: value}`` (see
            ``jobspec.ROW_OVERRIDES``); checked when the row is generated.
    """

    index: int
    id: int | str
    prompt: str | None
    messages: list[dict] | None
    overrides: dict = field(default_factory=dict)


def input_files(path: str) -> list[Path]:
    """Parquet files named by ``path`` (file, directory searched recursively, or glob), sorted.

    Raises:
        InputError: nothing matches.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if f.is_file())
    else:
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    if not files:
        raise InputError(f"input.path {path!r}: no Parquet files found")
    return files


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _check_column(table: pa.Table, name: str, key: str, kind: str, ok) -> None:
    if name not in table.column_names:
        raise InputError(f"{key}: column {name!r} not found in input (columns: {', '.join(table.column_names)})")
    t = table.schema.field(name).type
    if not ok(t):
        raise InputError(f"{key}: column {name!r} has type {t}, expected {kind}")


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    return pa.types.is_struct(item) and all(
        item.get_field_index(k) >= 0 and _is_string(item.field(k).type) for k in ("role", "content")
    )


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_list_of(ok):
    return lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t)) and ok(t.value_type)


# What an override column may hold (type name for messages, predicate).
_OVERRIDE_TYPES = {
    "stop": ("string or list<string>", lambda t: _is_string(t) or _is_list_of(_is_string)(t)),
    "stop_token_ids": ("list<integer>", _is_list_of(pa.types.is_integer)),
    **{k: ("integer", _is_number) for k in ("max_tokens", "min_tokens", "n", "top_k", "seed")},
}


def override_columns(spec: InputSpec, names) -> list[str]:
    """The input columns among ``names`` that set generation keys per row (none unless
    ``spec.row_overrides``; the id/prompt/messages columns never do)."""
    if not spec.row_overrides:
        return []
    taken = {spec.id_column, spec.prompt_column, spec.messages_column}
    return [c for c in ROW_OVERRIDES if c in names and c not in taken]


def read_table(spec: InputSpec, limit: int | None = None) -> pa.Table:
    """The input as one table of only the needed columns (and any override columns), first ``limit``
    rows (if given)."""
    files = input_files(spec.path)
    columns = list(dict.fromkeys(c for c in (spec.id_column, spec.prompt_column, spec.messages_column) if c))
    try:
        columns += override_columns(spec, pq.read_schema(files[0]).names)
    except (OSError, pa.ArrowException):
        pass  # reported for this file below
    tables = []
    n = 0
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input file {f}: not readable as Parquet: {e}") from None
        missing = [c for c in columns if c not in schema.names]
        if missing:
            key = {spec.id_column: "input.id_column", spec.prompt_column: "input.prompt_column",
                   spec.messages_column: "input.messages_column"}.get(missing[0], "per-row override")
            raise InputError(f"{key}: column {missing[0]!r} not found in {f} (columns: {', '.join(schema.names)})")
        tables.append(pq.read_table(f, columns=columns))
        n += tables[-1].num_rows
        if limit is not None and n >= limit:
            break
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise InputError(f"input.path {spec.path!r}: files have incompatible schemas: {e}") from None
    return table.slice(0, limit) if limit is not None else table


def read_rows(spec: InputSpec, limit: int | None = None) -> tuple[list[InputRow], pa.DataType]:
    """Read and check the input rows.

    Args:
        spec: the job's input section.
        limit: use only the first ``limit`` rows (overrides ``spec.limit`` when given).

    Returns:
        (rows, id_type): id_type is ``pa.int64()`` or ``pa.string()``, the type of the output ``id`` column.

    Raises:
        InputError: missing files or columns, wrong column types, null or duplicate ids.
    """
    limit = limit if limit is not None else spec.limit
    table = read_table(spec, limit)
    if spec.prompt_column:
        _check_column(table, spec.prompt_column, "input.prompt_column", "string", _is_string)
    if spec.messages_column:
        _check_column(table, spec.messages_column, "input.messages_column",
                      "list<struct<role: string, content: string>>", _is_messages)
    overrides = {}
    for name in override_columns(spec, table.column_names):
        kind, ok = _OVERRIDE_TYPES.get(name, ("number", _is_number))
        _check_column(table, name, "per-row override", kind, ok)
        overrides[name] = table.column(name).to_pylist()
    n = table.num_rows
    if spec.id_column:
        _check_column(table, spec.id_column, "input.id_column", "integer or string",
                      lambda t: pa.types.is_integer(t) or _is_string(t))
        id_type = pa.int64() if pa.types.is_integer(table.schema.field(spec.id_column).type) else pa.string()
        ids = table.column(spec.id_column).to_pylist()
        nulls = [i for i, v in enumerate(ids) if v is None]
        if nulls:
            raise InputError(f"input.id_column {spec.id_column!r}: null id in row(s) {', '.join(map(str, nulls[:10]))}")
        seen, dups = set(), []
        for v in ids:
            if v in seen:
                dups.append(v)
            seen.add(v)
        if dups:
            shown = ", ".join(repr(d) for d in list(dict.fromkeys(dups))[:10])
            raise InputError(f"input.id_column {spec.id_column!r}: duplicate ids {shown}")
    else:
        id_type, ids = pa.int64(), list(range(n))
    prompts = table.column(spec.prompt_column).to_pylist() if spec.prompt_column else [None] * n
    messages = table.column(spec.messages_column).to_pylist() if spec.messages_column else [None] * n
    rows = [InputRow(index=i, id=ids[i], prompt=prompts[i], messages=messages[i],
                     overrides={k: v[i] for k, v in overrides.items() if v[i] is not None}) for i in range(n)]
    return rows, id_type
