"""Qwen3 decoder (dense), following mlx-lm's mlx_lm/models/qwen3.py: Qwen2's layers with an explicit
``head_dim``, no q/k/v biases, and an RMSNorm over ``head_dim`` on each query and key head before RoPE.
The modules are those of ``pipeline.models.qwen2``, switched by this ``ModelArgs``' class constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from . import qwen2
from .base import BaseModelArgs, ConfigError


@dataclass
class ModelArgs(BaseModelArgs):
    # Required keys as in mlx-lm (head_dim, max_position_embeddings and tie_word_embeddings included).
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    max_position_embeddings: int
    head_dim: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None = None

    # Architecture constants, not config keys (ClassVar keeps them out of from_dict).
    rope_traditional: ClassVar[bool] = False
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = True
    mlp_bias: ClassVar[bool] = False


class Model(qwen2.Model):
    """Causal LM; same interface as ``qwen2.Model`` (``model(inputs (B, L), cache, last_only)`` -> logits
    ``(B, L or 1, vocab)``, ``make_cache()``, ``sanitize()``)."""
