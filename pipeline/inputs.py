"""Input rows from Parquet (read with pyarrow), JSON Lines / JSON / CSV files or a hub dataset (read with
``datasets`` in streaming mode; a local dataset directory's files as those of a directory ``input.path``),
selected by filter, shuffle and limit, prompts built by an optional jinja2 template."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import glob
import hashlib
import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jinja2.meta
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import first_line
from .jobspec import ROW_OVERRIDES, DatasetSpec, FilterSpec, InputSpec
from .resolve import hub_unreachable
from .row_template import NullCell, NullPrinted, compile_template, environment


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
        error: why the row's prompt could not be built (its template printed a null value; its prompt or
            messages cell of a mixed-type JSON column is not a string or a list), or None; the row then
            fails with this error.
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


def _hidden(f: Path, top: Path) -> bool:
    """A name of ``f`` below directory ``top`` starts with a dot (``.cache/x.jsonl``, ``.notes.csv``): a glob's
    wildcards skip such names, and so does a directory's search."""
    return any(name.startswith(".") for name in f.relative_to(top).parts)


def input_files(path: str) -> list[Path]:
    """Input files named by ``path`` (file, directory searched recursively for .parquet, .jsonl, .json
    and .csv files, suffixes in any case, names starting with a dot skipped, or glob), sorted.

    Raises:
        InputError: nothing matches.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in FORMATS and not _hidden(f, p))
    else:
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    if not files:
        raise InputError(f"input.path {path!r}: no input files found (.parquet, .jsonl, .json or .csv)")
    return files


def input_format(where: str, files: list[Path]) -> str:
    """"parquet", "json" or "csv" by the files' suffixes, in any case (other suffixes are read as Parquet, as
    they always were: ``_read_parquet`` names the suffix of such a file that is not Parquet).

    Args:
        where: how messages name the input (``input.path 'data/*'``).

    Raises:
        InputError: the files mix formats; with JSON or CSV files, naming a file of another suffix.
    """
    kinds = {FORMATS.get(f.suffix.lower(), "parquet") for f in files}
    if len(kinds) > 1:
        other = next((f for f in files if f.suffix.lower() not in FORMATS), None)
        if other is not None:
            raise InputError(f"{where}: {other}: {_unknown_suffix(other)}")
        names = ", ".join(sorted(_FORMAT_NAMES[k] for k in kinds))
        raise InputError(f"{where}: files mix formats ({names}); use one format")
    return kinds.pop()


def _unknown_suffix(f: Path) -> str:
    """``suffix '.gz' is none of the formats read (.parquet, .jsonl, .json, .csv)``: of a file ``f`` whose suffix
    names no format (a compressed file is not read)."""
    formats = ", ".join(FORMATS)
    return f"suffix {f.suffix!r} is none of the formats read ({formats})" if f.suffix else \
        f"no suffix naming one of the formats read ({formats})"


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
    ``spec.row_overrides``, none for a ``task: score`` input, whose ``choices_column`` or
    ``continuation_column`` is set: it generates nothing; the id/prompt/messages columns never do)."""
    if not spec.row_overrides or spec.choices_column is not None or spec.continuation_column is not None:
        return []
    taken = {spec.id_column, spec.prompt_column, spec.messages_column, spec.structured_column}
    return [c for c in ROW_OVERRIDES if c in names and c not in taken]


# --- templates ---------------------------------------------------------------------------------------


_NULL_PRINTED = "input.template printed a null value"
_RAISED = "input.template failed: "



def template_columns(source: str, names=()) -> list[str]:
    """The names a prompt template reads (sorted): each must be an input column. A jinja global's name
    (``range``, ``dict``, ``namespace``, ...) is a column when it is among the input's column ``names``."""
    env = environment()
    globals_ = set(env.globals)
    env.globals.clear()  # else find_undeclared_variables leaves them out (its own copy of DEFAULT_NAMESPACE)
    return sorted(jinja2.meta.find_undeclared_variables(env.parse(source)) - (globals_ - set(names)))


def _null_paths(value, path: str) -> list[str]:
    """Where ``value`` (a cell of column ``path``) holds nulls: ``st.k``, ``lst[1]``."""
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _null_paths(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _null_paths(v, f"{path}[{i}]")]
    return []


def _float32_as(t: pa.DataType, to: pa.DataType) -> pa.DataType:
    """``t`` with each float32 in it (also a list's items, a struct's fields) replaced by ``to``."""
    if pa.types.is_float32(t):
        return to
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = t.value_field.with_type(_float32_as(t.value_type, to))
        return (pa.large_list(item) if pa.types.is_large_list(t)
                else pa.list_(item, t.list_size) if pa.types.is_fixed_size_list(t) else pa.list_(item))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_float32_as(f.type, to)) for f in t])
    return t


