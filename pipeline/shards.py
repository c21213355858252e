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
rewritten by ``--retry-failed`` keeps its rows' run). The manifest's own ``fingerprint`` is the one a
resume is compared with: the settings of the last rows committed. A ``--force`` run with other settings
switches it (recorded under ``forced``) when it commits its first shard, not before, so a forced run
that generates nothing leaves the record as it was. Manifests written before these fields existed have
neither; ``pipeline.status`` attributes their rows as well as it can (``run_fingerprints``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"
_UMASK = os.umask(0)
os.umask(_UMASK)
FORMAT_VERSION = 2
_SHARD_NAME = re.compile(r"part-(\d{5,})\.parquet")
_UNIT_NAME = re.compile(r"unit-\d{5,}\.parquet")


class OutputError(RuntimeError):
    """The output directory cannot be used (foreign contents, different job, unreadable manifest)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """Write ``path`` via ``write(file_object)`` into a temporary file in the same directory, fsync it,
    rename it over ``path`` and fsync the directory: readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are ordinary files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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


def _table_keys(table: pa.Table) -> list[tuple]:
    return list(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))


@dataclass
class OpenReport:
    """What opening an output directory found and cleaned up.

    Attributes:
        temporaries: leftover temporary files removed (an interrupted atomic write, a Ray unit's attempt count).
        orphans: shard files not listed in the manifest, removed (written by a run that was killed before
            committing them; their rows were not committed and are generated again).
        adopted: complete unit shards of the manifest's plan that were written but not committed,
            verified and committed now.
    """

    temporaries: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)


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
        if not isinstance(manifest.get("shards"), list):
            raise ValueError("no shards list")
    except (ValueError, AttributeError, OSError) as e:
        raise OutputError(f"{path}: unreadable manifest ({e})") from None
    return manifest


