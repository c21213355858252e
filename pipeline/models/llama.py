"""Llama decoder (also SmolLM2 and Mistral), following mlx-lm's mlx_lm/models/llama.py.

Weight names are the Hugging Face ones (``model.layers.N.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..engine.cache import KVCache, RotatingKVCache
from .base import BaseModelArgs, SwiGLU, check_layer_types, drop_unused, fuse_qkv, output_logits, roped_qkv
from .rope import make_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.n_heads, self.n_kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.rope = make_rope(self.head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling)

    def fuse(self) -> None:
        fuse_qkv(self)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        B, L, _ = x.shape
        q, k, v = roped_qkv(self, x, cache.offset)
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


class LlamaModel(nn.Module):
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
    ``last_only`` (prefill needs no other logits, and the vocab projection is the largest matmul).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[KVCache], last_only: bool = False) -> mx.array:
        return output_logits(self, self.model(inputs, cache), last_only)

    def make_cache(self) -> list[KVCache | RotatingKVCache]:
        """One cache per layer: ``RotatingKVCache(sliding_window)`` for the ``layer_types`` entries
        "sliding_attention" (as mlx-lm's llama.py), ``KVCache`` for the others (all of them by default)."""
        return [RotatingKVCache(self.args.sliding_window) if self.args.is_sliding(i) else KVCache()
                for i in range(self.args.num_hidden_layers)]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop tensors the model does not use (precomputed RoPE tables, a tied lm_head)."""
        return drop_unused(weights, self.args.tie_word_embeddings)
