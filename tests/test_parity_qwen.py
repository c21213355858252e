"""Qwen2 and Qwen3 families vs mlx-lm's mlx_lm/models/qwen2.py and qwen3.py on the same random weights."""

import pytest

from mlx_lm_parity import compare_with_mlx_lm
from pipeline.models import build_model
from pipeline.models.base import ConfigError

QWEN2 = {
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
}
QWEN2_UNTIED = {**QWEN2, "tie_word_embeddings": False, "rope_theta": 10000.0}
# head_dim 32 != hidden / heads, as in real Qwen3 checkpoints.
QWEN3 = {**QWEN2, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": False}
QWEN3_ROPE_PARAMETERS = {  # transformers >= 5 layout
    **{k: v for k, v in QWEN3.items() if k != "rope_theta"}, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}


@pytest.mark.parametrize("config", [QWEN2, QWEN2_UNTIED, QWEN3, QWEN3_ROPE_PARAMETERS],
                         ids=["qwen2-tied", "qwen2-untied", "qwen3", "qwen3-rope-parameters"])
@pytest.mark.parametrize("quantization", [None, {"group_size": 64, "bits": 4}], ids=["fp32", "q4g64"])
def test_qwen_matches_mlx_lm(config, quantization):
    compare_with_mlx_lm(config, quantization=quantization)


@pytest.mark.parametrize("key", ["head_dim", "tie_word_embeddings", "max_position_embeddings", "rope_theta"])
def test_qwen3_config_missing_required_key(key):
    config = {k: v for k, v in QWEN3.items() if k != key}
    with pytest.raises(ConfigError, match=key):
        build_model(config, {})
