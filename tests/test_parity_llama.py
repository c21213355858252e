"""Llama family vs mlx-lm's mlx_lm/models/llama.py on the same random weights."""

import re

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


# Llama with sliding-window layers (transformers' layer_types), 40 prompt tokens over a window of 8.
SLIDING = {**LLAMA, "num_hidden_layers": 3, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def test_llama_sliding_layers_match_mlx_lm():
    """mlx-lm's llama.py gives the layer_types "sliding_attention" layers a RotatingKVCache(sliding_window);
    ours ran them as full attention."""
    compare_with_mlx_lm(SLIDING)


@pytest.mark.parametrize("change,error", [
    ({"sliding_window": None}, "layer_types has sliding_attention layers but the config has no sliding_window"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types has 2 entries for 3 layers"),
    ({"layer_types": ["chunked_attention"] * 3}, "unsupported layer_types ['chunked_attention']"),
])
def test_llama_bad_layer_types_are_one_line_config_errors(change, error):
    from pipeline.models import build_model
    from pipeline.models.base import ConfigError

    with pytest.raises(ConfigError, match=re.escape(error)) as e:
        build_model({**SLIDING, **change}, {}, None)
    assert "\n" not in str(e.value), str(e.value)


def test_llama_and_gemma3_share_one_layer_types_check():
    """llama.py and gemma3_text.py each carried a copy of these checks (and of ``is_sliding``)."""
    from pipeline.models import gemma3_text, llama
    from pipeline.models.base import BaseModelArgs, ConfigError, check_layer_types

    kinds = ["sliding_attention", "full_attention"]
    assert check_layer_types(kinds, 2, 8) == kinds and check_layer_types(["full_attention"], 1, None)
    for args, n, window, error in [(["full_attention"], 2, None, "layer_types has 1 entries for 2 layers"),
                                   (["chunked_attention"], 1, None, "unsupported layer_types ['chunked_attention']"),
                                   (kinds, 2, None, "layer_types has sliding_attention layers but the config has no "
                                                    "sliding_window")]:
        with pytest.raises(ConfigError, match=re.escape(error)):
            check_layer_types(args, n, window)
    for family in (llama, gemma3_text):
        assert "is_sliding" not in vars(family.ModelArgs) and family.ModelArgs.is_sliding is BaseModelArgs.is_sliding
