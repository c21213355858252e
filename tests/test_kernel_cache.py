"""Where compiled GPU kernels are kept (pipeline/_kernel_cache.py): ``import pipeline`` in a fresh process
points the CUDA driver's cache (and, on MLX's CUDA backend, MLX's PTX cache) under ``$PIPELINE_HOME/kernels``
where the variables are unset, and leaves a user's own settings alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from pipeline import _kernel_cache

VARS = ("CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE", "MLX_PTX_CACHE_DIR")
linux = pytest.mark.skipif(sys.platform != "linux", reason="the CUDA backend's platform")


def env_after_import(home, **preset) -> dict:
    """The three variables as a fresh ``python -c 'import pipeline'`` leaves them."""
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(PIPELINE_HOME=str(home), **preset)
    code = f"import json, os, pipeline; print(json.dumps({{k: os.environ.get(k) for k in {VARS!r}}}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux
def test_import_points_the_caches_under_pipeline_home(tmp_path):
    got = env_after_import(tmp_path)
    assert got["CUDA_CACHE_PATH"] == str(tmp_path / "kernels" / "cuda")
    assert got["CUDA_CACHE_MAXSIZE"] == str(4 * 1024**3)
    if mx.cuda.is_available():  # one directory per MLX version and GPU architecture
        arch = mx.device_info()["architecture"]
        assert got["MLX_PTX_CACHE_DIR"] == str(tmp_path / "kernels" / f"mlx-{mx.__version__}" / arch)
    else:
        assert got["MLX_PTX_CACHE_DIR"] is None  # no CUDA backend: MLX compiles nothing with NVRTC


@linux
def test_a_users_own_settings_are_kept(tmp_path):
    mine = {"CUDA_CACHE_PATH": str(tmp_path / "nv"), "CUDA_CACHE_MAXSIZE": "1000",
            "MLX_PTX_CACHE_DIR": str(tmp_path / "p")}
    assert env_after_import(tmp_path / "home", **mine) == mine


def test_ptx_cache_dir_names_version_and_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    assert _kernel_cache.ptx_cache_dir("0.32.4", "sm_90") == tmp_path / "kernels" / "mlx-0.32.4" / "sm_90"
    monkeypatch.delenv("PIPELINE_HOME")
    assert _kernel_cache.kernels_home() == _kernel_cache.Path.home() / ".cache" / "pipeline" / "kernels"
