"""Committed output: Parquet shards plus a JSON manifest, each replaced atomically.

A row is committed once its shard is durable and listed in the manifest: the shard is written to a
temporary file, fsynced and renamed (``write_shard``); then the manifest is rewritten the same way
(``ShardStore.commit_entries``). Producing shards and committing them are separate steps so that
several workers can write shards while one process, the only manifest writer, commits them. Files
in the output directory that the manifest does not list are never read as results: leftover
temporary files and shards of an interrupted run are removed when the store is opened, and reported.

Work units (``executor: ray``) write shards named ``unit-NNNNN.parquet``; the manifest's ``plan``
records each uncommitted unit's row count and a digest of its keys (``plan_units``). A unit shard
that is on disk but not committed (the driver died between the worker's rename and its commit) is
verified against the plan when the store is opened and committed (*adopted*) if it matches; otherwise
it is removed like any other uncommitted shard.

Which settings made each committed row: every run record (manifest ``runs``) holds the fingerprint it ran
with, and every shard entry names the run that wrote it (``run``: 1-based index into ``runs``; a shard
rewritten by ``--retry-failed`` keeps its rows' run, and names the run that wrote its file under ``rewritten``). The manifest's own ``fingerprint`` is the one a
resume is compared with: the settings of the last rows committed. A ``--force`` run with other settings
switches it (recorded under ``forced``) when it commits its first shard, not before, so a forced run
that generates nothing leaves the record as it was. Manifests written before these fields existed have
neither; ``pipeline.status`` attributes their rows as well as it can (``run_fingerprints``).

Integrity of committed shards (``check_shards``): opening the store checks every committed shard's presence,
size and Parquet footer (cheap: the footer only) and the sha256 of the shard files that the newest run that
committed any wrote (a torn write); ``pipeline status --verify`` checks every sha256, ``pipeline export`` hashes
the bytes it parses (``read_shard_verified``). Each damaged shard is one line (``shard_error``) naming the file and the way
out: ``redo_corrupt`` drops the damaged shards from the manifest in one atomic write, recording each entry with
its problem under ``dropped``, so their rows are pending again and every other committed row is kept. Entries
without ``sha256`` (older manifests) are checked for what they record.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import first_line

MANIFEST = "manifest.json"
_UMASK = os.umask(0)
os.umask(_UMASK)
FORMAT_VERSION = 2
_SHARD_NAME = re.compile(r"part-(\d{5,})\.parquet")
_UNIT_NAME = re.compile(r"unit-\d{5,}\.parquet")
_MAGIC = b"PAR1"  # a Parquet file starts and ends with it (the footer's length comes just before the end)
REDO = "pipeline run JOB --redo-corrupt"
MISSING = "is missing"

log = logging.getLogger(__name__)


class OutputError(RuntimeError):
    """The output directory cannot be used (foreign contents, different job, unreadable manifest)."""


class OutputWriteError(RuntimeError):
    """A write into the output directory failed for a reason of the file system, not of the job: it became
    read-only, lost its permissions, was removed, or gave an I/O error (the CLI exits 1). The file being written
    was not replaced and its temporary file is gone (where the file system still allows removing it); the
    committed shards stay valid: make the output dir writable and run again to resume.

    Attributes:
        out_dir: the output directory.
        file: the file being written (``part-00003.parquet``, ``manifest.json``, ...).
        reason: the ``OSError``'s ``strerror``, lower-cased: ``read-only file system``, ``no such file or
            directory``, ``input/output error``, ...
        committed: rows committed in ``out_dir`` when the run stopped (``run.control.run_job`` sets it), else None.
        note: a further line, e.g. that the run record could not be saved either; else None.
        summary: the ``run.control.RunSummary`` of the run it stopped (``run_job``), else None.
        fix: what to do before running again, for the stop line: ``make the output dir writable``.
    """

    fix = "make the output dir writable"
    resume = "resume once it is writable"

    def __init__(self, out_dir: str | Path, file: str, reason: str, committed: int | None = None,
                 note: str | None = None):
        super().__init__(str(out_dir), file, reason, committed, note)  # args: pickles (a Ray actor's error)
        self.out_dir, self.file, self.reason, self.committed, self.note = str(out_dir), file, reason, committed, note
        self.summary = None

    def __str__(self) -> str:
        text = f"output.dir {self.out_dir!r}: {self.reason} while writing {self.file}"
        if self.committed is not None:
            text += f"; {self.committed} row{'s' * (self.committed != 1)} committed, {self.resume}"
        return text + (f"\n{self.note}" if self.note else "")

    def again(self, committed: int | None, note: str | None = None) -> OutputWriteError:
        """The same error (same class) with ``committed`` and ``note`` set."""
        return type(self)(self.out_dir, self.file, self.reason, committed=committed, note=note)


class DiskFullError(OutputWriteError):
    """A write into the output directory found no space (ENOSPC) or no quota (EDQUOT) left: not a problem
    with the job (the CLI exits 1). The file being written was not replaced and its temporary file is gone;
    the committed shards stay valid: free space and run again to resume. Attributes as ``OutputWriteError``'s;
    ``reason`` is ``no space left on device`` or ``disk quota exceeded``.
    """

    fix = "free space"
    resume = "resume after freeing space"


def disk_full(e: BaseException, out_dir: str | Path, file: str) -> DiskFullError | None:
    """``e`` as a ``DiskFullError`` when it is an ``OSError`` ENOSPC or EDQUOT (writing ``file`` in
    ``out_dir``), else None."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(out_dir, file, os.strerror(e.errno).lower())
    return None