def _template_values(column: pa.ChunkedArray) -> list:
    """``column``'s values for a template: a float32 as the float64 of its shortest text (0.1 prints 0.1, not
    0.10000000149011612, the float64 nearest it); arrow's float-to-string cast writes that shortest text."""
    text = _float32_as(column.type, pa.string())
    if text != column.type:
        column = column.cast(text).cast(_float32_as(column.type, pa.float64()))
    return column.to_pylist()


def _render_all(source: str, columns: dict[str, list], n: int) -> tuple[list[str | None], list[str | None]]:
    """Render ``source`` once for each of ``n`` rows with that row's ``columns`` values.

    Returns:
        (prompts, errors): per row, the text or None, and None or why rendering failed.
    """
    template = compile_template(source)
    prompts, errors = [], []
    for i in range(n):
        values = {c: NullCell(c) if v[i] is None else v[i] for c, v in columns.items()}
        try:
            prompts.append(template.render(values))
            errors.append(None)
        except NullPrinted as e:
            nulls = [e.column] if e.column else [p for c, v in values.items() for p in _null_paths(v, c)]
            prompts.append(None)
            errors.append(f"{_NULL_PRINTED} (null in this row: {', '.join(nulls)})" if nulls else _NULL_PRINTED)
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


def needed_columns(spec: InputSpec, names=()) -> dict[str, str]:
    """The input columns the job reads (override columns aside), each with the job key naming it (``names``:
    the input's columns, for ``template_columns``)."""
    keys = {}
    if spec.id_column:
        keys[spec.id_column] = "input.id_column"
    if spec.template is not None:
        keys.update({c: "input.template" for c in template_columns(spec.template, names) if c not in keys})
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


OVERRIDE_KEY = "per-row override"  # the job key naming an override column (``_job_columns``)


def _job_columns(spec: InputSpec, names: list[str]) -> dict[str, str]:
    """``needed_columns`` plus the override columns among the input's column ``names``."""
    keys = needed_columns(spec, names)
    return {**keys, **{c: OVERRIDE_KEY for c in override_columns(spec, names) if c not in keys}}


def _check_present(keys: dict[str, str], names: list[str], where: str) -> None:
    for c, key in keys.items():
        if c not in names:
            raise InputError(f"{key}: column {c!r} not found in {where} (columns: {', '.join(names)})")


def _dataset_name(d: DatasetSpec) -> str:
    """``input.dataset 'openai/gsm8k' config 'main' split 'test'``: how messages name a hub dataset."""
    return f"input.dataset {d.name!r}" + (f" config {d.config!r}" if d.config else "") + f" split {d.split!r}"


def _source(spec: InputSpec) -> str:
    """How messages name the input: ``input.path 'data/*'``, or as ``_dataset_name``."""
    return _dataset_name(spec.dataset) if spec.dataset is not None else f"input.path {spec.path!r}"


def _no_rows(spec: InputSpec) -> InputError:
    return InputError(f"{_source(spec)}: no rows")


def _read_parquet(spec: InputSpec, files: list[Path], pick, stop_after: int | None) -> pa.Table:
    """The Parquet ``files`` in order (at least ``stop_after`` rows). The columns are ``pick``'s over the names
    of every file (footers only), so an override column that only some files hold is read from those (null,
    the job's value, in the others); a column the job names must be in every file."""
    schemas = []
    for f in files:
        try:
            schemas.append(pq.read_schema(f))
        except (OSError, pa.ArrowException) as e:
            if f.suffix.lower() in FORMATS:
                raise InputError(f"input file {f}: not readable as Parquet: {e}") from None
            raise InputError(f"input file {f}: {_unknown_suffix(f)}, and it is not readable as Parquet: "
                             f"{first_line(e)}") from None
    keys = pick(list(dict.fromkeys(name for schema in schemas for name in schema.names)))
    tables, n = [], 0
    for f, schema in zip(files, schemas):
        columns = None
        if keys is not None:
            _check_present({c: k for c, k in keys.items() if k != OVERRIDE_KEY}, schema.names, str(f))
            columns = [c for c in keys if c in schema.names]
        tables.append(pq.read_table(f, columns=columns))
        n += tables[-1].num_rows
        if stop_after is not None and n >= stop_after:
            break
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise InputError(f"{_source(spec)}: files have incompatible schemas: {e}") from None
    if table.num_rows == 0:
        raise _no_rows(spec)
    return table


# Loggers of the libraries that read JSON, CSV and hub inputs: they log what they then raise ("Failed to read
# file ...") and each retry of an unreachable hub; the InputError says it once, in one line.
_LIBRARY_LOGGERS = ("datasets", "huggingface_hub", "fsspec")


