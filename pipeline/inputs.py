"""Input rows from Parquet (read with pyarrow), JSON Lines / JSON / CSV files or a hub dataset (read with
``datasets`` in streaming mode), selected by filter, shuffle and limit, prompts built by an optional
jinja2 template."""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.meta
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .jobspec import ROW_OVERRIDES, DatasetSpec, FilterSpec, InputSpec


class InputError(ValueError):
    """The input cannot be read or lacks what the job needs; the message names the path, column or row."""


@dataclass
class InputRow:
    """One input row.

    Attributes:
        index: position in the whole input (0-based, files in sorted path order), before filtering
            and shuffling.
        id: the row's id (the id column's value, or ``index``).
        prompt: user text (rendered from ``input.template`` when set), or None.
        messages: chat conversation (list of ``{"role", "content"}``), or None.
        overrides: the row's non-null generation overrides, ``{column: value}`` (see
            ``jobspec.ROW_OVERRIDES``); checked when the row is generated.
        error: why the row's prompt could not be built (its template printed a null value), or None;
            the row then fails with this error.
        choices: ``task: score``: the row's ``input.choices_column`` cell (a list of strings, or whatever
            it holds: checked per row, ``run.plan.row_choices``) or its ``input.continuation_column`` cell;
            None otherwise.
        structured: the row's ``input.structured_column`` cell (a JSON string, checked per row:
            ``run.plan.row_generation``), or None.
    """

    index: int
    id: int | str
    prompt: str | None
    messages: list[dict] | None
    overrides: dict = field(default_factory=dict)
    error: str | None = None
    choices: object = None
    structured: str | None = None


# File suffix -> reader: "parquet" is pyarrow's; the others are ``datasets`` builder names.
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
_FORMAT_NAMES = {"parquet": "Parquet", "json": "JSON", "csv": "CSV"}
_BATCH_ROWS = 1024  # rows per batch when streaming through datasets


def input_files(path: str) -> list[Path]:
    """Input files named by ``path`` (file, directory searched recursively for .parquet, .jsonl, .json
    and .csv files, or glob), sorted.

    Raises:
        InputError: nothing matches.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in FORMATS)
    else:
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    if not files:
        raise InputError(f"input.path {path!r}: no input files found (.parquet, .jsonl, .json or .csv)")
    return files


def input_format(path: str, files: list[Path]) -> str:
    """"parquet", "json" or "csv" by the files' suffixes (other suffixes are read as Parquet).

    Raises:
        InputError: the files mix formats.
    """
    kinds = {FORMATS.get(f.suffix, "parquet") for f in files}
    if len(kinds) > 1:
        names = ", ".join(sorted(_FORMAT_NAMES[k] for k in kinds))
        raise InputError(f"input.path {path!r}: files mix formats ({names}); use one format")
    return kinds.pop()


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _check_column(table: pa.Table, name: str, key: str, kind: str, ok) -> None:
    if name not in table.column_names:
        raise InputError(f"{key}: column {name!r} not found in input (columns: {', '.join(table.column_names)})")
    t = table.schema.field(name).type
    if not ok(t):
        shown = "string" if pa.types.is_large_string(t) else t
        raise InputError(f"{key}: column {name!r} has type {shown}, expected {kind}")


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
    taken = {spec.id_column, spec.prompt_column, spec.messages_column, spec.choices_column,
             spec.continuation_column, spec.structured_column}
    return [c for c in ROW_OVERRIDES if c in names and c not in taken]


# --- templates ---------------------------------------------------------------------------------------


class _NullPrinted(Exception):
    """A template printed a null column value."""


def _finalize(value):
    if value is None:
        raise _NullPrinted
    return value


_NULL_PRINTED = "input.template printed a null value"
_RAISED = "input.template failed: "


def _template_env() -> ImmutableSandboxedEnvironment:
    # StrictUndefined: a name that is not a column is an error, never an empty string
    return ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                         finalize=_finalize)


def template_columns(source: str) -> list[str]:
    """The names a prompt template reads (sorted): each must be an input column."""
    env = _template_env()
    return sorted(jinja2.meta.find_undeclared_variables(env.parse(source)) - set(env.globals))


def _render_all(source: str, columns: dict[str, list], n: int) -> tuple[list[str | None], list[str | None]]:
    """Render ``source`` once for each of ``n`` rows with that row's ``columns`` values.

    Returns:
        (prompts, errors): per row, the text or None, and None or why rendering failed.
    """
    template = _template_env().from_string(source)
    prompts, errors = [], []
    for i in range(n):
        values = {c: v[i] for c, v in columns.items()}
        try:
            prompts.append(template.render(values))
            errors.append(None)
        except _NullPrinted:
            nulls = [c for c, v in values.items() if v is None]
            prompts.append(None)
            errors.append(f"{_NULL_PRINTED} (null in this row: {', '.join(nulls)})")
        except Exception as e:  # noqa: BLE001 - the template runs on each row's data; any failure fails that row
            prompts.append(None)
            errors.append(f"{_RAISED}{type(e).__name__}: {e}")
    return prompts, errors


def _check_template_ran(errors: list[str | None], ids: list, used: list[bool]):
    """Raise if the template raised on every row that uses it: then the template is at fault, not the data.

    A printed null does not count (a column may be all null in a selection); rows with messages do not
    use the template.

    Raises:
        InputError: naming the first row and its error.
    """
    tried = [(i, e) for i, e, u in zip(ids, errors, used) if u]
    if tried and all(e is not None and not e.startswith(_NULL_PRINTED) for _, e in tried):
        first, error = tried[0]
        raise InputError(f"input.template raised on every row ({len(tried)}); row {first!r}: "
                         f"{error.removeprefix(_RAISED)}")


# --- reading -----------------------------------------------------------------------------------------


def _filters(spec: InputSpec) -> list[FilterSpec]:
    return list(spec.filter or [])


def needed_columns(spec: InputSpec) -> dict[str, str]:
    """The input columns the job reads (override columns aside), each with the job key naming it."""
    keys = {}
    if spec.id_column:
        keys[spec.id_column] = "input.id_column"
    if spec.template is not None:
        keys.update({c: "input.template" for c in template_columns(spec.template) if c not in keys})
    elif spec.prompt_column:
        keys.setdefault(spec.prompt_column, "input.prompt_column")
    if spec.messages_column:
        keys.setdefault(spec.messages_column, "input.messages_column")
    for key in ("choices_column", "continuation_column", "structured_column"):
        if getattr(spec, key):
            keys.setdefault(getattr(spec, key), f"input.{key}")
    for f in _filters(spec):
        keys.setdefault(f.column, "input.filter")
    return keys


def _job_columns(spec: InputSpec, names: list[str]) -> dict[str, str]:
    """``needed_columns`` plus the override columns among the input's column ``names``."""
    keys = needed_columns(spec)
    return {**keys, **{c: "per-row override" for c in override_columns(spec, names) if c not in keys}}