def write_error(e: BaseException, out_dir: str | Path, file: str) -> OutputWriteError | None:
    """``e`` (raised writing ``file`` in ``out_dir``) as an ``OutputWriteError``: a ``DiskFullError`` for ENOSPC
    or EDQUOT, an ``OutputWriteError`` for any other ``OSError`` (EROFS, EACCES, ENOENT, EIO, ...); else None."""
    if not isinstance(e, OSError):
        return None
    if (full := disk_full(e, out_dir, file)) is not None:
        return full
    reason = os.strerror(e.errno) if e.errno else (e.strerror or str(e) or type(e).__name__)
    return OutputWriteError(out_dir, file, reason.lower())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """Write ``path`` via ``write(file_object)`` into a temporary file in the same directory, fsync it,
    rename it over ``path`` and fsync the directory: readers see the old file or the new one.

    Raises:
        DiskFullError: no space or quota left before the rename; ``path`` is as it was, the temporary file
            removed.
        OutputWriteError: any other ``OSError`` (a read-only remount, the directory removed, an I/O error)
            before the rename (as above). A failing fsync of the directory after the rename is logged, not
            raised: the new file is in place, and callers undo a commit on an ``OutputWriteError``.
    """
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are ordinary files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):  # the write's error is the one to report, not the cleanup's
                Path(tmp).unlink(missing_ok=True)
        if (err := write_error(e, path.parent, path.name)) is not None:
            raise err from None  # one error, not the write's and then the close's
        raise
    try:
        _fsync_dir(path.parent)
    except OSError as e:  # renamed already: ``path`` is the new file; the caller must not undo its commit
        log.warning("%s: written, but the directory's fsync failed (%s): the rename may not survive a power loss",
                    path, e.strerror or e)


def diff_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves that differ between two nested dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        path = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_fields(a, b, path + ".")
        elif a != b:
            out.append(path)
    return out


