"""Where compiled GPU kernels are kept between runs: under ``$PIPELINE_HOME/kernels`` (default
``~/.cache/pipeline/kernels``), beside the models, instead of the system temp directory.

On MLX's CUDA backend a kernel is compiled twice the first time a process needs it: NVRTC turns the CUDA
source (MLX's JIT kernels, compiled graphs, the fused step's custom kernels, each per shape) into PTX, which
MLX keeps in ``MLX_PTX_CACHE_DIR`` (MLX's default: ``<temp dir>/mlx/<mlx version>/ptx``, so ``/tmp``, gone
with a reboot or a fresh container); the CUDA driver then turns PTX into machine code, which it keeps in
``CUDA_CACHE_PATH`` (the driver's default: ``~/.nv/ComputeCache``) up to ``CUDA_CACHE_MAXSIZE`` bytes. A job on a
machine with neither cache spends minutes compiling before its rows run at full speed (docs/BENCHMARKS.md);
a job that finds both starts at once. So that a kept ``$PIPELINE_HOME`` (a mounted volume, a CI cache) keeps the
kernels too, ``import pipeline`` sets, on Linux and only where the variable is unset:

- ``CUDA_CACHE_PATH`` = ``$PIPELINE_HOME/kernels/cuda`` and ``CUDA_CACHE_MAXSIZE`` = 4 GiB (the driver's
  largest, CUDA Programming Guide, "CUDA Environment Variables"), before MLX starts the driver;
- ``MLX_PTX_CACHE_DIR`` = ``$PIPELINE_HOME/kernels/mlx-<mlx version>/<architecture>`` (``sm_90`` on an H100 or
  H200, from ``mx.device_info()``) where MLX's CUDA backend is available: MLX names its entries by kernel and
  shape only, so PTX for one GPU architecture must not be handed to another.

Set any of these variables yourself to keep your own location (MLX reads ``MLX_PTX_CACHE_DIR`` at its first
compile, the driver ``CUDA_CACHE_*`` when it starts).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .resolve import pipeline_home  # standard library only: safe before mlx.core loads

CUDA_CACHE_MAXSIZE = 4 * 1024**3  # bytes: the largest the CUDA driver accepts


def kernels_home() -> Path:
    """``$PIPELINE_HOME/kernels`` (``pipeline.resolve.pipeline_home``)."""
    return pipeline_home() / "kernels"


def ptx_cache_dir(mlx_version: str, architecture: str) -> Path:
    """The directory given to MLX as ``MLX_PTX_CACHE_DIR``: one per MLX version and GPU architecture."""
    return kernels_home() / f"mlx-{mlx_version}" / architecture


def set_driver_cache() -> None:
    """Point the CUDA driver's kernel cache under ``kernels_home()`` where the variables are unset (Linux:
    the platform of MLX's CUDA backend). Call before anything imports ``mlx.core``."""
    if sys.platform != "linux":
        return
    os.environ.setdefault("CUDA_CACHE_PATH", str(kernels_home() / "cuda"))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(CUDA_CACHE_MAXSIZE))


def set_ptx_cache(mx) -> None:
    """Point MLX's PTX cache at ``ptx_cache_dir`` where ``MLX_PTX_CACHE_DIR`` is unset and MLX's CUDA backend is
    available (``mx``: the imported ``mlx.core``); elsewhere, or if MLX cannot say its architecture, nothing
    changes (MLX keeps its default)."""
    if sys.platform != "linux" or "MLX_PTX_CACHE_DIR" in os.environ:
        return
    try:
        if not mx.cuda.is_available():
            return
        arch = mx.device_info().get("architecture")
    except (AttributeError, RuntimeError):
        return
    if isinstance(arch, str) and arch:
        os.environ["MLX_PTX_CACHE_DIR"] = str(ptx_cache_dir(mx.__version__, arch))
