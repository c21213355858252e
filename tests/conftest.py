import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

# Before any test module imports mlx.core: pipeline loads OpenBLAS for MLX's CPU matmuls only if it comes
# first (pipeline._blas), as it does in `pipeline run` and in Ray actors. Without this, the test process's
# float results depended on which test file was collected first (a Ray run's sampled rows then differed
# from the in-process reference run's).
import pipeline  # noqa: F401, E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def closed_port() -> int:
    """A local TCP port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llamacpp_cases():
    """llama.cpp reference cases for the default model (provenance: tests/fixtures/README.md)."""
    return json.loads((FIXTURES / "llamacpp_smollm2.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="session")
def default_model_path():
    """The real default model file, fetched into $PIPELINE_HOME on first use."""
    from pipeline.resolve import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from pipeline import load_model

    return load_model(path=default_model_path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama model directory (``tiny_model.write_tiny_model``), one per test module."""
    from tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tiny_home(tiny_model, tmp_path_factory):
    """A temporary $PIPELINE_HOME for the module's runs (their model-hash cache; the tiny model needs no
    download). Modules that run jobs of the tiny model use it with ``pytestmark``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPELINE_HOME", str(tmp_path_factory.mktemp("pipeline-home")))
        yield


# --- real small and read-only file systems (tmpfs; skipped without root) -------------------------------


def _mount(target: Path, options: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")


def _umount(target: Path) -> None:
    if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(options)``: a fresh tmpfs mounted with ``options`` (e.g. ``size=1m``); unmounted at teardown."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = []

    def make(options: str) -> Path:
        target = tmp_path / f"mnt-{len(mounted)}"
        _mount(target, options)
        mounted.append(target)
        return target

    yield make
    for target in reversed(mounted):
        _umount(target)
