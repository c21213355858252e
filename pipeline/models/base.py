"""Ground pieces shared by model families."""

from __future__ import annotations

import dataclasses
import types
import typing

import mlx.core as mx
import mlx.nn as nn


class ConfigError(ValueError):
    """A model config lacks a required key or has a wrong value."""


class WeightsMismatch(ValueError):
    """Weights that do not fit the model built from its config: MLX's ``load_weights(strict=True)`` or
    ``nn.quantize`` refused them (missing, unexpected or wrongly shaped tensors); the text is MLX's."""


@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, config: dict):
        """Build from a HF ``config.json`` dict: unknown keys are ignored, missing required keys, values of
        the wrong type, integers (sizes, counts, lengths) below 1 and a ``num_key_value_heads`` that does not
        divide ``num_attention_heads`` raise ``ConfigError`` naming them."""
        config = _flat_rope(config)
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
            if int in _options(hints[name]) and isinstance(config.get(name), int) and config[name] < 1:
                raise ConfigError(f"model config key {name!r} must be at least 1, got {config[name]!r}")
        args = cls(**{k: v for k, v in config.items() if k in fields})
        heads, kv_heads = getattr(args, "num_attention_heads", None), getattr(args, "num_key_value_heads", None)
        if heads and kv_heads and heads % kv_heads:  # grouped-query attention shares each KV head by a group
            raise ConfigError(f"model config key 'num_key_value_heads' ({kv_heads}) must divide "
                              f"num_attention_heads ({heads})")
        return args

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends over a sliding window (HF ``layer_types``, ``check_layer_types``);
        a family without ``layer_types`` has none."""
        layer_types = getattr(self, "layer_types", None)
        return layer_types is not None and layer_types[layer] == "sliding_attention"


def check_layer_types(layer_types: list[str], n_layers: int, sliding_window: int | None) -> list[str]:
    """Check HF's per-layer attention kinds (``layer_types``: "sliding_attention" or "full_attention", one per
    layer) against ``num_hidden_layers`` (``n_layers``) and ``sliding_window``.

    Returns:
        ``layer_types``, unchanged.

    Raises:
        ConfigError: one line: a length other than ``n_layers``, an unsupported kind, or sliding layers with
            ``sliding_window`` None.
    """
    if len(layer_types) != n_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"unsupported layer_types {sorted(unknown)} (supported: sliding_attention, full_attention)")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ConfigError("layer_types has sliding_attention layers but the config has no sliding_window")
    return layer_types


def _flat_rope(config: dict) -> dict:
    """``config`` with transformers >= 5's ``rope_parameters`` also given under the keys of earlier configs
    (``rope_theta``, ``rope_scaling``, and Gemma 3's ``rope_local_base_freq``), which the model families
    read. ``rope_parameters`` is either one dict (``{"rope_type": ..., "rope_theta": ..., "factor": ...}``)
    or, for models whose layer types differ (Gemma 3), one per layer type (``full_attention``,
    ``sliding_attention``). A key the config sets itself (not null) wins. The input dict is not changed.

    Raises:
        ConfigError: ``rope_parameters`` (or one of its per-layer-type entries) is not a dict.
    """
    params = config.get("rope_parameters")
    if params is None:
        return config
    if not isinstance(params, dict):
        raise ConfigError(f"model config key 'rope_parameters' must be dict, got {params!r}")
    flat = dict(config)

    def give(key, value):
        if value is not None and flat.get(key) is None:
            flat[key] = value

    per_type = {k: params[k] for k in ("full_attention", "sliding_attention") if k in params}
    for kind, entry in per_type.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"model config key 'rope_parameters.{kind}' must be dict, got {entry!r}")
    full = per_type.get("full_attention", params if not per_type else None)
    if full is not None:
        give("rope_theta", full.get("rope_theta"))
        give("rope_scaling", full)
    if "sliding_attention" in per_type:
        give("rope_local_base_freq", per_type["sliding_attention"].get("rope_theta"))
    return flat


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


def concat_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One linear layer whose output is the concatenation of ``layers``' outputs for the same input:
    weights (and quantization scales and biases, and bias vectors) stacked along the output dimension,
    so one matmul kernel runs instead of ``len(layers)``. Each output row is computed from the same
    weights as before. None when the layers differ in kind, dtype, bias or quantization (bits, group).
    """
    first = layers[0]
    if len({type(m) for m in layers}) != 1 or len({"bias" in m for m in layers}) != 1:
        return None
    cat = lambda name: mx.concatenate([m[name] for m in layers])  # noqa: E731
    if type(first) is nn.Linear:
        if len({m.weight.dtype for m in layers}) != 1:
            return None
        out = nn.Linear(1, 1, bias=False)
        out.weight = cat("weight")
    elif type(first) is nn.QuantizedLinear:
        if len({(m.bits, m.group_size, m.mode, m.get("biases") is None) for m in layers}) != 1:
            return None
        out = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(out)
        out.group_size, out.bits, out.mode = first.group_size, first.bits, first.mode
        out.weight, out.scales = cat("weight"), cat("scales")
        out.biases = None if first.get("biases") is None else cat("biases")
        out.freeze()
    else:
        return None
    if "bias" in first:
        out.bias = cat("bias")
    return out


def fuse_projections(model: nn.Module) -> None:
    """Fuse, in place, the projections that read the same input (q/k/v; gate/up) in every module that
    offers it (a ``fuse()`` method): fewer kernel launches per token, same values. Call after loading
    (and dequantizing) the weights."""
    for _, m in model.named_modules():
        if hasattr(m, "fuse"):
            m.fuse()
    mx.eval(model.parameters())


class SwiGLU(nn.Module):
    """The gated SiLU MLP of Llama and Qwen: ``down(silu(gate(x)) * up(x))``; ``(..., dim) -> (..., dim)``.

    After ``fuse()`` gate and up run as one projection ``gate_up_proj``.
    """

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)

    def fuse(self) -> None:
        fused = concat_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            self.pop("gate_proj"), self.pop("up_proj")

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.silu(gate) * up)