@contextlib.contextmanager
def _quiet_libraries():
    """Silence the reading libraries' loggers (call after importing ``datasets``, whose import sets its level)."""
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _stream(dataset, what: str, stop_after: int | None, passed: tuple[type, ...] = ()) -> pa.Table | None:
    """The Arrow batches of a streaming ``datasets.IterableDataset``, concatenated (None: no rows); stops
    reading after ``stop_after`` rows. Exceptions of the ``passed`` types propagate as they are."""
    tables, n = [], 0
    try:
        for batch in dataset.with_format("arrow").iter(batch_size=_BATCH_ROWS):
            tables.append(batch)
            n += batch.num_rows
            if stop_after is not None and n >= stop_after:
                break
        table = pa.concat_tables(tables, promote_options="permissive") if tables else None
    except passed:
        raise
    except Exception as e:  # noqa: BLE001 - datasets and its readers raise many types; the job gets one line
        raise InputError(f"{what}: not readable: {first_line(e)}") from None
    if table is None or table.num_rows == 0:
        return None
    return table.replace_schema_metadata(None)


def _is_blank(f: Path) -> bool:
    """An empty file, or one of only whitespace (``datasets`` fails on an empty JSON Lines file)."""
    size = f.stat().st_size
    return size == 0 or (size <= 4096 and not f.read_bytes().strip())


def _csv_first_row(f: Path) -> str | None:
    """Why pandas would misread the first data row of CSV file ``f``, or None.

    A first data row with more fields than the header makes pandas (``index_col=None``) take the first
    column as the index, shifting every column; ``index_col=False`` drops the extra fields instead, with a
    ``ParserWarning``. Only one extra empty field (a trailing comma) is read right. Later rows with too many
    fields are pandas' "Expected 2 fields in line 3, saw 3" error already; this says the same of the first.
    """
    try:
        with open(f, newline="", encoding="utf-8-sig", errors="replace") as fh:
            reader = csv.reader(fh)
            header = next((r for r in reader if r), None)
            first = next((r for r in reader if r), None) if header is not None else None
            line = reader.line_num
    except (OSError, csv.Error):
        return None  # pandas reads it (and says what is wrong)
    if header is None or first is None or len(first) <= len(header):
        return None
    if len(first) == len(header) + 1 and first[-1] == "":
        return None
    return f"{f}: Expected {len(header)} fields in line {line}, saw {len(first)}"


def _csv_text_columns(spec: InputSpec, table: pa.Table) -> set[str]:
    """The columns a job reads as text: prompt, messages, template (other than per-row override columns),
    choices, continuation and structured columns, and the columns a filter compares with a string."""
    names = {spec.prompt_column, spec.messages_column, spec.choices_column, spec.continuation_column,
             spec.structured_column}
    if spec.template is not None:
        # an override column the template prints stays typed: text, its override would be refused
        names.update(set(template_columns(spec.template, table.column_names))
                     - set(override_columns(spec, table.column_names)))
    for f in _filters(spec):
        if any(isinstance(v, str) for v in ([f.equals] if f.one_of is None else f.one_of)):
            names.add(f.column)
    return {n for n in names if n}


def _csv_nulls(spec: InputSpec, table: pa.Table) -> pa.Table:
    """A CSV ``table`` read with only empty cells null, with pandas' other null spellings (``NA``, ``N/A``,
    ``null``, ``nan``, ...) made null again in every column the job does not read as text
    (``_csv_text_columns``), and such a column then typed as pandas would have: integers, else floats (all
    null: floats); the id column stays text, for ``_csv_ids``. So a prompt ``None`` or a country ``NA`` stays
    text, while a number column with ``NA`` for a missing value reads as numbers and nulls, as before."""
    from pandas._libs.parsers import STR_NA_VALUES

    text, spellings = _csv_text_columns(spec, table), pa.array(sorted(STR_NA_VALUES), pa.string())
    for i, (name, t) in enumerate(zip(table.column_names, table.schema.types)):
        if name in text or not _is_string(t):
            continue
        col = table.column(i).cast(pa.string())
        missing = pc.fill_null(pc.is_in(col, value_set=spellings), False)
        if not pc.any(missing).as_py():
            continue
        col = pc.if_else(missing, pa.scalar(None, pa.string()), col)
        if name == spec.id_column:  # ids stay as written (_csv_ids types them): "007" beside an NA is not 7
            table = table.set_column(i, pa.field(name, col.type), col)
            continue
        for numeric in (pa.int64(), pa.float64()):
            try:
                col = pc.cast(col, numeric)
                break
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        if col.null_count == len(col):
            col = col.cast(pa.float64())
        table = table.set_column(i, pa.field(name, col.type), col)
    return table


