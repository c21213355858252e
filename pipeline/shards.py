"""Committed output: Parquet shards plus a JSON manifest, each replaced atomically.

A row is committed once its shard is durable and listed in the manifest: the shard is written to a
temporary file, fsynced and renamed; then the manifest is rewritten the same way. Files in the output
directory that the manifest does not list are never read as results.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"
_UMASK = os.umask(0)
os.umask(_UMASK)
FORMAT_VERSION = 1


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


class ShardStore:
    """The output directory of one job.

    Args:
        out_dir: the directory (created if missing).
        fingerprint: what determines the outputs (model hash, generation settings, ...); a resume with a
            different fingerprint is refused unless ``force``.
        force: continue despite a different fingerprint (recorded in the manifest).

    Raises:
        OutputError: the directory holds files but no manifest, the manifest is unreadable, or the
            fingerprint differs (the message lists the differing fields).
    """

    def __init__(self, out_dir: str | Path, fingerprint: dict, *, force: bool = False):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / MANIFEST
        if path.exists():
            try:
                self.manifest = json.loads(path.read_text(encoding="utf-8"))
                self.manifest["shards"]
            except (ValueError, KeyError) as e:
                raise OutputError(f"{path}: unreadable manifest ({e})") from None
            changed = diff_fields(self.manifest.get("fingerprint", {}), fingerprint)
            if changed and not force:
                raise OutputError(
                    f"{self.dir} holds results of a different job (changed: {', '.join(changed)}); "
                    "use another output dir, or --force to continue anyway"
                )
            if changed:
                self.manifest.setdefault("forced", []).append({"changed": changed, "previous": self.manifest["fingerprint"]})
                self.manifest["fingerprint"] = fingerprint
        else:
            foreign = [p.name for p in self.dir.iterdir() if not p.name.startswith(".")]
            if foreign:
                raise OutputError(
                    f"output.dir {str(self.dir)!r} is not empty and has no {MANIFEST} "
                    f"(found {', '.join(sorted(foreign)[:5])}); choose an empty or new directory"
                )
            self.manifest = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "shards": [], "rows": 0}
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for p in self.dir.glob(".*.tmp"):
            p.unlink(missing_ok=True)

    @property
    def shard_files(self) -> list[Path]:
        return [self.dir / s["file"] for s in self.manifest["shards"]]

    def committed_keys(self) -> set[tuple]:
        """``(id, sample_index)`` of every committed row."""
        keys = set()
        for f in self.shard_files:
            t = pq.read_table(f, columns=["id", "sample_index"])
            keys.update(zip(t.column("id").to_pylist(), t.column("sample_index").to_pylist()))
        return keys

    def commit(self, table: pa.Table) -> str:
        """Write ``table`` as the next shard and list it in the manifest; returns the shard file name."""
        name = f"part-{len(self.manifest['shards']):05d}.parquet"
        atomic_write(self.dir / name, lambda f: pq.write_table(table, f))
        self.manifest["shards"].append({"file": name, "rows": table.num_rows})
        self.manifest["rows"] += table.num_rows
        self._write_manifest()
        return name

    def mark_complete(self, complete: bool) -> None:
        if self.manifest.get("complete") != complete:
            self.manifest["complete"] = complete
            self._write_manifest()

    def _write_manifest(self) -> None:
        data = json.dumps(self.manifest, indent=1, sort_keys=True).encode()
        atomic_write(self.dir / MANIFEST, lambda f: f.write(data))