def _check_present(keys: dict[str, str], names: list[str], where: str) -> None:
    for c, key in keys.items():
        if c not in names:
            raise InputError(f"{key}: column {c!r} not found in {where} (columns: {', '.join(names)})")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _read_parquet(spec: InputSpec, files: list[Path], pick, stop_after: int | None) -> pa.Table:
    keys = None
    tables, n = [], 0
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input file {f}: not readable as Parquet: {e}") from None
        keys = pick(schema.names) if not tables else keys  # the first file decides the override columns
        if keys is not None:
            _check_present(keys, schema.names, str(f))
        tables.append(pq.read_table(f, columns=None if keys is None else list(keys)))
        n += tables[-1].num_rows
        if stop_after is not None and n >= stop_after:
            break
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise InputError(f"input.path {spec.path!r}: files have incompatible schemas: {e}") from None


def _stream(dataset, what: str, stop_after: int | None) -> pa.Table:
    """The Arrow batches of a streaming ``datasets.IterableDataset``, concatenated; stops reading after
    ``stop_after`` rows."""
    tables, n = [], 0
    try:
        for batch in dataset.with_format("arrow").iter(batch_size=_BATCH_ROWS):
            tables.append(batch)
            n += batch.num_rows
            if stop_after is not None and n >= stop_after:
                break
        table = pa.concat_tables(tables, promote_options="permissive") if tables else None
    except Exception as e:  # noqa: BLE001 - datasets and its readers raise many types; the job gets one line
        raise InputError(f"{what}: not readable: {_first_line(e)}") from None
    if table is None:
        raise InputError(f"{what}: no rows")
    return table.replace_schema_metadata(None)


def _read_files(spec: InputSpec, files: list[Path], fmt: str, stop_after: int | None) -> pa.Table:
    import datasets

    what = f"input.path {spec.path!r} ({_FORMAT_NAMES[fmt]})"
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train", streaming=True)
    except Exception as e:  # noqa: BLE001 - see _stream
        raise InputError(f"{what}: not readable: {_first_line(e)}") from None
    return _stream(ds, what, stop_after)