def write_shard(out_dir: str | Path, name: str, table: pa.Table) -> dict:
    """Write ``table`` durably as ``out_dir/name`` (temporary file, fsync, rename, directory fsync).

    Safe to call from any process; nothing is committed until the returned entry is passed to
    ``ShardStore.commit_entries``.

    Returns:
        The manifest entry ``{"file", "rows", "bytes", "sha256"}``.
    """
    buf = io.BytesIO()
    pq.write_table(table, buf)
    data = buf.getvalue()
    atomic_write(Path(out_dir) / name, lambda f: f.write(data))
    return {"file": name, "rows": table.num_rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def keys_digest(keys) -> str:
    """sha256 (hex) of a set of ``(id, sample_index)`` keys, independent of their order."""
    return hashlib.sha256(json.dumps(sorted([i, k] for i, k in keys)).encode()).hexdigest()


# The second key column of a shard: ``sample_index`` (generation) or ``choice_index`` (``task: score``).
KEY_COLUMNS = ("sample_index", "choice_index")


def key_column(fingerprint: dict | None) -> str:
    """The column that, with ``id``, keys the rows of an output dir whose fingerprint is ``fingerprint``
    (``results.key_column`` of its ``task``)."""
    return "choice_index" if (fingerprint or {}).get("task") == "score" else "sample_index"


def _table_keys(table: pa.Table) -> list[tuple]:
    second = "choice_index" if "choice_index" in table.column_names else "sample_index"
    return list(zip(table.column("id").to_pylist(), table.column(second).to_pylist()))


@dataclass
class OpenReport:
    """What opening an output directory found and cleaned up.

    Attributes:
        temporaries: leftover temporary files removed (an interrupted atomic write, a Ray unit's attempt count).
        orphans: shard files not listed in the manifest, removed (written by a run that was killed before
            committing them; their rows were not committed and are generated again).
        adopted: complete unit shards of the manifest's plan that were written but not committed,
            verified and committed now.
        dropped: with ``redo_corrupt``, the manifest entries of the damaged committed shards dropped (each
            with its ``problem`` and the time ``dropped``, as recorded under the manifest's ``dropped``).
        check: with ``redo_corrupt``, the full check of every committed shard (sha256 included); else None.
    """

    temporaries: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    check: ShardCheck | None = None


def read_manifest(out_dir: str | Path) -> dict | None:
    """The manifest of ``out_dir``, or None if there is none.

    Raises:
        OutputError: the manifest exists but is not a readable manifest.
    """
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        problem = _manifest_problem(manifest)
    except (ValueError, OSError) as e:
        problem = str(e)
    if problem:
        raise OutputError(f"{path}: unreadable manifest ({problem})")
    return manifest


def _manifest_problem(manifest) -> str | None:
    """What makes a parsed manifest unusable (the fields every reader relies on have the wrong shape), or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if not isinstance(manifest.get("shards"), list):
        return "no shards list"
    for i, e in enumerate(manifest["shards"]):
        if not isinstance(e, dict):
            return f"shards[{i}] is {e!r}, not an object"
        if not isinstance(e.get("file"), str) or "/" in e["file"] or e["file"] in ("", ".", ".."):
            return f"shards[{i}].file is {e.get('file')!r}, not a file name"
        if not isinstance(e.get("rows"), int) or isinstance(e["rows"], bool) or e["rows"] < 0:
            return f"shards[{i}].rows is {e.get('rows')!r}, not a row count"
    for key, kind in (("runs", list), ("fingerprint", dict), ("info", dict), ("inputs", list), ("forced", list),
                      ("dropped", list), ("plan", dict)):
        if key in manifest and not isinstance(manifest[key], kind):
            return f"{key} is {manifest[key]!r}, not {'a list' if kind is list else 'an object'}"
    for i, r in enumerate(manifest.get("runs", [])):
        if not isinstance(r, dict):
            return f"runs[{i}] is {r!r}, not an object"
    return None


def read_consistent(out_dir: str | Path, read: Callable[[dict], object], tries: int = 5) -> tuple[dict, object]:
    """``(manifest, read(manifest))`` for one manifest of ``out_dir``, while a run may be committing to it:
    a commit replaces the manifest atomically, and ``--retry-failed`` then deletes the shards it rewrote, so a
    reader holding the previous manifest can find a committed shard gone. When ``read`` raises
    ``OutputError`` and the manifest on disk has changed since it was read, ``read`` runs again on the new
    one (up to ``tries`` times); the error stands when the manifest is unchanged (the shard really is
    missing or damaged).

    Raises:
        OutputError: no manifest (``out_dir`` is not an output directory, or nothing is committed yet), an
            unreadable one, or ``read``'s own.
    """
    manifest = read_manifest(out_dir)
    for attempt in range(tries):
        if manifest is None:
            raise OutputError(f"{out_dir}: no manifest.json (not a pipeline output directory, or nothing "
                              f"committed yet)")
        try:
            return manifest, read(manifest)
        except OutputError:
            now = read_manifest(out_dir)
            if now == manifest or attempt == tries - 1:
                raise
            manifest = now
    raise AssertionError("unreachable")


def shard_error(out_dir: str | Path, entry: dict, problem: str) -> str:
    """The one-line error for a damaged committed shard: its path, what is wrong (``problem``, from
    ``check_shards`` or a failed read) and the way out (restore it, or ``--redo-corrupt``)."""
    path = Path(out_dir) / entry["file"]
    if problem == MISSING:
        return f"{path}: committed shard is missing ({entry['rows']} rows); restore it, or {REDO} generates them again"
    return (f"{path}: committed shard {problem}; it was changed after commit; {REDO} generates its "
            f"{entry['rows']} rows again")


def _size_problem(entry: dict, size: int) -> str | None:
    if "bytes" in entry and size != entry["bytes"]:
        return f"has {size} bytes, the manifest says {entry['bytes']}"
    return None


def _hash_problem(entry: dict, digest: str) -> str | None:
    if digest != entry["sha256"]:
        return f"has sha256 {digest[:12]}..., the manifest says {entry['sha256'][:12]}..."
    return None


def _footer_problem(path: Path, size: int, rows: int) -> str | None:
    """What is wrong with a Parquet file's framing and footer, reading neither data pages nor more than the
    footer: the ``PAR1`` magic at both ends, a footer length that fits, metadata that pyarrow parses, the
    manifest's row count, and every column chunk inside the data region (Parquet format spec, "File Format")."""
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(size - 8, 0))
        tail = f.read(8)
        if size < 12 or head != _MAGIC or tail[4:] != _MAGIC:
            return "has a damaged Parquet footer (no PAR1 magic at its " + ("start)" if head != _MAGIC else "end)")
        footer_len = int.from_bytes(tail[:4], "little")
        if footer_len > size - 12:
            return f"has a damaged Parquet footer (footer length {footer_len} exceeds the file)"
        try:
            f.seek(0)
            md = pq.read_metadata(f)
            if md.num_rows != rows:
                return f"has a Parquet footer of {md.num_rows} rows, the manifest says {rows}"
            data_end = size - 8 - footer_len
            for i in range(md.num_row_groups):
                for j in range(md.row_group(i).num_columns):
                    c = md.row_group(i).column(j)
                    start = c.data_page_offset
                    if c.has_dictionary_page and 4 <= (c.dictionary_page_offset or 0) < start:
                        start = c.dictionary_page_offset  # the dictionary page comes first
                    if start < 4 or start + c.total_compressed_size > data_end:
                        return (f"has a damaged Parquet footer (column {c.path_in_schema} of row group {i} lies "
                                "outside the data)")
        except (OSError, ValueError, pa.ArrowException) as e:
            return f"has a damaged Parquet footer ({first_line(e)})"
    return None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class ShardCheck:
    """What ``check_shards`` found.

    Attributes:
        out_dir: the output directory.
        bad: ``(entry, problem)`` for each damaged shard, in manifest order (``errors`` gives the lines).
        hashed: shards whose sha256 was computed and matched the manifest's.
        unhashed: files that were to be hashed but whose entry records no sha256 (older manifests).
    """

    out_dir: Path
    bad: list[tuple[dict, str]] = field(default_factory=list)
    hashed: int = 0
    unhashed: list[str] = field(default_factory=list)

    def errors(self) -> list[str]:
        return [shard_error(self.out_dir, e, p) for e, p in self.bad]

    def raise_bad(self) -> None:
        """Raises: OutputError: one line per damaged shard (``shard_error``), if any."""
        if self.bad:
            raise OutputError("\n".join(self.errors()))