def _read_files(spec: InputSpec, files: list[Path], fmt: str, stop_after: int | None, pick=None) -> pa.Table:
    import datasets
    import pandas as pd
    from datasets.table import CastError

    what = f"{_source(spec)} ({_FORMAT_NAMES[fmt]})"
    files = [f for f in files if not _is_blank(f)]
    if not files:
        raise _no_rows(spec)
    kwargs = {}
    if fmt == "csv":
        for f in files:
            if (problem := _csv_first_row(f)) is not None:
                raise InputError(f"{what}: not readable: {problem}")
        kwargs["index_col"] = False  # never the first column as the index (see _csv_first_row)
        kwargs["keep_default_na"], kwargs["na_values"] = False, [""]  # _csv_nulls restores the rest per column
        if spec.id_column:
            kwargs["converters"] = {spec.id_column: str}  # as written: "007" is not 7 (_csv_ids)
    def load(data_files: list[Path], passed: tuple[type, ...] = ()) -> pa.Table | None:
        try:
            ds = datasets.load_dataset(fmt, data_files=[str(f) for f in data_files], split="train", streaming=True,
                                       **kwargs)
        except Exception as e:  # noqa: BLE001 - see _stream
            raise InputError(f"{what}: not readable: {first_line(e)}") from None
        return _stream(ds, what, stop_after, passed)

    with _quiet_libraries(), warnings.catch_warnings():
        # pandas dropping fields of a row (index_col=False) is an error, never lost data
        warnings.simplefilter("error", pd.errors.ParserWarning)
        if len(files) == 1:
            table = load(files)
        else:
            try:
                table = load(files, passed=(CastError,))
            except CastError:
                # datasets takes every file's columns from the first file's: read each on its own and join
                # them, a column missing from a file null in its rows (an override column, say)
                tables = [load([f]) for f in files]
                names = list(dict.fromkeys(n for t in tables if t is not None for n in t.column_names))
                keys = None if pick is None else pick(names)  # only the job's columns need to unify
                if keys is not None:
                    tables = [None if t is None else t.select([c for c in keys if c in t.column_names])
                              for t in tables]
                table = _concat_files(spec, files, tables)
    if table is None:
        raise _no_rows(spec)
    return _exact_json_columns(table, files, spec.id_column) if fmt == "json" else table


def _concat_files(spec: InputSpec, files: list[Path], tables: list[pa.Table | None]) -> pa.Table | None:
    """The tables of ``files`` read one by one, in order (None: no rows), columns unified by name.

    Raises:
        InputError: two files hold a column of types that do not unify, naming the first such file.
    """
    out = None
    for f, t in zip(files, tables):
        if t is None:
            continue
        try:
            out = t if out is None else pa.concat_tables([out, t], promote_options="permissive")
        except pa.ArrowException as e:
            raise InputError(f"{_source(spec)}: {f} does not fit the files before it: "
                             f"{first_line(e)}") from None
    return out


def local_dataset(d: DatasetSpec | None) -> Path | None:
    """The local directory ``input.dataset`` names (``datasets`` reads a directory of that name before a hub
    repo), or None: no dataset, or a hub dataset."""
    return Path(d.name) if d is not None and Path(d.name).is_dir() else None


# The options of a local dataset's builder config that say where its files are, not how they are read.
_WHERE_OPTIONS = {"name", "version", "data_dir", "data_files", "description"}


def dataset_files(d: DatasetSpec) -> tuple[list[Path], str | None]:
    """The data files of split ``d.split`` of local dataset directory ``d.name``, in the order ``datasets``
    reads them (``datasets.load_dataset_builder``: its README's configs, else the files of the most common
    suffix, split by name), and the format ``_read_files`` reads them as: "parquet", "json" or "csv", or None
    when ``datasets`` would read them otherwise (another builder such as ``text`` or ``arrow``, a builder option
    such as a README config's ``sep`` or ``features``, a suffix that names no format), so only ``datasets``
    reads them as it would.

    Raises:
        InputError: the config or split is not one the directory has; one line.
    """
    import datasets

    what = _dataset_name(d)
    with _quiet_libraries():
        try:
            builder = datasets.load_dataset_builder(d.name, d.config)
        except Exception as e:  # noqa: BLE001 - see _stream
            raise InputError(f"{what}: cannot be loaded: {first_line(e)}") from None
    config = builder.config
    split_files = dict(config.data_files or {})
    if d.split not in split_files:
        raise InputError(f"{what}: no such split (splits: {', '.join(map(str, split_files)) or 'none'})")
    files = [Path(f) for f in split_files[d.split]]
    default = type(config)()
    options = {f.name for f in dataclasses.fields(config) if f.name not in _WHERE_OPTIONS
               and getattr(config, f.name) != getattr(default, f.name)}
    same = builder.name in _FORMAT_NAMES and not options and builder.info.features is None and \
        all(FORMATS.get(f.suffix.lower()) == builder.name for f in files)
    return files, builder.name if same else None