def _read_hub(d: DatasetSpec, stop_after: int | None) -> pa.Table:
    import datasets

    what = f"input.dataset {d.name!r}" + (f" config {d.config!r}" if d.config else "") + f" split {d.split!r}"
    try:
        ds = datasets.load_dataset(d.name, d.config, split=d.split, revision=d.revision, streaming=True)
    except ConnectionError as e:
        raise InputError(f"{what}: cannot reach the Hugging Face hub ({_first_line(e)}); "
                         "offline, use input.path with local files") from None
    except Exception as e:  # noqa: BLE001 - see _stream
        raise InputError(f"{what}: cannot be loaded: {_first_line(e)}") from None
    return _stream(ds, what, stop_after)


def _read(spec: InputSpec, pick, stop_after: int | None) -> pa.Table:
    """The input in input order: the columns ``pick(column names)`` returns (``{column: job key}``; None:
    all), at least ``stop_after`` rows (None: all)."""
    if spec.dataset is not None:
        table, where = _read_hub(spec.dataset, stop_after), f"dataset {spec.dataset.name!r}"
    else:
        files = input_files(spec.path)
        fmt = input_format(spec.path, files)
        if fmt == "parquet":
            return _read_parquet(spec, files, pick, stop_after)
        table, where = _read_files(spec, files, fmt, stop_after), "input"
    keys = pick(table.column_names)
    if keys is None:
        return table
    _check_present(keys, table.column_names, where)
    return table.select(list(keys))


def read_table(spec: InputSpec, stop_after: int | None = None) -> pa.Table:
    """The job's columns of the input (``needed_columns`` and any override columns) in input order, no
    filter, shuffle or limit applied.

    Args:
        stop_after: read at least this many rows and stop as soon as possible after (None: all).

    Raises:
        InputError: missing files or columns, unreadable files, a hub dataset that cannot be loaded.
    """
    return _read(spec, lambda names: _job_columns(spec, names), stop_after)


def read_input(spec: InputSpec, columns: list[str] | None = None) -> pa.Table:
    """The whole input as it is (every column, or only ``columns``), in input order.

    Raises:
        InputError: as ``read_table``.
    """
    return _read(spec, lambda names: None if columns is None else {c: "input" for c in columns}, None)


# --- selecting ---------------------------------------------------------------------------------------


def _filter_mask(table: pa.Table, f: FilterSpec) -> pa.Array:
    """Rows whose ``f.column`` equals ``f.equals`` or is in ``f.one_of`` (null never matches).

    Raises:
        InputError: a value that is not of the column's type (``1.5`` for an integer column, ``5`` for a
            string column).
    """
    col = table.column(f.column)
    key, values = ("input.filter.equals", [f.equals]) if f.one_of is None else ("input.filter.one_of", f.one_of)
    t = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
    try:
        value_set = pa.array(values, type=t)
        ok = value_set.to_pylist() == values and all(isinstance(v, bool) == pa.types.is_boolean(t) for v in values)
    except (pa.ArrowException, TypeError, ValueError):
        ok = False
    if not ok:
        shown = repr(values[0]) if f.one_of is None else repr(values)
        raise InputError(f"{key}: {shown} does not match the type of column {f.column!r} ({t})")
    return pc.fill_null(pc.is_in(col, value_set=value_set), False)


def _shuffle_key(seed: int, row_id) -> bytes:
    """blake2b of (seed, id) as text: the same order in every process, platform and library version."""
    return hashlib.blake2b(f"{seed}\x1f{type(row_id).__name__}:{row_id}".encode(), digest_size=8).digest()


def _ids(table: pa.Table, spec: InputSpec) -> tuple[list, pa.DataType]:
    if not spec.id_column:
        return list(range(table.num_rows)), pa.int64()
    _check_column(table, spec.id_column, "input.id_column", "integer or string",
                  lambda t: pa.types.is_integer(t) or _is_string(t))
    id_type = pa.int64() if pa.types.is_integer(table.schema.field(spec.id_column).type) else pa.string()
    return table.column(spec.id_column).to_pylist(), id_type


def select_indices(table: pa.Table, spec: InputSpec, ids: list, limit: int | None) -> list[int]:
    """Positions of the rows the job uses, in the order it uses them: rows matching every filter, then
    ordered by ``_shuffle_key(shuffle_seed, id)`` if a seed is set, then the first ``limit``."""
    mask = None
    for f in _filters(spec):
        m = _filter_mask(table, f)
        mask = m if mask is None else pc.and_(mask, m)
    picked = list(range(table.num_rows)) if mask is None else pc.indices_nonzero(mask).to_pylist()
    if spec.shuffle_seed is not None:
        picked.sort(key=lambda i: (_shuffle_key(spec.shuffle_seed, ids[i]), i))
    return picked[:limit] if limit is not None else picked