def check_shards(out_dir: str | Path, entries: list[dict], *, footer: bool = True,
                 digest: Callable[[dict], bool] = lambda entry: False) -> ShardCheck:
    """Check committed shards against their manifest entries, cheapest first, stopping at each shard's first
    problem: the file is there; its size (``bytes``); with ``footer``, its Parquet framing and footer
    (reads the footer only); where ``digest(entry)``, its sha256 (reads the whole file). What an entry does
    not record (``bytes``, ``sha256``: older manifests) is not checked. Reads only."""
    out_dir = Path(out_dir)
    check = ShardCheck(out_dir)
    for e in entries:
        path = out_dir / e["file"]
        try:
            if not path.is_file():
                problem = MISSING
            else:
                size = path.stat().st_size
                problem = _size_problem(e, size) or (_footer_problem(path, size, e["rows"]) if footer else None)
                if problem is None and digest(e):
                    if "sha256" not in e:
                        check.unhashed.append(e["file"])
                    elif not (problem := _hash_problem(e, _file_sha256(path))):
                        check.hashed += 1
        except OSError as err:
            problem = f"is not readable ({err.strerror or first_line(err)})"
        if problem:
            check.bad.append((e, problem))
    return check


def read_shard(out_dir: str | Path, entry: dict, columns: list[str] | None = None, *,
               present: bool = False) -> pa.Table:
    """One committed shard's rows (only ``columns`` if given; with ``present``, only those of ``columns`` the
    shard has: a shard written before a column existed lacks it), read without verifying its bytes.

    Raises:
        OutputError: the file is missing or not readable as Parquet (``shard_error``'s line).
    """
    path = Path(out_dir) / entry["file"]
    try:
        with pq.ParquetFile(path) as f:  # ~4x less overhead per file than pq.read_table (measured: 0.75 vs 2.8 ms)
            if present and columns is not None:
                columns = [c for c in columns if c in f.schema_arrow.names]
            return f.read(columns=columns)
    except (OSError, pa.ArrowException) as e:
        problem = MISSING if not path.is_file() else f"is not readable as Parquet ({first_line(e)})"
        raise OutputError(shard_error(out_dir, entry, problem)) from None


