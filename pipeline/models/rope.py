"""RoPE variants named by HF ``rope_scaling``; formulas as in mlx-lm's ``mlx_lm/models/rope_utils.py``
(Llama 3 frequency smoothing from Meta's reference ``apply_scaling`` in llama-models)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .base import ConfigError


class Llama3RoPE(nn.Module):
    """RoPE with Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, short ones kept,
    a smooth blend between ``original_max_position_embeddings / low_freq_factor`` and ``/ high_freq_factor``."""

    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict):
        super().__init__()
        self.dims, self.traditional = dims, traditional
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        freqs = base ** (mx.arange(0, dims, 2) / dims)
        wavelens = 2 * math.pi * freqs
        freqs = mx.where(wavelens > old_len / low, freqs * factor, freqs)
        medium = (wavelens > old_len / high) & (wavelens < old_len / low)
        smooth = (old_len / wavelens - low) / (high - low)
        self._freqs = mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset,
                            freqs=self._freqs)


def make_rope(dims: int, base: float, traditional: bool = False, scaling: dict | None = None) -> nn.Module:
    """The RoPE module for a HF ``rope_scaling`` dict (None, "default", "linear" or "llama3").

    Raises:
        ConfigError: another scaling type.
    """
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return nn.RoPE(dims, traditional=traditional, base=base)
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    for key in ("factor",) + (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                              if kind == "llama3" else ()):
        value = scaling.get(key)
        if (value is None and key == "factor") or (value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0)):
            raise ConfigError(f"rope_scaling {kind!r} needs {key!r} as a positive number, got {value!r}")
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
        raise ConfigError("rope_scaling 'llama3' needs low_freq_factor != high_freq_factor")
    if kind == "linear":
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1.0 / scaling["factor"])
    if kind == "llama3":
        return Llama3RoPE(dims, base, traditional, scaling)
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
