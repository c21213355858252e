"""Use OpenBLAS for MLX's CPU matmuls on Linux.

The Linux ``mlx[cpu]`` wheel bundles netlib's reference BLAS (a float32 576x576 GEMV: ~300 us; a
40x576x576 GEMM: ~9 ms on a 2-core x86_64 machine). Loading OpenBLAS from the ``cmeel-openblas``
wheel with ``RTLD_GLOBAL`` before ``mlx.core`` makes MLX's ``cblas_*`` calls resolve to it
(measured: ~50 us and ~0.3 ms). This must run before ``mlx.core`` is first imported; set
``PIPELINE_BLAS=reference`` to keep the bundled BLAS.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

LOADED: str | None = None


def load_openblas() -> str | None:
    """Load OpenBLAS globally if on Linux and available; returns its path, or None."""
    global LOADED
    if LOADED or sys.platform != "linux" or os.environ.get("PIPELINE_BLAS") == "reference":
        return LOADED
    if "mlx.core" in sys.modules:
        return None
    for entry in sys.path:
        candidate = Path(entry or ".") / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if candidate.is_file():
            try:
                ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            LOADED = str(candidate)
            return LOADED
    return None
