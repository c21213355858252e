"""Llama family vs mlx-lm's mlx_lm/models/llama.py on the same random weights."""

import pytest

from mlx_lm_parity import compare_with_mlx_lm

LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
}
LLAMA3 = {
    **LLAMA, "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
MISTRAL = {**LLAMA, "model_type": "mistral", "tie_word_embeddings": False, "head_dim": 32}


@pytest.mark.parametrize("config", [LLAMA, LLAMA3, MISTRAL], ids=["smollm2-like", "llama3-rope", "mistral"])
@pytest.mark.parametrize("quantization", [None, {"group_size": 64, "bits": 4}], ids=["fp32", "q4g64"])
def test_llama_matches_mlx_lm(config, quantization):
    compare_with_mlx_lm(config, quantization=quantization)
