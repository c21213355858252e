"""Qwen2 decoder (Qwen2, Qwen2.5), following mlx-lm's mlx_lm/models/qwen2.py; also the building blocks of
Qwen3 (``pipeline.models.qwen3``), which differs only in its config and in its attention projections.

Weight names are the Hugging Face ones (``model.layers.N.self_attn.q_proj.bias``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..engine.cache import KVCache
from .base import BaseModelArgs, SwiGLU, drop_unused, fuse_qkv, output_logits, roped_qkv
from .rope import make_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rope_traditional: bool = False
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True

    # Architecture constants, not config keys (ClassVar keeps them out of from_dict).
    qkv_bias: ClassVar[bool] = True
    qk_norm: ClassVar[bool] = False
    mlp_bias: ClassVar[bool] = False

    @property
    def head_dim(self) -> int:
        # As in mlx-lm: a config's head_dim is ignored.
        return self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    """Grouped-query attention; q/k/v projections biased when ``args.qkv_bias``, o_proj never; with
    ``args.qk_norm`` an RMSNorm over ``head_dim`` on each query and key head before RoPE (Qwen3)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.n_heads, self.n_kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        bias = args.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.qk_norm = args.qk_norm
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = make_rope(head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling)

    def fuse(self) -> None:
        fuse_qkv(self)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        """``x`` ``(B, L, hidden)`` -> ``(B, L, hidden)``."""
        B, L, _ = x.shape
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        q, k, v = roped_qkv(self, x, cache.offset, *norms)
        mask = cache.make_mask(L)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[KVCache]) -> mx.array:
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)


class Model(nn.Module):
    """Causal LM.

    ``model(inputs, cache, last_only=False)``: inputs ``(B, L)`` integer token ids -> logits
    ``(B, L, vocab)`` in the weights' float dtype, or ``(B, 1, vocab)`` for the last position only when
    ``last_only``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Qwen2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[KVCache], last_only: bool = False) -> mx.array:
        return output_logits(self, self.model(inputs, cache), last_only)

    def make_cache(self) -> list[KVCache]:
        """One full cache per layer."""
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop tensors the model does not use (precomputed RoPE tables, a tied lm_head)."""
        return drop_unused(weights, self.args.tie_word_embeddings)