def read_shard_verified(out_dir: str | Path, entry: dict) -> pa.Table:
    """One committed shard, read once into memory, its size and sha256 checked against ``entry`` where it
    records them, and parsed from those same bytes (so what is returned is what was hashed).

    Raises:
        OutputError: the file is missing, has another size or sha256, or is not readable as Parquet.
    """
    path = Path(out_dir) / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as e:
        problem = MISSING if not path.is_file() else f"is not readable ({e.strerror or first_line(e)})"
        raise OutputError(shard_error(out_dir, entry, problem)) from None
    problem = _size_problem(entry, len(data))
    if problem is None and "sha256" in entry:
        problem = _hash_problem(entry, hashlib.sha256(data).hexdigest())
    if problem is None:
        try:
            return pq.read_table(pa.BufferReader(data))
        except (OSError, pa.ArrowException) as e:
            problem = f"is not readable as Parquet ({first_line(e)})"
    raise OutputError(shard_error(out_dir, entry, problem))


def _key_lists(table: pa.Table) -> tuple[list[tuple], list[tuple]]:
    """``(keys, failed keys)``: the ``(id, sample_index)`` of a shard's rows, and of those whose ``error`` is set."""
    keys = _table_keys(table)
    return keys, [k for k, e in zip(keys, table.column("error").to_pylist()) if e is not None]


def read_committed(out_dir: str | Path, manifest: dict, columns: list[str] | None = None) -> pa.Table | None:
    """The rows of the shards ``manifest`` lists (only ``columns`` if given), in commit order; None if
    there are none. Reads only; for a directory another process may be writing.

    Raises:
        OutputError: a committed shard is missing or not readable as Parquet (``read_shard``).
    """
    tables = [read_shard(out_dir, e, columns) for e in manifest["shards"]]
    return pa.concat_tables(tables) if tables else None


