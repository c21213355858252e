"""Configs saved by transformers >= 5 nest ``rope_theta`` and the RoPE scaling under ``rope_parameters`` (one
dict, or one per layer type for Gemma 3). A model built from such a config must equal the one built from the
same values in the earlier top-level keys (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``). The
nested configs here are written by transformers itself (``Config(...).to_dict()``)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_parity import reference_model
from pipeline.models import build_model
from pipeline.models.base import ConfigError

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 4096,
         "tie_word_embeddings": True}
LLAMA3 = {**SMALL, "model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}}
QWEN2 = {**SMALL, "model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
GEMMA3 = {**SMALL, "model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 64,
          "sliding_window": 16, "sliding_window_pattern": 2, "rope_theta": 1000000.0,
          "rope_local_base_freq": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


def saved_by_transformers(config: dict) -> dict:
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "gemma3_text": transformers.Gemma3TextConfig}[config["model_type"]]
    return cls(**{k: v for k, v in config.items() if k != "model_type"}).to_dict()


def logits(model, prompt) -> np.ndarray:
    out = model(mx.array([prompt]), model.make_cache())
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("config", [LLAMA3, QWEN2, GEMMA3], ids=["llama3-scaling", "qwen2-linear", "gemma3"])
def test_rope_parameters_give_the_model_of_the_top_level_keys(config):
    nested = saved_by_transformers(config)
    assert nested.get("rope_theta") is None and nested.get("rope_scaling") is None  # the layout under test
    assert "rope_parameters" in nested
    _, weights, _ = reference_model(config, seed=0)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 96, 300)]  # past Gemma 3's window
    want = logits(build_model(config, weights), prompt)
    np.testing.assert_array_equal(logits(build_model(nested, weights), prompt), want)
    # the scaling and bases matter here: without them the logits differ (the check above can fail)
    plain = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_local_base_freq", "rope_theta")}
    assert np.abs(logits(build_model(plain, weights), prompt) - want).max() > 1e-3


def test_a_key_given_at_the_top_level_wins_over_rope_parameters():
    _, weights, _ = reference_model(QWEN2, seed=0)
    both = {**QWEN2, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    prompt = list(range(1, 40))
    np.testing.assert_array_equal(logits(build_model(both, weights), prompt),
                                  logits(build_model(QWEN2, weights), prompt))


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "llama3"}, "'factor' as a positive number, got None"),
    ({"type": "linear"}, "'factor' as a positive number, got None"),
    ({"rope_type": "linear", "factor": "8"}, "got '8'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0}, "'low_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}, "!= high_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0}, "unsupported rope_scaling type 'yarn'"),
], ids=["llama3-no-factor", "linear-no-factor", "string-factor", "zero-low", "equal-freq-factors", "yarn"])
def test_bad_rope_scaling_is_a_config_error(scaling, match):
    with pytest.raises(ConfigError, match=match):
        build_model({**LLAMA3, "rope_scaling": scaling}, {})


@pytest.mark.parametrize("params", [[1, 2], {"full_attention": 5}], ids=["list", "per-type-not-a-dict"])
def test_rope_parameters_not_a_dict_is_a_config_error(params):
    with pytest.raises(ConfigError, match="rope_parameters"):
        build_model({**{k: v for k, v in GEMMA3.items() if k != "rope_theta"}, "rope_parameters": params}, {})