def _read_hub(d: DatasetSpec, stop_after: int | None) -> pa.Table | None:
    """The rows of hub dataset ``d`` (streamed; at least ``stop_after``), None when it has none.

    Unless ``HF_HUB_OFFLINE`` is set or ``d.name`` is a local directory, one TCP connection to the hub
    must open first (``resolve.hub_unreachable``): huggingface_hub retries a failed connection 5 times
    over ~24 s before ``datasets`` gives up, and a streamed dataset cannot be read without the hub anyway.

    Raises:
        InputError: the hub cannot be reached, or the dataset cannot be loaded or read; one line.
    """
    import datasets
    import huggingface_hub

    what = _dataset_name(d)
    if not huggingface_hub.is_offline_mode() and not Path(d.name).is_dir():
        problem = hub_unreachable(huggingface_hub.constants.ENDPOINT)
        if problem is not None:
            raise InputError(f"{what}: cannot reach the Hugging Face hub ({problem}); offline, use input.path "
                             "with local files")
    with _quiet_libraries():
        try:
            ds = datasets.load_dataset(d.name, d.config, split=d.split, revision=d.revision, streaming=True)
        except ConnectionError as e:
            raise InputError(f"{what}: cannot reach the Hugging Face hub ({first_line(e)}); "
                             "offline, use input.path with local files") from None
        except Exception as e:  # noqa: BLE001 - see _stream
            raise InputError(f"{what}: cannot be loaded: {first_line(e)}") from None
        return _stream(ds, what, stop_after)


_CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")  # not -0 (0 again), 007 or +7


def _csv_ids(table: pa.Table, spec: InputSpec) -> pa.Table:
    """CSV: the id column, read as written (``converters``; null spellings null, ``_csv_nulls``), as int64 when
    every id is an integer written as Python writes it (``7``, ``-12``), else as strings, so an id such as ``007``
    or ``1e3`` keeps its text (pandas would read ``007`` as 7: two ids ``007`` and ``7`` the same, and the output's
    id not the input's). An empty or null id stays null ("null id in row(s) 2", as for Parquet)."""
    name = spec.id_column
    if not name or name not in table.column_names or not _is_string(table.schema.field(name).type):
        return table
    values = [v.strip() for v in table.column(name).drop_null().to_pylist()]
    if not all(_CANONICAL_INT.fullmatch(v) and -2**63 <= int(v) < 2**63 for v in values):
        return table
    i = table.column_names.index(name)
    col = pa.array([None if v is None else int(v) for v in table.column(name).to_pylist()], pa.int64())
    return table.set_column(i, pa.field(name, pa.int64()), col)


def _read(spec: InputSpec, pick, stop_after: int | None) -> pa.Table:
    """The input in input order: the columns ``pick(column names)`` returns (``{column: job key}``; None:
    all), at least ``stop_after`` rows (None: all).

    Raises:
        InputError: as ``read_table``; an input with no rows.
    """
    files, fmt = None, None
    if local_dataset(spec.dataset) is not None:  # read as input.path reads its files, when datasets would too
        files, fmt = dataset_files(spec.dataset)
    elif spec.dataset is None:
        files = input_files(spec.path)
        fmt = input_format(_source(spec), files)
    where = "input" if spec.dataset is None else f"dataset {spec.dataset.name!r}"
    if fmt is None:
        table = _read_hub(spec.dataset, stop_after)
        if table is None:
            raise _no_rows(spec)
    elif fmt == "parquet":
        return _read_parquet(spec, files, pick, stop_after)
    else:
        table = _read_files(spec, files, fmt, stop_after, pick)
        if fmt == "csv":
            table = _csv_ids(_csv_nulls(spec, table), spec)
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


# --- JSON values of mixed types -----------------------------------------------------------------------


