"""Whether MLX runs on its CUDA backend: the one condition every custom kernel and CUDA decode step checks."""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    """True where MLX's CUDA backend is present and the default device is its GPU (a default device set to the
    CPU, as tests and CPU jobs do, gives False)."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu
