"""Gemma 3 text decoder (``model_type`` "gemma3_text"), following mlx-lm's mlx_lm/models/gemma3_text.py.

Sliding-window layers (local RoPE base, ``RotatingKVCache``) alternate with global layers (``rope_theta``
and ``rope_scaling``, full ``KVCache``). Weight names are the Hugging Face ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..engine.cache import KVCache, RotatingKVCache
from .base import BaseModelArgs, ConfigError, check_layer_types, output_logits, roped_qkv
from .rope import make_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    head_dim: int = 256
    num_key_value_heads: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    max_position_embeddings: int = 32768
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        if self.layer_types is None:
            # Every ``sliding_window_pattern``-th layer is global (HF's default layer_types).
            self.layer_types = [
                "full_attention" if (i + 1) % self.sliding_window_pattern == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        if self.attn_logit_softcapping is not None or self.final_logit_softcapping is not None:
            raise ConfigError("logit soft-capping is not supported for gemma3_text")


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the learned weight is an offset from 1 (scale ``1 + weight``)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


def add_residual(x: mx.array, y: mx.array) -> mx.array:
    """``x + y``; in float16 summed in float32 and clipped to the float16 range, as mlx-lm does."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        dim, self.n_heads, self.n_kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, args.rms_norm_eps)
        if args.is_sliding(layer):
            self.rope = make_rope(head_dim, args.rope_local_base_freq)
        else:
            self.rope = make_rope(head_dim, args.rope_theta, scaling=args.rope_scaling)

    def __call__(self, x: mx.array, cache: KVCache | RotatingKVCache) -> mx.array:
        B, L, _ = x.shape
        q, k, v = roped_qkv(self, x, cache.offset, self.q_norm, self.k_norm)
        mask = cache.make_mask(L)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(dim, args.intermediate_size)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def __call__(self, x: mx.array, cache: KVCache | RotatingKVCache) -> mx.array:
        h = add_residual(x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache)))
        return add_residual(h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        h = self.embed_tokens(inputs)
        # mlx-lm rounds the scale sqrt(hidden_size) to bfloat16 before casting it to the embedding dtype.
        h = h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)


class Model(nn.Module):
    """Causal LM.

    ``model(inputs, cache, last_only=False)``: inputs ``(B, L)`` integer token ids -> logits
    ``(B, L, vocab)`` in the weights' float dtype, or ``(B, 1, vocab)`` for the last position only when
    ``last_only``. The output projection is the embedding (tied) unless the weights have ``lm_head``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Gemma3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_word_embeddings = False

    def __call__(self, inputs: mx.array, cache: list, last_only: bool = False) -> mx.array:
        return output_logits(self, self.model(inputs, cache), last_only)

    def make_cache(self) -> list:
        """One cache per layer: ``RotatingKVCache(sliding_window)`` for sliding layers, ``KVCache`` for
        global ones."""
        return [
            RotatingKVCache(self.args.sliding_window) if self.args.is_sliding(i) else KVCache()
            for i in range(self.args.num_hidden_layers)
        ]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Tie the output projection to the embedding when the weights have no ``lm_head.weight``
        (as mlx-lm does; Gemma 3 checkpoints ship without one)."""
        if "lm_head.weight" not in weights:
            self.tie_word_embeddings = True
            self.pop("lm_head")
        return weights