def _is_json(t: pa.DataType) -> bool:
    return isinstance(t, pa.BaseExtensionType) and t.extension_name == "arrow.json"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _has_json(t: pa.DataType) -> bool:
    """``t`` is or holds ``extension<arrow.json>``: ``datasets``' JSON reader gives a column (or a field
    inside one) that type when its values mix types (``"Hi"`` and ``5``, a list and a string, a message
    whose ``content`` is 5), each value held as its JSON text."""
    if _is_json(t):
        return True
    if _is_list(t):
        return _has_json(t.value_type)
    if pa.types.is_struct(t):
        return any(_has_json(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _has_json(t.key_type) or _has_json(t.item_type)
    return False


def _raw_json_rows(files: list[Path], need: int) -> list | None:
    """The first ``need`` records of JSON files as Python's ``json`` reads them, in order: JSON Lines (blank lines
    skipped; read line by line, stopping once ``need`` are read) or one array of objects per file; None when a
    file is neither."""
    rows: list = []
    for f in files:
        if len(rows) >= need:
            break
        try:
            with open(f, encoding="utf-8") as fh:  # lines end at "\n" (and "\r"), not at U+2028 inside a string
                part = []
                for line in fh:
                    if line.strip():
                        part.append(json.loads(line))
                        if len(rows) + len(part) >= need:
                            break
            if len(part) == 1 and isinstance(part[0], list):
                part = part[0]
        except ValueError:  # not JSON Lines (a pretty-printed array): the whole file, one array
            try:
                part = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
        except OSError:
            return None
        if not isinstance(part, list) or not all(isinstance(r, dict) for r in part):
            return None
        rows += part
    return rows


def _exact_json_columns(table: pa.Table, files: list[Path], id_column: str | None) -> pa.Table:
    """``table`` (``datasets``' JSON reader's) with each mixed-type column (``_has_json``) re-read from the files.

    ``datasets`` holds such a column's values as JSON text, but writes a string that is itself JSON text
    unquoted: the string ``"5"`` becomes ``5``, ``"true"`` ``true``, ``"null"`` ``null``, the same text as the
    number, boolean or null (datasets 5.2). So those columns are taken from the files' records as Python's
    ``json`` reads them, each cell's value ``json.dumps``-ed (a top-level ``extension<arrow.json>`` column,
    which ``_json_columns`` decodes). Kept as read when the records do not line up with the table's rows (a
    file ``json`` reads otherwise than ``datasets``: other row counts or ids)."""
    names = [n for n, t in zip(table.column_names, table.schema.types) if _has_json(t)]
    if not names:
        return table
    rows = _raw_json_rows(files, table.num_rows)
    if rows is None or len(rows) < table.num_rows:
        return table
    rows = rows[:table.num_rows]  # read with stop_after: the first rows
    if id_column in table.column_names and not _is_json(table.schema.field(id_column).type) and \
            table.column(id_column).to_pylist() != [r.get(id_column) for r in rows]:
        return table
    for name in names:
        texts = pa.array([None if r.get(name) is None else json.dumps(r[name], ensure_ascii=False) for r in rows],
                         pa.string())
        i = table.column_names.index(name)
        table = table.set_column(i, pa.field(name, pa.json_()), pa.ExtensionArray.from_storage(pa.json_(), texts))
    return table


def _decode(value, t: pa.DataType):
    """A ``to_pylist`` value of type ``t``, its JSON texts decoded."""
    if value is None:
        return None
    if _is_json(t):
        return json.loads(value)
    if _is_list(t):
        return [_decode(v, t.value_type) for v in value]
    if pa.types.is_struct(t):
        return {k: _decode(v, t.field(k).type) for k, v in value.items()}
    if pa.types.is_map(t):
        return [(_decode(k, t.key_type), _decode(v, t.item_type)) for k, v in value]
    return value


def _json_columns(table: pa.Table) -> dict[str, list]:
    """The values (Python, JSON decoded) of each column of ``table`` that holds JSON of mixed types."""
    return {name: [_decode(v, t) for v in table.column(name).to_pylist()]
            for name, t in zip(table.column_names, table.schema.types) if _has_json(t)}


_KINDS = ((bool, "a boolean", "booleans"), (int, "an integer", "integers"), (float, "a number", "numbers"),
          (str, "a string", "strings"), (list, "a list", "lists"), (dict, "an object", "objects"))


def _kind(value, plural: bool = False) -> str:
    for t, one, many in _KINDS:
        if isinstance(value, t):
            return many if plural else one
    return type(value).__name__


def _kinds(values: list) -> str:
    """"integers and strings": the kinds of the non-null ``values``."""
    kinds = list(dict.fromkeys(_kind(v, plural=True) for v in values if v is not None))
    return " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)


def describe_value(value) -> str:
    """``a string ("notalist")``: a cell value's kind and its JSON text (its repr where it is not JSON), cut
    to 40 characters; for messages naming a cell of the wrong type."""
    try:
        shown = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(value)
    return f"{_kind(value)} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def _cell_errors(values: list, name: str, key: str, kind: str, ok) -> list[str | None]:
    """Per row, None or why its cell of the mixed-type JSON column ``name`` is not ``kind`` (the row then
    fails with it).

    Raises:
        InputError: no cell is ``kind``: the column is of another type, not a row.
    """
    present = [v for v in values if v is not None]
    if present and not any(ok(v) for v in present):
        raise InputError(f"{key}: column {name!r} holds {_kinds(present)}, expected {kind}")
    return [None if v is None or ok(v) else f"{key}: column {name!r} holds {describe_value(v)}, expected {kind}"
            for v in values]


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
    except (pa.ArrowException, TypeError, ValueError, OverflowError):  # OverflowError: an int past int64
        ok = False
    if not ok:
        shown = repr(values[0]) if f.one_of is None else repr(values)
        raise InputError(f"{key}: {shown} does not match the type of column {f.column!r} ({t})")
    return pc.fill_null(pc.is_in(col, value_set=value_set), False)


def _filter_mask_values(values: list, f: FilterSpec) -> pa.Array:
    """``_filter_mask`` for a column of mixed-type JSON ``values``: a value matches one of the same kind."""
    targets = [f.equals] if f.one_of is None else f.one_of

    def same(v, x) -> bool:
        return (v is not None and isinstance(v, bool) == isinstance(x, bool)
                and isinstance(v, str) == isinstance(x, str) and v == x)

    return pa.array([any(same(v, x) for x in targets) for v in values], pa.bool_())


def _shuffle_key(seed: int, row_id) -> bytes:
    """blake2b of (seed, id) as text: the same order in every process, platform and library version."""
    return hashlib.blake2b(f"{seed}\x1f{type(row_id).__name__}:{row_id}".encode(), digest_size=8).digest()


def _ids(table: pa.Table, spec: InputSpec, decoded: dict[str, list] | None = None) -> tuple[list, pa.DataType]:
    if not spec.id_column:
        return list(range(table.num_rows)), pa.int64()
    if decoded and spec.id_column in decoded:  # JSON ids of mixed kinds: one kind is fine, two are not
        ids = decoded[spec.id_column]
        present = [v for v in ids if v is not None]
        if all(isinstance(v, str) for v in present):
            return ids, pa.string()
        if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            return ids, pa.int64()
        raise InputError(f"input.id_column: column {spec.id_column!r} holds {_kinds(present)}, expected integer "
                         "or string (the same in every row)")
    _check_column(table, spec.id_column, "input.id_column", "integer or string",
                  lambda t: pa.types.is_integer(t) or _is_string(t))
    id_type = pa.int64() if pa.types.is_integer(table.schema.field(spec.id_column).type) else pa.string()
    return table.column(spec.id_column).to_pylist(), id_type


def select_indices(table: pa.Table, spec: InputSpec, ids: list, limit: int | None,
                   decoded: dict[str, list] | None = None) -> list[int]:
    """Positions of the rows the job uses, in the order it uses them: rows matching every filter, then
    ordered by ``_shuffle_key(shuffle_seed, id)`` if a seed is set, then the first ``limit``.

    Args:
        decoded: the values of the mixed-type JSON columns (``_json_columns``).
    """
    mask = None
    for f in _filters(spec):
        m = _filter_mask_values(decoded[f.column], f) if decoded and f.column in decoded else _filter_mask(table, f)
        mask = m if mask is None else pc.and_(mask, m)
    picked = list(range(table.num_rows)) if mask is None else pc.indices_nonzero(mask).to_pylist()
    if spec.shuffle_seed is not None:
        picked.sort(key=lambda i: (_shuffle_key(spec.shuffle_seed, ids[i]), i))
    return picked[:limit] if limit is not None else picked


def _check_ids(spec: InputSpec, ids: list) -> None:
    nulls = [i for i, v in ids if v is None]
    if nulls:
        raise InputError(f"input.id_column {spec.id_column!r}: null id in row(s) {', '.join(map(str, nulls[:10]))}")
    wide = [(i, v) for i, v in ids if isinstance(v, int) and not -2**63 <= v < 2**63]
    if wide:
        i, v = wide[0]
        raise InputError(f"input.id_column {spec.id_column!r}: id {v} in row {i} does not fit a 64-bit signed "
                         f"integer (the output's id column is int64); use string ids")
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
        limit: use only the first ``limit`` selected rows (``pipeline run --limit``): a cap within the job's
            selection, so with ``spec.limit`` set the smaller of the two counts.

    Returns:
        (rows, id_type): rows in the order they are generated; id_type is ``pa.int64()`` or
        ``pa.string()``, the type of the output ``id`` column.

    Raises:
        InputError: missing files or columns, no rows, a filter that matches no row, wrong column types
            (a mixed-type JSON column fails the rows whose cell is of the wrong type, and stops the job only
            when no cell is of the right type), a filter value of another type than its column, null or
            duplicate ids among the selected rows, a hub dataset that cannot be loaded,
            an ``input.template`` that raises on every selected row that uses it (one that raises on some
            rows fails those rows).
    """
    limit = min((n for n in (limit, spec.limit) if n is not None), default=None)
    whole = spec.filter is not None or spec.shuffle_seed is not None  # selecting needs every row
    table = read_table(spec, stop_after=None if whole else limit)
    # JSON columns whose values mix types (datasets gives them extension<arrow.json>) are checked per cell:
    # a cell of the wrong type fails its row; a column with no cell of the right type stops the job
    decoded = _json_columns(table)

    def check(name: str, key: str, kind: str, ok) -> None:
        if name not in decoded:
            _check_column(table, name, key, kind, ok)

    cell_errors = {}  # column -> per row (whole table) None or why the cell fails its row
    if spec.template is None and spec.prompt_column:
        check(spec.prompt_column, "input.prompt_column", "string", _is_string)
        if spec.prompt_column in decoded:
            cell_errors[spec.prompt_column] = _cell_errors(decoded[spec.prompt_column], spec.prompt_column,
                                                           "input.prompt_column", "a string",
                                                           lambda v: isinstance(v, str))
    if spec.messages_column:
        check(spec.messages_column, "input.messages_column", "list<struct<role: string, content: string>>",
              _is_messages)
        if spec.messages_column in decoded:  # a message's own problems fail its row in prompts.build_prompt
            cell_errors[spec.messages_column] = _cell_errors(decoded[spec.messages_column], spec.messages_column,
                                                             "input.messages_column", "a list of messages",
                                                             lambda v: isinstance(v, list))
    # mixed JSON values of these are checked per row when the row is planned (run.plan)
    if spec.choices_column:
        check(spec.choices_column, "input.choices_column", "list<string>", _is_list_of(_is_string))
    if spec.continuation_column:
        check(spec.continuation_column, "input.continuation_column", "string", _is_string)
    if spec.structured_column:
        check(spec.structured_column, "input.structured_column", "string", _is_string)
    for name in override_columns(spec, table.column_names):
        kind, ok = _OVERRIDE_TYPES.get(name, ("number", _is_number))
        check(name, f"per-row override of generation.{name}", kind, ok)
    all_ids, id_type = _ids(table, spec, decoded)
    picked = select_indices(table, spec, all_ids, limit, decoded)
    if not picked:
        raise InputError(f"input.filter: no row matches (of {table.num_rows} rows)")
    if spec.id_column:
        _check_ids(spec, [(i, all_ids[i]) for i in picked])
    sel = table.take(pa.array(picked, pa.int64()))
    n = sel.num_rows

    def cells(name: str) -> list:
        return [decoded[name][i] for i in picked] if name in decoded else sel.column(name).to_pylist()

    def picked_errors(name: str | None) -> list[str | None]:
        return [cell_errors[name][i] for i in picked] if name in cell_errors else [None] * n

    overrides = {name: cells(name) for name in override_columns(spec, sel.column_names)}
    errors = [None] * n
    message_errors = picked_errors(spec.messages_column)
    messages = cells(spec.messages_column) if spec.messages_column else [None] * n
    messages = [None if e else m for m, e in zip(messages, message_errors)]
    uses_prompt = [m is None and e is None for m, e in zip(messages, message_errors)]
    if spec.template is not None:
        columns = {c: cells(c) if c in decoded else _template_values(sel.column(c))
                   for c in template_columns(spec.template, sel.column_names)}
        prompts, errors = _render_all(spec.template, columns, n)
        # a row with messages never uses its template prompt, so a failed render does not fail it
        errors = [e if u else None for u, e in zip(uses_prompt, errors)]
        _check_template_ran(errors, [all_ids[i] for i in picked], uses_prompt)
    elif spec.prompt_column:
        prompt_errors = picked_errors(spec.prompt_column)
        prompts = [None if e else p for p, e in zip(cells(spec.prompt_column), prompt_errors)]
        errors = [e if u else None for u, e in zip(uses_prompt, prompt_errors)]
    else:
        prompts = [None] * n
    prompts = [None if e else p for p, e in zip(prompts, message_errors)]
    errors = [m or e for m, e in zip(message_errors, errors)]
    scored = spec.choices_column or spec.continuation_column
    choices = cells(scored) if scored else [None] * n
    structured = cells(spec.structured_column) if spec.structured_column else [None] * n
    rows = [InputRow(index=i, id=all_ids[i], prompt=prompts[k], messages=messages[k],
                     overrides={c: v[k] for c, v in overrides.items() if v[k] is not None}, error=errors[k],
                     choices=choices[k], structured=structured[k])
            for k, i in enumerate(picked)]
    return rows, id_type
