"""Ground pieces shared by model families."""

from __future__ import annotations

import dataclasses
import types
import typing

import mlx.core as mx
import mlx.nn as nn


class ConfigError(ValueError):
    """A model config lacks a required key or has a wrong value."""


@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, config: dict):
        """Build from a HF ``config.json`` dict: unknown keys are ignored, missing required keys raise
        ``ConfigError`` naming them."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [
            name
            for name, f in fields.items()
            if name not in config and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"model config lacks required key(s): {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        for name in fields:
            if name in config and not _matches(config[name], hints[name]):
                raise ConfigError(f"model config key {name!r} must be {_type_name(hints[name])}, got {config[name]!r}")
        return cls(**{k: v for k, v in config.items() if k in fields})


def _options(tp) -> tuple:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _matches(value, tp) -> bool:
    for option in _options(tp):
        origin = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return True
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if origin not in (int, float) and isinstance(origin, type) and isinstance(value, origin):
            return True
        if option is typing.Any:
            return True
    return False


def _type_name(tp) -> str:
    return " or ".join("null" if o is type(None) else getattr(typing.get_origin(o) or o, "__name__", str(o))
                       for o in _options(tp))


class SwiGLU(nn.Module):
    """The gated SiLU MLP of Llama and Qwen: ``down(silu(gate(x)) * up(x))``; ``(..., dim) -> (..., dim)``."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def output_logits(lm: nn.Module, h: mx.array, last_only: bool) -> mx.array:
    """Logits from final hidden states ``h`` ``(B, L, hidden)``: through ``lm.lm_head`` when the model has
    one, else the tied embedding ``lm.model.embed_tokens``; only the last position when ``last_only``."""
    if last_only:
        h = h[:, -1:, :]
    if "lm_head" in lm:
        return lm.lm_head(h)
    return lm.model.embed_tokens.as_linear(h)


def drop_unused(weights: dict[str, mx.array], tied: bool) -> dict[str, mx.array]:
    """Drop tensors a model does not load: precomputed RoPE tables, and ``lm_head`` when tied."""
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if tied:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    return weights