def fuse_qkv(attn: nn.Module) -> None:
    """Replace ``attn``'s q/k/v projections by one ``qkv_proj`` when they can be fused."""
    fused = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    if fused is not None:
        attn.qkv_proj = fused
        attn.pop("q_proj"), attn.pop("k_proj"), attn.pop("v_proj")


def project_qkv(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``(q, k, v)`` projections of ``x`` ``(B, L, dim)``: flat ``(B, L, heads * head_dim)`` each,
    through ``qkv_proj`` when fused."""
    if "qkv_proj" in attn:
        nq, nk = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        return tuple(mx.split(attn.qkv_proj(x), [nq, nq + nk], axis=-1))
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def roped_qkv(attn: nn.Module, x: mx.array, offset, q_norm=None, k_norm=None) -> tuple[mx.array, mx.array, mx.array]:
    """Attention inputs from ``x`` ``(B, L, dim)``: ``q`` ``(B, n_heads, L, head_dim)``, ``k`` and ``v``
    ``(B, n_kv_heads, L, head_dim)``, q and k normed per head (``q_norm``/``k_norm``, Qwen3) and rotated by
    ``attn.rope`` at ``offset`` (an int, or an ``mx.array`` of one offset or one per row).

    q and k go through RoPE in ONE call, as ``n_heads + n_kv_heads`` heads of the same positions (with a
    fused ``qkv_proj`` and no norms they are one slice of its output, so nothing is copied): each head is
    rotated alone, so the values are those of two calls. On the CPU a call costs ~50 us whatever its size
    (mlx 0.32.4, 2-core x86_64; measured: (1, 9, 1, 64) 54 us, (1, 12, 1, 64) 52 us), and one call per
    layer instead of two took the default model's batch-1 decode from 12.5-13.5 to 14.0-15.0 GB/s of
    weights read (``pipeline bench``, eager, 2026-12-07).
    """
    B, L, _ = x.shape
    nh, nkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    if "qkv_proj" in attn and q_norm is None:
        qkv = attn.qkv_proj(x)
        qk = qkv[..., :(nh + nkv) * hd].reshape(B, L, nh + nkv, hd)
        v = qkv[..., (nh + nkv) * hd:]
    else:
        q, k, v = project_qkv(attn, x)
        q, k = q.reshape(B, L, nh, hd), k.reshape(B, L, nkv, hd)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        qk = mx.concatenate([q, k], axis=2)
    qk = attn.rope(qk.transpose(0, 2, 1, 3), offset=offset)
    return qk[:, :nh], qk[:, nh:], v.reshape(B, L, nkv, hd).transpose(0, 2, 1, 3)


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


def weight_format(model: nn.Module) -> str:
    """How ``model``'s matrices (its Linear and Embedding layers) are stored: ``"4-bit g64"`` (affine
    quantized: 4 bits, groups of 64 elements; another ``mode`` is named after it), ``"float16"`` (dense),
    or the kinds present joined by ``" + "`` (sorted) when layers differ. Norms and biases are left out
    (always dense). Two runs compare like for like only when their formats are equal."""
    kinds = set()
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            mode = getattr(m, "mode", "affine")
            kinds.add(f"{m.bits}-bit g{m.group_size}" + ("" if mode == "affine" else f" {mode}"))
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            kinds.add(str(m.weight.dtype).removeprefix("mlx.core."))
    return " + ".join(sorted(kinds))