def _check_ids(spec: InputSpec, ids: list) -> None:
    nulls = [i for i, v in ids if v is None]
    if nulls:
        raise InputError(f"input.id_column {spec.id_column!r}: null id in row(s) {', '.join(map(str, nulls[:10]))}")
    seen, dups = set(), []
    for _, v in ids:
        if v in seen:
            dups.append(v)
        seen.add(v)
    if dups:
        shown = ", ".join(repr(d) for d in list(dict.fromkeys(dups))[:10])
        raise InputError(f"input.id_column {spec.id_column!r}: duplicate ids {shown}")


def read_rows(spec: InputSpec, limit: int | None = None) -> tuple[list[InputRow], pa.DataType]:
    """Read, select and check the input rows.

    Selection order: ``spec.filter`` keeps matching rows, ``spec.shuffle_seed`` reorders them, then
    the first ``limit`` are used. Ids and ``InputRow.index`` are those of the whole input, so resume
    keys do not depend on the selection.

    Args:
        spec: the job's input section.
        limit: use only the first ``limit`` selected rows (overrides ``spec.limit`` when given).

    Returns:
        (rows, id_type): rows in the order they are generated; id_type is ``pa.int64()`` or
        ``pa.string()``, the type of the output ``id`` column.

    Raises:
        InputError: missing files or columns, wrong column types, a filter value of another type than
            its column, null or duplicate ids among the selected rows, a hub dataset that cannot be loaded,
            an ``input.template`` that raises on every selected row that uses it (one that raises on some
            rows fails those rows).
    """
    limit = limit if limit is not None else spec.limit
    whole = spec.filter is not None or spec.shuffle_seed is not None  # selecting needs every row
    table = read_table(spec, stop_after=None if whole else limit)
    if spec.template is None and spec.prompt_column:
        _check_column(table, spec.prompt_column, "input.prompt_column", "string", _is_string)
    if spec.messages_column:
        _check_column(table, spec.messages_column, "input.messages_column",
                      "list<struct<role: string, content: string>>", _is_messages)
    if spec.choices_column:
        _check_column(table, spec.choices_column, "input.choices_column", "list<string>", _is_list_of(_is_string))
    if spec.continuation_column:
        _check_column(table, spec.continuation_column, "input.continuation_column", "string", _is_string)
    if spec.structured_column:
        _check_column(table, spec.structured_column, "input.structured_column", "string", _is_string)
    for name in override_columns(spec, table.column_names):
        kind, ok = _OVERRIDE_TYPES.get(name, ("number", _is_number))
        _check_column(table, name, f"per-row override of generation.{name}", kind, ok)
    all_ids, id_type = _ids(table, spec)
    picked = select_indices(table, spec, all_ids, limit)
    if spec.id_column:
        _check_ids(spec, [(i, all_ids[i]) for i in picked])
    sel = table.take(pa.array(picked, pa.int64()))
    n = sel.num_rows
    overrides = {name: sel.column(name).to_pylist() for name in override_columns(spec, sel.column_names)}
    errors = [None] * n
    messages = sel.column(spec.messages_column).to_pylist() if spec.messages_column else [None] * n
    if spec.template is not None:
        columns = {c: sel.column(c).to_pylist() for c in template_columns(spec.template)}
        prompts, errors = _render_all(spec.template, columns, n)
        # a row with messages never uses its template prompt, so a failed render does not fail it
        errors = [None if m is not None else e for m, e in zip(messages, errors)]
        _check_template_ran(errors, [all_ids[i] for i in picked], [m is None for m in messages])
    elif spec.prompt_column:
        prompts = sel.column(spec.prompt_column).to_pylist()
    else:
        prompts = [None] * n
    scored = spec.choices_column or spec.continuation_column
    choices = sel.column(scored).to_pylist() if scored else [None] * n
    structured = sel.column(spec.structured_column).to_pylist() if spec.structured_column else [None] * n
    rows = [InputRow(index=i, id=all_ids[i], prompt=prompts[k], messages=messages[k],
                     overrides={c: v[k] for c, v in overrides.items() if v[k] is not None}, error=errors[k],
                     choices=choices[k], structured=structured[k])
            for k, i in enumerate(picked)]
    return rows, id_type