def read_committed(out_dir: str | Path, manifest: dict, columns: list[str] | None = None) -> pa.Table | None:
    """The rows of the shards ``manifest`` lists (only ``columns`` if given), in commit order; None if
    there are none. Reads only; for a directory another process may be writing."""
    tables = [pq.read_table(Path(out_dir) / e["file"], columns=columns) for e in manifest["shards"]]
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
    that every committed shard is present with its recorded size, and adopts the complete unit shards
    of the plan that were not committed (only when the run that planned them had this fingerprint).

    Args:
        out_dir: the directory (created if missing).
        fingerprint: what determines the outputs (model hash, generation settings, ...); a resume with a
            different fingerprint is refused unless ``force``.
        force: continue despite a different fingerprint: the manifest's fingerprint becomes this one
            (recorded under ``forced``) once a shard made with it is committed.

    Attributes:
        run: the number (1-based index into the manifest's ``runs``) of the run whose shards are being
            committed, stamped on each new shard entry: ``add_run`` sets it; before that, the last run
            recorded (which planned any unit shard adopted on open).

    Raises:
        OutputError: see ``check_output_dir``; or a committed shard is missing or has another size.
    """

    def __init__(self, out_dir: str | Path, fingerprint: dict, *, force: bool = False):
        self.dir = Path(out_dir)
        manifest = check_output_dir(self.dir, fingerprint, force=force)
        self.dir.mkdir(parents=True, exist_ok=True)
        if manifest is None:
            manifest = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "shards": [], "rows": 0}
        if not manifest["shards"]:
            manifest["fingerprint"] = fingerprint  # nothing committed that other settings could contradict
        manifest.setdefault("next_shard", len(manifest["shards"]))
        self.manifest = manifest
        self.fingerprint = fingerprint
        runs = manifest.get("runs", [])
        self.run = len(runs) or None
        planner = runs[-1].get("fingerprint", manifest["fingerprint"]) if runs else manifest["fingerprint"]
        self.report = self._clean()
        self._verify()
        self._adopt_units(self.report, allowed=not diff_fields(planner, fingerprint))

    def add_run(self, record: dict) -> int:
        """Append a run record (with this store's fingerprint) to the manifest's ``runs``; the shards
        committed from now on name it. Saved with the next manifest write. Returns its number."""
        record["fingerprint"] = self.fingerprint
        self.manifest.setdefault("runs", []).append(record)
        self.run = len(self.manifest["runs"])
        return self.run

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
                    keys = _table_keys(pq.read_table(pa.BufferReader(data), columns=["id", "sample_index"]))
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

    def _verify(self) -> None:
        for s in self.manifest["shards"]:
            path = self.dir / s["file"]
            if not path.is_file():
                raise OutputError(f"{path}: committed shard is missing ({s['rows']} rows); restore it or use a new output dir")
            if "bytes" in s and path.stat().st_size != s["bytes"]:
                raise OutputError(f"{path}: committed shard has {path.stat().st_size} bytes, the manifest says "
                                  f"{s['bytes']}; it was changed after commit")

    @property
    def shard_files(self) -> list[Path]:
        return [self.dir / s["file"] for s in self.manifest["shards"]]

    def committed_table(self, columns: list[str] | None = None) -> pa.Table | None:
        """Every committed row (only ``columns`` if given), in commit order; None if there are none."""
        return read_committed(self.dir, self.manifest, columns)

    def committed_keys(self) -> set[tuple]:
        """``(id, sample_index)`` of every committed row."""
        t = self.committed_table(["id", "sample_index"])
        return set() if t is None else set(zip(t.column("id").to_pylist(), t.column("sample_index").to_pylist()))

    def failed_keys(self) -> set[tuple]:
        """``(id, sample_index)`` of committed rows whose ``error`` is set."""
        t = self.committed_table(["id", "sample_index", "error"])
        if t is None:
            return set()
        return {(i, k) for i, k, e in zip(*(t.column(c).to_pylist() for c in ("id", "sample_index", "error")))
                if e is not None}

    def next_name(self) -> str:
        """A shard file name never used in this directory's manifest (reserved when committed)."""
        return f"part-{self.manifest['next_shard']:05d}.parquet"

    def commit(self, table: pa.Table, replaces: set[tuple] = frozenset()) -> str:
        """Write ``table`` as the next shard and commit it; rows of earlier shards whose
        ``(id, sample_index)`` is in ``replaces`` are dropped in the same commit (``--retry-failed``).
        Returns the shard file name."""
        entry = write_shard(self.dir, self.next_name(), table)
        self.manifest["next_shard"] += 1
        self.commit_written(entry, replaces)
        return entry["file"]

    def commit_written(self, entry: dict, replaces: set[tuple] = frozenset()) -> None:
        """Commit one shard already written with ``write_shard``, dropping the committed rows whose
        ``(id, sample_index)`` is in ``replaces`` in the same commit; a unit shard leaves the plan."""
        rewritten = self._without(replaces) if replaces else {}
        self.manifest.get("plan", {}).get("units", {}).pop(entry["file"], None)
        self.commit_entries([entry], rewritten)

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
            t = pq.read_table(self.dir / s["file"])
            drop = [(i, k) in keys for i, k in zip(t.column("id").to_pylist(), t.column("sample_index").to_pylist())]
            if any(drop):
                kept = t.filter(pa.array([not d for d in drop]))
                out[s["file"]] = None
                if kept.num_rows:
                    out[s["file"]] = write_shard(self.dir, self.next_name(), kept)
                    if "run" in s:
                        out[s["file"]]["run"] = s["run"]  # the kept rows were made by the old shard's run
                    self.manifest["next_shard"] += 1
        return out

    def commit_entries(self, entries: list[dict], rewritten: dict[str, dict | None] | None = None) -> None:
        """Commit shards already written with ``write_shard``: one atomic manifest replacement adds
        ``entries`` and swaps each file of ``rewritten`` for its new entry (or drops it); replaced files
        are deleted after the commit. Each entry of ``entries`` names ``self.run``; when this store's
        fingerprint differs from the manifest's (``force``), the manifest's becomes it in the same
        commit and the change is appended to ``forced``."""
        rewritten = rewritten or {}
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
        used = [int(m.group(1)) for s in shards if (m := _SHARD_NAME.fullmatch(s["file"]))]
        self.manifest["next_shard"] = max([self.manifest.get("next_shard", 0), *(u + 1 for u in used)])
        self._write_manifest()
        for old in rewritten:
            (self.dir / old).unlink(missing_ok=True)

    def mark_complete(self, complete: bool) -> None:
        if self.manifest.get("complete") != complete:
            self.manifest["complete"] = complete
            self._write_manifest()

    def save(self) -> None:
        """Rewrite the manifest (after changing informational fields such as ``info`` or ``runs``)."""
        self._write_manifest()

    def _write_manifest(self) -> None:
        data = json.dumps(self.manifest, indent=1, sort_keys=True).encode()
        atomic_write(self.dir / MANIFEST, lambda f: f.write(data))
