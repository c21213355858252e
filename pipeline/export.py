"""``pipeline export OUT_DIR --to PATH``: the committed results merged into one Parquet file, one JSON Lines
file or a Hugging Face ``datasets`` directory, in input order, optionally with the input's columns or the
fields of JSON completions as columns (``--json-fields``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .inputs import InputError, read_input
from .jobspec import JobSpec, JobSpecError, job_from_dict
from .shards import read_consistent, read_shard_verified

FORMATS = ("parquet", "jsonl", "hf-dir")
_JSON_DECIMALS = 15  # pandas' most; floats in JSON Lines keep 15 decimal places


class ExportError(RuntimeError):
    """The export cannot be made as asked: an unknown format, a destination that exists, lies inside OUT_DIR or
    holds it, or cannot be written (its parent is a file, a read-only or special file system: ``--to`` and the
    OS's reason), ``--pivot`` of an output that is not ``task: score``'s, ``--json-fields`` of one that is,
    nothing committed. A bad command line: the CLI exits with ``exit_code``, 2, except where the destination has no
    space left (1, as for ``pipeline run``).
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def within(path: Path, top: Path) -> bool:
    """``path`` is directory ``top`` or below it (both resolved)."""
    return path.resolve() == top.resolve() or top.resolve() in path.resolve().parents


def file_in_the_way(path: Path) -> Path | None:
    """The nearest existing parent of ``path`` that is not a directory (a file where a directory must be),
    or None."""
    return next((a for a in path.parents if a.exists() and not a.is_dir()), None)


def replace_beside(dest: Path, write) -> None:
    """``write(tmp)`` to a temporary name in ``dest``'s directory (a file, or a directory), then rename it to
    ``dest`` (a directory at ``dest`` is replaced only once the new one is complete), so a failed write leaves
    ``dest`` as it was and no temporary file behind.

    Raises:
        OSError: the write or the rename failed.
    """
    tmp = dest.parent / f".{dest.name[:100]}.{os.getpid()}.tmp"
    try:
        write(tmp)
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        try:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass  # it could not be made either (a parent that is a file, a read-only file system)


def destination_error(option: str, path: str | Path, e: OSError, cls: type = ExportError) -> Exception:
    """``e``, raised while writing the destination ``path`` given as ``option`` (``--to``, ``--out``), as a
    ``cls`` (``ExportError``, or ``report.ReportError``) of one line naming the option, the path and the OS's
    reason: "--to a/x.parquet: cannot write it: a is a file, not a directory" or "...: Read-only file system".
    No space left (ENOSPC, EDQUOT) gets ``exit_code`` 1, any other reason 2."""
    path = Path(path)
    if e.errno:
        reason = os.strerror(e.errno)  # pyarrow's OSError has no strerror and a long text; the errno says it
    else:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
    if isinstance(e, (FileExistsError, NotADirectoryError)) or e.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = file_in_the_way(path)
        if blocker is not None:
            reason = f"{blocker} is a file, not a directory"
    space = e.errno in (errno.ENOSPC, errno.EDQUOT)
    return cls(f"{option} {path}: cannot write it: {reason}", exit_code=1 if space else 2)


@dataclass
class ExportSummary:
    """What ``export_results`` wrote.

    Attributes:
        path: the file or directory written.
        format: "parquet", "jsonl" or "hf-dir".
        rows: rows written.
        columns: columns written.
        order: "input" (input order, then sample_index) or "id" (the input could not be read).
    """

    path: Path
    format: str
    rows: int
    columns: int
    order: str

    def line(self) -> str:
        by = "input order" if self.order == "input" else "id (input not readable)"
        return f"wrote {self.rows} rows x {self.columns} columns to {self.path} ({self.format}, sorted by {by})"


def read_committed(out_dir: str | Path, warn: Callable[[str], None] | None = None) -> tuple[dict, pa.Table | None]:
    """The manifest of ``out_dir`` and its committed rows in commit order (the manifest's ``shards``
    list; other files in the directory are never read), or None when nothing is committed. Each shard is
    read once and parsed from the bytes whose size and sha256 were checked (``read_shard_verified``);
    ``warn`` gets a note when entries record no sha256 (an older manifest's: not verified).

    Raises:
        OutputError: no manifest, an unreadable one, or a committed shard that is missing, damaged (size or
            sha256 differ from the manifest's) or unreadable; the line names it and the way out.
    """
    out_dir = Path(out_dir)
    # one manifest's shards, though a run may commit (and --retry-failed delete rewritten shards) meanwhile
    manifest, tables = read_consistent(out_dir, lambda m: [read_shard_verified(out_dir, s) for s in m["shards"]])
    unhashed = [s["file"] for s in manifest["shards"] if "sha256" not in s]
    if unhashed and warn is not None:
        warn(f"note: {len(unhashed)} committed shard(s) record no sha256 (an older manifest), so their bytes "
             f"were not verified ({', '.join(unhashed[:3])}{' ...' if len(unhashed) > 3 else ''})")
    if not tables:
        return manifest, None
    return manifest, pa.concat_tables(tables, promote_options="permissive")


def manifest_job(manifest: dict) -> JobSpec | None:
    """The job recorded in a manifest (``info.job``), or None if it has none or it no longer validates."""
    try:
        return job_from_dict(manifest["info"]["job"])
    except (KeyError, TypeError, JobSpecError):
        return None


def export_format(to: str) -> str:
    """"parquet" (``.parquet``), "jsonl" (``.jsonl``) or "hf-dir" (no suffix, a trailing ``/``, or an
    existing directory of another suffix). A ``.parquet`` or ``.jsonl`` name without a trailing ``/`` names a
    file even where a directory of that name exists (``_check_destination`` refuses it).

    A last name that is only a suffix (``.parquet``, ``out/.jsonl``, ``.csv``: a dot, then no other dot) names
    no file: it is refused, not written as a hidden directory of that name (a hidden dataset directory is
    written with a trailing ``/``, ``--to .data/``).

    Raises:
        ExportError: an empty ``to``, any other suffix, or a name that is only a suffix; a name the OS refuses to
            look up (too long: "--to NAME: cannot write it: File name too long").
    """
    if not to.strip():  # Path("") is the current directory
        raise ExportError(f"--to must name a file or directory, got {to!r}")
    p = Path(to)
    if to.endswith(("/", os.sep)):
        return "hf-dir"
    if p.suffix in (".parquet", ".jsonl"):
        return p.suffix[1:]
    try:
        if p.is_dir():
            return "hf-dir"
    except OSError as e:
        raise destination_error("--to", to, e) from None
    if p.name.startswith(".") and "." not in p.name[1:]:
        example = f"results{p.name}" if p.name in (".parquet", ".jsonl") else "results.parquet"
        raise ExportError(f"--to {to}: {p.name!r} is only a suffix, not a file name; name the file (e.g. "
                          f"{example}), or end a directory's name with / (--to {to}/)")
    if not p.suffix:
        return "hf-dir"
    raise ExportError(f"--to {to}: unknown format {p.suffix!r}; use a .parquet or .jsonl file, or a directory "
                      "(no suffix) for a datasets save_to_disk directory")


def _input_positions(table: pa.Table, job: JobSpec | None) -> list[int | None]:
    """Each result row's position in the whole input (None where its id is no longer there).

    Raises:
        InputError: the manifest records no valid job, or its input cannot be read.
    """
    if job is None:
        raise InputError("the manifest records no valid job, so its input is unknown")
    ids = table.column("id").to_pylist()
    if not job.input.id_column:
        return ids  # the id is the row's position in the input
    inp = read_input(job.input, [job.input.id_column])
    where = {v: i for i, v in enumerate(inp.column(job.input.id_column).to_pylist())}
    return [where.get(i) for i in ids]


def _free_name(name: str, taken: set[str], prefix: str) -> str:
    """``name``, or with ``prefix`` put before it as often as needed to be none of ``taken`` (then added)."""
    while name in taken:
        name = prefix + name
    taken.add(name)
    return name


def _with_input(table: pa.Table, positions: list[int | None], job: JobSpec) -> pa.Table:
    """``table`` plus the input's columns of each row's input row (nulls for rows no longer in the
    input); the id column is left out (it is ``id``), and a name the table uses gets an ``input_`` prefix
    (as many as it takes to be unique)."""
    inp = read_input(job.input)
    inp = inp.drop_columns([c for c in (job.input.id_column,) if c in inp.column_names])
    taken = inp.take(pa.array([p if p is not None and p < inp.num_rows else None for p in positions], pa.int64()))
    names = set(table.column_names)
    for name, column in zip(taken.column_names, taken.columns):
        table = table.append_column(_free_name(name, names, "input_"), column)
    return table


def _write(table: pa.Table, fmt: str, path: Path) -> None:
    import datasets

    if fmt == "parquet":
        pq.write_table(table, path)
        return
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the CLI prints its own line
    try:
        ds = datasets.Dataset(table)
        if fmt == "jsonl":
            ds.to_json(str(path), lines=True, force_ascii=False, double_precision=_JSON_DECIMALS)
        else:
            ds.save_to_disk(str(path))
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def _check_destination(out_dir: Path, to: Path, fmt: str, overwrite: bool) -> None:
    try:
        if within(to, out_dir):
            raise ExportError(f"--to {to}: inside the output dir {out_dir} (its readers would see the export as "
                              "results); write it elsewhere")
        if to.resolve() in out_dir.resolve().parents:
            raise ExportError(f"--to {to}: holds the output dir {out_dir} (replacing it would delete the results); "
                              "write it elsewhere")
        blocker = file_in_the_way(to)
        if blocker is not None:
            raise ExportError(f"--to {to}: cannot write it: {blocker} is a file, not a directory")
        if fmt != "hf-dir" and to.is_dir():
            raise ExportError(f"--to {to}: a directory, not a {fmt} file; not replacing it (--to {to}/ writes a "
                              "datasets directory)")
        if not (to.exists() or to.is_symlink()):
            return
        if not overwrite:
            raise ExportError(f"--to {to}: exists; pass --overwrite to replace it")
        if to.is_dir() and not (fmt == "hf-dir" and (_is_saved_dataset(to) or not any(to.iterdir()))):
            raise ExportError(f"--to {to}: a directory that is not a saved dataset; not replacing it")
        if fmt == "hf-dir" and not to.is_dir():
            raise ExportError(f"--to {to}: a file, not a directory; not replacing it with a dataset directory")
    except OSError as e:
        raise destination_error("--to", to, e) from None


def pivot_choices(table: pa.Table) -> pa.Table:
    """The rows of a ``task: score`` output (one per (id, choice_index), sorted by id then choice_index) as
    one row per id: ``id``, ``prompt``, ``choices`` (list<string>), ``logprob_sum`` (list<float64>),
    ``num_tokens`` (list<int32>), ``is_greedy`` (list<bool>), each in choice order; ``pred`` (int32: the argmax
    of ``logprob_sum``), ``pred_norm`` (int32: the argmax of ``logprob_sum / num_tokens``; lm-evaluation-
    harness's ``acc_norm`` divides by the choice's length in characters instead), the first of a tie;
    ``error`` (string): the first failed choice's error, or which ``choice_index`` values are missing
    when a row's committed choices are not 0..C-1; then ``pred`` and ``pred_norm`` are null. (A row whose
    last choices are missing cannot be told from a shorter row here; runs commit a row's choices together.)

    Raises:
        ExportError: ``table`` is not a ``task: score`` output (no ``choice_index`` column).
    """
    if "choice_index" not in table.column_names:
        raise ExportError("--pivot: the output holds no scored choices (task: score); nothing to pivot")
    cols = {c: table.column(c).to_pylist() for c in
            ("id", "choice_index", "prompt", "choice", "logprob_sum", "num_tokens", "is_greedy", "error")}
    out = {k: [] for k in ("id", "prompt", "choices", "logprob_sum", "num_tokens", "is_greedy", "pred", "pred_norm",
                           "error")}
    i, n = 0, table.num_rows
    while i < n:
        j = i
        while j < n and cols["id"][j] == cols["id"][i]:
            j += 1
        rows = range(i, j)
        error = next((cols["error"][r] for r in rows if cols["error"][r] is not None), None)
        # a row committed in part (before runs committed a row's choices together): no argmax of some of them
        indices = {cols["choice_index"][r] for r in rows}
        missing = sorted(set(range(max(indices) + 1)) - indices)
        if error is None and missing:
            error = f"choice_index {', '.join(map(str, missing))} not committed (resume the run)"
        lps, ntok = [cols["logprob_sum"][r] for r in rows], [cols["num_tokens"][r] for r in rows]
        out["id"].append(cols["id"][i])
        out["prompt"].append(cols["prompt"][i])
        out["choices"].append([cols["choice"][r] for r in rows])
        out["logprob_sum"].append(lps)
        out["num_tokens"].append(ntok)
        out["is_greedy"].append([cols["is_greedy"][r] for r in rows])
        out["error"].append(error)
        if error is None:
            norm = [lp / k for lp, k in zip(lps, ntok)]
            out["pred"].append(max(range(len(lps)), key=lambda k: (lps[k], -k)))
            out["pred_norm"].append(max(range(len(norm)), key=lambda k: (norm[k], -k)))
        else:
            out["pred"].append(None)
            out["pred_norm"].append(None)
        i = j
    types = {"id": table.schema.field("id").type, "prompt": pa.string(), "choices": pa.list_(pa.string()),
             "logprob_sum": pa.list_(pa.float64()), "num_tokens": pa.list_(pa.int32()),
             "is_greedy": pa.list_(pa.bool_()), "pred": pa.int32(), "pred_norm": pa.int32(), "error": pa.string()}
    return pa.table({k: pa.array(v, types[k]) for k, v in out.items()})


def json_columns(table: pa.Table, schema: dict | None = None) -> pa.Table:
    """``table`` plus one column per top-level field of each row's JSON ``completion``, and ``json_error``.

    The fields are every key met, in first-seen order (llguidance writes an object's properties in its
    schema's order), then the ``properties`` of ``schema`` (the job's ``generation.structured.json``) that no
    completion holds, so a schema's optional fields always get a column. A field whose values are all strings,
    all booleans, or all numbers keeps that type (pyarrow's: string, bool, int64 or double; integers and floats
    mixed: double); an object or an array, a mix of types, or numbers no such type holds exactly (an integer
    beyond int64, or beside floats one that double cannot hold, beyond 2**53: 9007199254740993), is written as
    its JSON text (string), so the table stays flat and every value exact. A field whose
    name the results or ``json_error`` use gets a ``json_`` prefix, as many as it takes to be unique (a field
    ``error``: ``json_json_error``).

    A row whose completion does not parse as a JSON object (a failed row, one cut by ``max_tokens``, a
    value that is not an object, ``NaN`` or ``Infinity`` (not JSON, though Python's parser takes them), a number
    beyond float64) is kept: its fields are null and ``json_error`` (string) says why; null
    where the completion parsed.

    Raises:
        ExportError: ``table`` has no ``completion`` column (a ``task: score`` output).
    """
    if "completion" not in table.column_names:
        raise ExportError("--json-fields: the output holds no completions (task: score); nothing to parse")
    parsed, errors = [], []
    for text in table.column("completion").to_pylist():
        if text is None:
            value, error = None, "no completion"
        else:
            try:
                value, error = json.loads(text, parse_constant=_not_json, parse_float=_finite_float), None
            except ValueError as e:
                value, error = None, f"not JSON: {e}"
        if error is None and not isinstance(value, dict):  # null parses too, as None
            value, error = None, f"not a JSON object: {'null' if value is None else type(value).__name__}"
        parsed.append(value)
        errors.append(error)
    names = list(dict.fromkeys([*(k for v in parsed if v is not None for k in v),
                                *((schema or {}).get("properties") or {})]))
    taken = {*table.column_names, "json_error"}
    for name in names:
        values = [None if v is None else v.get(name) for v in parsed]
        table = table.append_column(_free_name(name, taken, "json_"), _flat_column(values))
    return table.append_column("json_error", pa.array(errors, pa.string()))


def _not_json(name: str):
    """``json.loads``' ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity``, which Python's parser takes
    but JSON (RFC 8259) has not, are an error (the record would not parse elsewhere)."""
    raise ValueError(f"{name} is not a JSON value (RFC 8259 has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    """``json.loads``' ``parse_float``: a number beyond float64 (``1e400``, which Python reads as inf) is an error,
    not an infinity that no JSON writer can give back."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text} is beyond float64")
    return value


def _flat_column(values: list) -> pa.Array:
    kinds = {bool if isinstance(v, bool) else (int, float) if isinstance(v, (int, float)) else type(v)
             for v in values if v is not None}
    if len(kinds) == 1 and kinds <= {str, bool, (int, float)}:
        if kinds == {(int, float)} and any(isinstance(v, float) for v in values):
            if all(v is None or isinstance(v, float) or _exact_float(v) for v in values):
                return pa.array([None if v is None else float(v) for v in values], pa.float64())
        else:
            try:
                return pa.array(values)
            except (pa.ArrowInvalid, OverflowError):  # an integer beyond int64
                pass
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())


