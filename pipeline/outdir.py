"""The output directory as a place to write: one run at a time (``RunLock``), and writable before the
model is resolved or loaded (``check_writable``).

``pipeline run`` (the Ray driver too) holds an exclusive ``flock`` on ``OUT_DIR/.lock`` for the whole
run, taken before ``shards.ShardStore`` removes leftover files (which may be what another run is about to
commit). The file records the holder's pid, host and start time, for the refusal of a second run
(``output.dir 'runs/eval' is in use by another run (pid 4242 on node1, since 2026-01-05T10:00:00Z)``) and
for the note of a run taking over the lock of one that died. The kernel drops the lock when its holder
dies, so a killed run never blocks the next; a clean release removes the file. ``pipeline status``,
``export`` and ``report`` take no lock: the manifest is replaced atomically and they read only the shards
it lists.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

from .shards import OutputError, disk_full

LOCK = ".lock"
CONTENDED_S = 0.5  # a run retries a held lock this long: rides out check_not_in_use's momentary shared lock
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # flock(2) on a file system without locks

log = logging.getLogger(__name__)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _holder(fd: int) -> dict | None:
    """The holder record of the lock file open as ``fd``; None when empty (a holder that has not written
    it yet) or unreadable."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def holder_text(holder: dict | None) -> str:
    """``pid N on HOST, since T`` of a lock's holder record (``its pid is not recorded yet`` without one)."""
    return (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}" if holder
            else "its pid is not recorded yet")


def in_use_error(out_dir: str | Path, holder: dict | None) -> OutputError:
    """``output.dir '...' is in use by another run (pid N on HOST, since T)``."""
    return OutputError(f"output.dir {str(out_dir)!r} is in use by another run ({holder_text(holder)})")


def _cannot_write(out_dir: str | Path, what: str, e: OSError) -> Exception:
    """``e`` (a failed write of ``what`` in ``out_dir``) as ``shards.DiskFullError`` when no space or quota is
    left, else as ``OutputError``: ``output.dir '...' is not writable: Read-only file system``."""
    return disk_full(e, out_dir, what) or OutputError(
        f"output.dir {str(out_dir)!r} is not writable: {e.strerror or e}")