def check_output_dir(out_dir: str | Path, fingerprint: dict, *, force: bool = False) -> dict | None:
    """Check, without changing anything, that ``out_dir`` can hold this job's results: it is missing,
    empty, or holds a manifest with the same fingerprint (any fingerprint when ``force``, or when the
    manifest lists no committed shard: a run stopped before its first commit, e.g. refused for memory,
    left nothing a changed job could contradict).

    Returns:
        The existing manifest, or None.

    Raises:
        OutputError: a non-empty directory without a manifest, an unreadable manifest, or a different
            fingerprint (the message lists the differing fields).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"output.dir {str(out_dir)!r} is a file, not a directory")
    manifest = read_manifest(out_dir)
    if manifest is None:
        foreign = [p.name for p in out_dir.iterdir() if not p.name.startswith(".")] if out_dir.exists() else []
        if foreign:
            raise OutputError(
                f"output.dir {str(out_dir)!r} is not empty and has no {MANIFEST} "
                f"(found {', '.join(sorted(foreign)[:5])}); choose an empty or new directory"
            )
        return None
    changed = diff_fields(manifest.get("fingerprint", {}), fingerprint)
    if changed and not force and manifest.get("shards"):
        raise OutputError(
            f"{out_dir} holds results of a different job (changed: {', '.join(changed)}); "
            "use a new output.dir (or --output-dir DIR), or --force to add rows made with the new settings "
            "to this one"
        )
    return manifest


class ShardStore:
    """The output directory of one job; the only writer of its manifest.

    Opening it removes leftover temporary files and uncommitted shard files (see ``report``), checks
    that every committed shard is present with its recorded size and an intact Parquet footer, and that the
    shard files the newest run that committed any wrote (rewritten ones included) match their sha256
    (``check_shards``), and adopts the
    complete unit shards of the plan that were not committed (only when the run that planned them had this
    fingerprint).

    Args:
        out_dir: the directory (created if missing).
        fingerprint: what determines the outputs (model hash, generation settings, ...); a resume with a
            different fingerprint is refused unless ``force``.
        force: continue despite a different fingerprint: the manifest's fingerprint becomes this one
            (recorded under ``forced``) once a shard made with it is committed.
        redo_corrupt: check every committed shard's sha256 too, and drop the damaged ones from the manifest
            instead of raising (``report.dropped``): their rows are pending again, the others stay committed.

    Attributes:
        run: the number (1-based index into the manifest's ``runs``) of the run whose shards are being
            committed, stamped on each new shard entry: ``add_run`` sets it; before that, the last run
            recorded (which planned any unit shard adopted on open).

    Raises:
        OutputError: see ``check_output_dir``; or (without ``redo_corrupt``) committed shards that are missing
            or damaged, one line each (``shard_error``).
    """

    def __init__(self, out_dir: str | Path, fingerprint: dict, *, force: bool = False, redo_corrupt: bool = False):
        self.dir = Path(out_dir)
        self._failed: dict[str, list[tuple]] = {}  # shard file -> the keys of its failed rows
        manifest = check_output_dir(self.dir, fingerprint, force=force)
        self.dir.mkdir(parents=True, exist_ok=True)
        if manifest is None:
            manifest = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "shards": [], "rows": 0}
        if not manifest["shards"]:
            manifest["fingerprint"] = fingerprint  # nothing committed that other settings could contradict
        used = [int(m.group(1)) + 1 for e in manifest["shards"] if (m := _SHARD_NAME.fullmatch(e["file"]))]
        manifest["next_shard"] = max([manifest.get("next_shard", len(manifest["shards"])), *used])  # once; commits keep it
        self.manifest = manifest
        self.fingerprint = fingerprint
        self.key = key_column(fingerprint)
        runs = manifest.get("runs", [])
        self.run = len(runs) or None
        self._record: dict | None = None  # the run record add_run started
        planner = runs[-1].get("fingerprint", manifest["fingerprint"]) if runs else manifest["fingerprint"]
        self.report = self._clean()
        self._check_committed(redo_corrupt)
        self._adopt_units(self.report, allowed=not diff_fields(planner, fingerprint))

    def add_run(self, record: dict, *, inputs: list[dict] | None = None, info: dict | None = None) -> int:
        """Start a run: append its record (with this store's fingerprint) to the manifest's ``runs``; the
        shards committed from now on name it. An earlier Ray run's ``plan`` is dropped (its units were
        adopted or removed when the store was opened; a Ray run plans anew, ``plan_units``); ``inputs`` (the
        input files' state) and ``info`` (Python version, job) replace the manifest's when given. Saved with
        the next manifest write. Returns its number."""
        if inputs is not None:
            self.manifest["inputs"] = inputs
        if info is not None:
            self.manifest["info"] = info
        self.manifest.pop("plan", None)
        record["fingerprint"] = self.fingerprint
        self.manifest.setdefault("runs", []).append(record)
        self.run = len(self.manifest["runs"])
        self._record = record
        return self.run

    def update_run(self, **fields) -> None:
        """Set ``fields`` in the record of the run ``add_run`` started; saved with the next manifest write."""
        self._record.update(fields)

    def finish_run(self, complete: bool, **fields) -> None:
        """End the run ``add_run`` started: ``fields`` into its record (``finished``, its counts, ...) and
        ``complete`` (every row of its selection committed) into the manifest, then write the manifest.

        Raises:
            OutputWriteError: the manifest could not be written (``DiskFullError``: it did not fit); the committed
                shards are as before.
        """
        self._record.update(fields)
        self.manifest["complete"] = complete
        self._write_manifest()

    def _clean(self) -> OpenReport:
        report = OpenReport()
        listed = {s["file"] for s in self.manifest["shards"]}
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
                report.temporaries.append(p.name)
            elif _SHARD_NAME.fullmatch(p.name) and p.name not in listed:
                p.unlink(missing_ok=True)
                report.orphans.append(p.name)
            # unlisted unit-NNNNN.parquet files are left to _adopt_units
        if report.temporaries or report.orphans:
            _fsync_dir(self.dir)
        return report

    def _adopt_units(self, report: OpenReport, allowed: bool) -> None:
        """Commit each unlisted unit shard that the plan names, that reads as Parquet and whose keys are
        exactly the plan's for that unit, none of them already committed without an error (committed
        failed rows it holds are replaced, as by the ``--retry-failed`` run that planned it); remove the
        others. ``allowed`` false (the job's fingerprint changed) removes them all."""
        listed = {s["file"] for s in self.manifest["shards"]}
        found = [p for p in sorted(self.dir.iterdir()) if _UNIT_NAME.fullmatch(p.name) and p.name not in listed]
        plan = self.manifest.get("plan", {}).get("units", {})
        committed = failed = None
        for p in found:
            want, keys = plan.get(p.name) if allowed else None, None
            if want is not None:
                try:
                    data = p.read_bytes()
                    keys = _table_keys(pq.read_table(pa.BufferReader(data), columns=["id", self.key]))
                except (OSError, pa.ArrowException, KeyError):
                    keys = None
            if keys is not None and len(keys) == want["rows"] and keys_digest(keys) == want["keys"]:
                if committed is None:
                    committed, failed = self.committed_keys(), self.failed_keys()
                overlap = set(keys) & committed
                if not overlap - failed:
                    entry = {"file": p.name, "rows": len(keys), "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest()}
                    self.commit_written(entry, replaces=overlap)
                    committed |= set(keys)
                    report.adopted.append(p.name)
                    continue
            p.unlink(missing_ok=True)
            report.orphans.append(p.name)
        if found:
            _fsync_dir(self.dir)

    def _check_committed(self, redo: bool) -> None:
        """``check_shards`` on open: presence, size and footer of every shard, sha256 of the files the newest
        run wrote (``redo``: of every shard); raise, or with ``redo`` drop what is damaged."""
        shards = self.manifest["shards"]
        written = lambda s: s.get("rewritten", s.get("run"))  # noqa: E731  (the run that wrote the file)
        newest = max((written(s) for s in shards if isinstance(written(s), int)), default=None)
        check = check_shards(self.dir, shards, footer=True,
                             digest=lambda s: redo or (newest is not None and written(s) == newest))
        if not redo:
            check.raise_bad()
            return
        self.report.check = check
        if check.bad:
            self._drop(check.bad)

    def _drop(self, bad: list[tuple[dict, str]]) -> None:
        """Remove the shards of ``bad`` from the manifest in one atomic write, each entry recorded with its
        problem under ``dropped``, then delete their files; their rows are no longer committed."""
        gone = {e["file"] for e, _ in bad}
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        records = [{**e, "problem": problem, "dropped": when} for e, problem in bad]
        self.manifest.setdefault("dropped", []).extend(records)
        self.manifest["shards"] = [s for s in self.manifest["shards"] if s["file"] not in gone]
        self.manifest["rows"] = sum(s["rows"] for s in self.manifest["shards"])
        self.manifest["complete"] = False
        self._write_manifest()
        for name in gone:
            (self.dir / name).unlink(missing_ok=True)
        _fsync_dir(self.dir)
        self.report.dropped = records

    @property
    def shard_files(self) -> list[Path]:
        """The committed shard files, in manifest order."""
        return [self.dir / s["file"] for s in self.manifest["shards"]]

    def committed_table(self, columns: list[str] | None = None) -> pa.Table | None:
        """Every committed row (only ``columns`` if given), in commit order; None if there are none."""
        return read_committed(self.dir, self.manifest, columns)

    def committed_keys(self) -> set[tuple]:
        """``(id, sample_index)`` of every committed row (read from the shards; their failed keys are kept)."""
        keys = set()
        for e in self.manifest["shards"]:
            shard_keys, self._failed[e["file"]] = _key_lists(read_shard(self.dir, e, ["id", self.key, "error"]))
            keys.update(shard_keys)
        return keys

    def failed_keys(self) -> set[tuple]:
        """``(id, sample_index)`` of committed rows whose ``error`` is set. A shard's failed keys are read
        once and kept (a file's rows never change; a rewritten shard is a new file; a commit gives its own),
        so the end of a 100,000-row run reads no shard again."""
        out = set()
        for e in self.manifest["shards"]:
            if e["file"] not in self._failed:
                self._failed[e["file"]] = _key_lists(read_shard(self.dir, e, ["id", self.key, "error"]))[1]
            out.update(self._failed[e["file"]])
        return out

    def next_name(self) -> str:
        """A shard file name never used in this directory's manifest (reserved when committed)."""
        return f"part-{self.manifest['next_shard']:05d}.parquet"

    def commit(self, table: pa.Table, replaces: set[tuple] = frozenset()) -> str:
        """Write ``table`` as the next shard and commit it; rows of earlier shards whose
        ``(id, sample_index)`` is in ``replaces`` are dropped in the same commit (``--retry-failed``).
        Returns the shard file name."""
        entry = write_shard(self.dir, self.next_name(), table)
        self.manifest["next_shard"] += 1
        try:
            self.commit_written(entry, replaces)
        except OutputWriteError:
            with contextlib.suppress(OSError):  # a read-only remount: the write's error is the one to report
                (self.dir / entry["file"]).unlink(missing_ok=True)  # not committed: give its space back
            raise
        self._failed[entry["file"]] = _key_lists(table)[1]
        return entry["file"]

    def commit_written(self, entry: dict, replaces: set[tuple] = frozenset()) -> None:
        """Commit one shard already written with ``write_shard``, dropping the committed rows whose
        ``(id, sample_index)`` is in ``replaces`` in the same commit; a unit shard leaves the plan."""
        rewritten = self._without(replaces) if replaces else {}
        units = self.manifest.get("plan", {}).get("units", {})
        planned = units.pop(entry["file"], None)
        try:
            self.commit_entries([entry], rewritten)
        except OutputWriteError:
            if planned is not None:
                units[entry["file"]] = planned  # not committed: still adoptable on the next open
            for new in rewritten.values():
                if new is not None:
                    with contextlib.suppress(OSError):
                        (self.dir / new["file"]).unlink(missing_ok=True)
            raise

    def plan_units(self, units: list[list[tuple]], unit_rows: int) -> list[str]:
        """Reserve a shard name ``unit-NNNNN.parquet`` (never used before in this directory) for each
        work unit, given as its ``(id, sample_index)`` keys, and record the plan in the manifest (row
        count and ``keys_digest`` per unit, replacing any earlier plan) before any unit runs, so that a
        unit shard written but not committed can be adopted on the next open. Returns the names."""
        first = self.manifest.get("next_unit", 0)
        names = [f"unit-{first + j:05d}.parquet" for j in range(len(units))]
        self.manifest["next_unit"] = first + len(units)
        self.manifest["plan"] = {"unit_rows": unit_rows, "units": {
            name: {"rows": len(keys), "keys": keys_digest(keys)} for name, keys in zip(names, units)}}
        self._write_manifest()
        return names

    def _without(self, keys: set[tuple]) -> dict[str, dict | None]:
        """New shards for the committed shards holding any of ``keys``, without those rows:
        ``{old file: new entry or None (nothing left)}``; the old files stay until committed."""
        out = {}
        for s in self.manifest["shards"]:
            t = read_shard(self.dir, s)
            drop = [(i, k) in keys for i, k in _table_keys(t)]
            if any(drop):
                kept = t.filter(pa.array([not d for d in drop]))
                out[s["file"]] = None
                if kept.num_rows:
                    out[s["file"]] = write_shard(self.dir, self.next_name(), kept)
                    if "run" in s:
                        out[s["file"]]["run"] = s["run"]  # the kept rows were made by the old shard's run
                    if self.run is not None:
                        out[s["file"]]["rewritten"] = self.run  # the file by this one (hashed on the next open)
                    self.manifest["next_shard"] += 1
        return out

    def commit_entries(self, entries: list[dict], rewritten: dict[str, dict | None] | None = None) -> None:
        """Commit shards already written with ``write_shard``: one atomic manifest replacement adds
        ``entries`` and swaps each file of ``rewritten`` for its new entry (or drops it); replaced files
        are deleted after the commit. Each entry of ``entries`` names ``self.run``; when this store's
        fingerprint differs from the manifest's (``force``), the manifest's becomes it in the same
        commit and the change is appended to ``forced``.

        Raises:
            OutputWriteError: the manifest could not be written (``DiskFullError``: it did not fit); nothing is
                committed and ``manifest`` is left as on disk.
        """
        rewritten = rewritten or {}
        before = {k: self.manifest[k] for k in ("shards", "rows", "next_shard", "fingerprint") if k in self.manifest}
        forced = len(self.manifest["forced"]) if "forced" in self.manifest else None
        for e in entries:
            if self.run is not None:
                e.setdefault("run", self.run)
        changed = diff_fields(self.manifest["fingerprint"], self.fingerprint)
        if changed and entries:
            self.manifest.setdefault("forced", []).append(
                {"changed": changed, "previous": self.manifest["fingerprint"], "run": self.run})
            self.manifest["fingerprint"] = self.fingerprint
        shards = []
        for s in self.manifest["shards"]:
            if s["file"] in rewritten:
                if rewritten[s["file"]] is not None:
                    shards.append(rewritten[s["file"]])
            else:
                shards.append(s)
        shards += entries
        self.manifest["shards"] = shards
        self.manifest["rows"] = sum(s["rows"] for s in shards)
        added = entries + [e for e in rewritten.values() if e is not None]  # the earlier ones are in next_shard
        used = [int(m.group(1)) for s in added if (m := _SHARD_NAME.fullmatch(s["file"]))]
        self.manifest["next_shard"] = max([self.manifest.get("next_shard", 0), *(u + 1 for u in used)])
        try:
            self._write_manifest()
        except OutputWriteError:
            self.manifest.update(before)
            if forced is None:
                self.manifest.pop("forced", None)
            else:
                del self.manifest["forced"][forced:]
            raise
        for old in rewritten:
            with contextlib.suppress(OSError):  # committed without it: a file left is removed on the next open
                (self.dir / old).unlink(missing_ok=True)

    def save(self) -> None:
        """Rewrite the manifest (after changing informational fields such as ``info`` or ``runs``)."""
        self._write_manifest()

    def _write_manifest(self) -> None:
        # compact: json's C encoder (indent would use the pure-Python one, ~10x slower; the manifest of a
        # 100,000-row run is ~1 MB and rewritten at every commit)
        data = json.dumps(self.manifest, separators=(",", ":"), sort_keys=True).encode()
        atomic_write(self.dir / MANIFEST, lambda f: f.write(data))