def _exact_float(n: int) -> bool:
    """Whether the integer ``n`` is exactly a float64 (Python compares int and float exactly)."""
    try:
        return float(n) == n
    except OverflowError:  # beyond float64's range
        return False


def export_results(out_dir: str | Path, to: str, *, join_input: bool = False, overwrite: bool = False,
                   warn: Callable[[str], None] = print, pivot: bool = False,
                   json_fields: bool = False) -> ExportSummary:
    """Merge the committed shards of ``out_dir`` into one file or directory.

    Rows are sorted by their input row's position in the job's input (joined by id; sample_index
    second); rows whose id is no longer in the input come last, by id. Columns and types are the
    shards' (see README "Output"); ``join_input`` appends the input's columns. The destination is
    written beside itself and renamed into place, so a failed export leaves no partial file.

    Args:
        out_dir: a pipeline output directory.
        to: ``*.parquet`` (pyarrow), ``*.jsonl`` (``datasets``' ``to_json``: one object per line, floats
            with 15 decimal places) or a directory (``datasets``' ``save_to_disk``; ``load_from_disk``
            reads it): no suffix or a trailing ``/`` (``export_format``).
        join_input: add the input's columns (the id column aside; names the results use get an
            ``input_`` prefix), nulls for rows no longer in the input.
        overwrite: replace an existing destination (a directory only if it is a saved dataset or empty).
        pivot: a ``task: score`` output as one row per id with ``pred`` and ``pred_norm`` (``pivot_choices``).
        json_fields: parse each JSON completion into columns (``json_columns``; the fields of the job's
            ``generation.structured.json`` schema when it has one), with a ``json_error`` column.
        warn: where a note goes when the input cannot be read (the rows are then sorted by id), or when
            shards record no sha256 to verify (an older manifest).

    Raises:
        OutputError: ``out_dir`` has no manifest, or a committed shard is missing or damaged (its bytes do
            not match the manifest's size or sha256): nothing is written.
        ExportError: nothing committed, unknown format, destination exists, lies inside ``out_dir`` or holds it, or
            cannot be written (a parent that is a file, a read-only or special file system, no space left;
            nothing is left at the destination); ``pivot`` of an output that is not ``task: score``'s;
            ``json_fields`` with ``pivot``, or of a ``task: score`` output.
        InputError: ``join_input`` and the input cannot be read.
    """
    out_dir, dest = Path(out_dir), Path(to)
    if pivot and json_fields:
        raise ExportError("--json-fields parses completions; --pivot is for task: score outputs (no completions)")
    fmt = export_format(to)
    _check_destination(out_dir, dest, fmt, overwrite)
    manifest, table = read_committed(out_dir, warn)
    if table is None:
        raise ExportError(f"{out_dir}: no committed rows to export")
    job = manifest_job(manifest)
    try:
        positions, by_input = _input_positions(table, job), True
    except InputError as e:
        if join_input:
            raise InputError(f"--join-input: {e}") from None
        warn(f"note: rows sorted by id and sample_index, not input order: {e}")
        positions, by_input = [None] * table.num_rows, False
    last = 2**62  # rows no longer in the input sort after every input position
    key = "choice_index" if "choice_index" in table.column_names else "sample_index"
    keyed = table.select(["id", key]).append_column(
        "_position", pa.array([last if p is None else p for p in positions], pa.int64()))
    idx = pc.sort_indices(keyed, sort_keys=[("_position", "ascending"), ("id", "ascending"),
                                            (key, "ascending")])
    table = table.take(idx)
    positions = [positions[i] for i in idx.to_pylist()]
    if pivot:
        ids = table.column("id").to_pylist()
        table = pivot_choices(table)
        positions = [p for k, p in enumerate(positions) if k == 0 or ids[k] != ids[k - 1]]
    if json_fields:
        structured = job.generation.structured if job is not None else None
        table = json_columns(table, structured.json if structured is not None else None)
    if join_input:
        table = _with_input(table, positions, job)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        replace_beside(dest, lambda tmp: _write(table, fmt, tmp))
    except OSError as e:
        raise destination_error("--to", dest, e) from None
    return ExportSummary(path=dest, format=fmt, rows=table.num_rows, columns=table.num_columns,
                         order="input" if by_input else "id")