def _alive(pid) -> bool:
    """Whether process ``pid`` of this host exists (signal 0 reaches it, or it is another user's)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_held(out_dir: str | Path) -> tuple[bool, dict | None]:
    """Whether a run holds ``out_dir``'s lock, and its holder record (None while it has not written it), changing
    nothing. It takes a shared ``flock`` on the lock file and drops it at once; a run starting in that instant
    retries for ``CONTENDED_S``. No lock file, an unreadable one, or a file system without locks counts as not
    held (``RunLock`` decides)."""
    try:
        fd = os.open(Path(out_dir) / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True, _holder(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    return False, None


def check_not_in_use(out_dir: str | Path) -> None:
    """Refuse an output dir whose lock a run holds (``lock_held``), changing nothing (``pipeline validate``, and
    ``pipeline run`` before it resolves the model or writes).

    Raises:
        OutputError: ``output.dir '...' is in use by another run (pid N on HOST, since T)``.
    """
    held, holder = lock_held(out_dir)
    if held:
        raise in_use_error(out_dir, holder)


def check_writable(out_dir: str | Path) -> None:
    """Refuse an output dir that cannot be written: a real write, since permission bits tell nothing for
    root, nor about a read-only mount. Creates a temporary file holding one byte in ``out_dir``, or where it
    does not exist yet in its nearest existing parent (nothing else is created), and removes it.

    Raises:
        OutputError: ``output.dir '...' is not writable: Read-only file system`` (or ``Permission denied``, ...,
            or a parent that is a file: ``a is a file, not a directory``).
        DiskFullError: not one byte fits (ENOSPC, EDQUOT).
    """
    where = Path(out_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        if where == Path(out_dir):
            return  # the output dir itself is a file: shards.check_output_dir names it
        raise OutputError(f"output.dir {str(out_dir)!r} is not writable: {where} is a file, not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".writable-", suffix=".tmp", dir=where)
    except OSError as e:
        raise _cannot_write(out_dir, "a test file", e) from None
    try:
        os.write(fd, b"\n")
    except OSError as e:
        raise _cannot_write(out_dir, "a test file", e) from None
    finally:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)  # a run starting there may have removed it as a leftover


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a releasing holder unlinks it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


class RunLock:
    """One run's exclusive lock on its output directory, a context manager: ``flock(LOCK_EX | LOCK_NB)`` on
    ``OUT_DIR/.lock`` (the directory is created if missing), held until ``release``, the end of the ``with``
    block, or the death of the process (the kernel drops it). The file then holds this process's pid, host
    and start time (JSON, ``holder``).

    A clean release removes the file, so a record found on taking the lock was left by a run that died
    holding it: the take-over is said through ``note``. A run that opened the file while its holder removed
    it locks the new file instead (the inode is compared after locking). The descriptor is close-on-exec;
    a child forked without exec would share the lock, and pipeline forks none while it holds it.

    A file system without ``flock`` (ENOLCK, e.g. an NFSv3 mount without a lock manager, some FUSE file
    systems): the run goes on unlocked after a warning, and is refused only by a record naming a live process
    of this host. The lock guards against a mistake (two runs started on one directory), not against crashes:
    atomic shard and manifest writes keep the committed rows valid either way, and refusing would make such
    mounts unusable for a protection their users may not need.

    Args:
        out_dir: the output directory.
        note: where the take-over note goes (one line).

    Attributes:
        holder: ``{"pid", "host", "started"}`` of this run.
        locked: the ``flock`` is held (False on a file system without locks).

    Raises:
        OutputError: another run holds the lock (``in_use_error``), or the directory or its lock file cannot
            be made (``output.dir '...' is not writable: ...``).
        DiskFullError: no space for the lock file's record.
    """

    def __init__(self, out_dir: str | Path, note=print):
        self.dir = Path(out_dir)
        self.path = self.dir / LOCK
        self.locked = False
        self._fd: int | None = self._open_locked()
        previous = _holder(self._fd)
        host = socket.gethostname()
        if previous is not None:
            if not self.locked and previous.get("host") == host and _alive(previous.get("pid")):
                os.close(self._fd)  # not ours to remove
                self._fd = None
                raise in_use_error(self.dir, previous)
            gone = ("which is no longer running" if previous.get("host") == host and not _alive(previous.get("pid"))
                    else "which no longer holds it")
            note(f"output.dir {str(self.dir)!r}: taking over the lock of pid {previous.get('pid')} on "
                 f"{previous.get('host')} (since {previous.get('started')}), {gone}")
        self.holder = {"pid": os.getpid(), "host": host, "started": _now()}
        data = (json.dumps(self.holder) + "\n").encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
            os.fsync(self._fd)
        except OSError as e:
            self.release()
            raise _cannot_write(self.dir, LOCK, e) from None

    def _open_locked(self) -> int:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _cannot_write(self.dir, "the directory", e) from None
        deadline = time.monotonic() + CONTENDED_S
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as e:
                raise _cannot_write(self.dir, LOCK, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise in_use_error(self.dir, holder) from None
                time.sleep(0.05)
                continue
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise
                log.warning("output.dir %r: this file system does not support locks (flock: %s); running "
                            "unlocked: a second run started on this directory on another host would not be refused",
                            str(self.dir), e.strerror)
                return fd
            if _same_file(fd, self.path):
                self.locked = True
                return fd
            os.close(fd)  # its holder removed it between our open and flock: lock the file there now

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order: a run waiting on the old file finds it
        gone once it gets the lock). Idempotent; a file that cannot be removed (a read-only remount) is left,
        and the next run takes it over with a note."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
