"""Gemma 3 text family vs mlx-lm's mlx_lm/models/gemma3_text.py on the same random weights."""

import mlx.core as mx
import pytest

import mlx_lm_parity
from mlx_lm_parity import compare_with_mlx_lm
from pipeline.engine.cache import KVCache, RotatingKVCache
from pipeline.models import build_model
from pipeline.models.base import ConfigError
from pipeline.models.gemma3_text import Model, ModelArgs

# Layers 0 and 2 sliding (window 16, shorter than the 40-token prompt), 1 and 3 global.
GEMMA3 = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 2,
    "max_position_embeddings": 512, "rope_scaling": None,
}
# Linear RoPE scaling on the global layers (as Gemma 3 4B+ text configs).
GEMMA3_LINEAR = {**GEMMA3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
# HF's newer config form: layer_types and no sliding_window_pattern (mlx-lm reads neither and uses its
# default pattern 6, which gives the same layout for 6 layers).
GEMMA3_LAYER_TYPES = {
    **{k: v for k, v in GEMMA3.items() if k != "sliding_window_pattern"},
    "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}


@pytest.fixture
def tied(monkeypatch):
    """Make the harness drop ``lm_head`` from the weights (as real Gemma 3 checkpoints) and tie both
    models' output projections to the embedding through their ``sanitize``."""
    original = mlx_lm_parity.reference_model

    def reference_model(*args, **kwargs):
        ref, weights, config = original(*args, **kwargs)
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        ref.sanitize(weights)
        assert ref.tie_word_embeddings
        return ref, weights, config

    monkeypatch.setattr(mlx_lm_parity, "reference_model", reference_model)


@pytest.mark.parametrize("config", [GEMMA3, GEMMA3_LINEAR, GEMMA3_LAYER_TYPES],
                         ids=["pattern", "linear-rope", "layer-types"])
@pytest.mark.parametrize("quantization", [None, {"group_size": 64, "bits": 4}], ids=["fp32", "q4g64"])
def test_gemma3_matches_mlx_lm(config, quantization):
    compare_with_mlx_lm(config, quantization=quantization, prompt_len=40, decode_steps=30)


@pytest.mark.parametrize("quantization", [None, {"group_size": 64, "bits": 4}], ids=["fp32", "q4g64"])
def test_gemma3_tied_embeddings_match_mlx_lm(tied, quantization):
    compare_with_mlx_lm(GEMMA3, quantization=quantization, prompt_len=40, decode_steps=30)


def test_gemma3_embedding_scale_rounded_like_mlx_lm():
    # sqrt(72) is not a bfloat16 value: mlx-lm scales the embedding by its bfloat16 rounding.
    compare_with_mlx_lm({**GEMMA3, "hidden_size": 72}, prompt_len=40, decode_steps=30)


def test_gemma3_chunked_prefill_matches_one_chunk():
    _, weights, config = mlx_lm_parity.reference_model(GEMMA3)
    model = build_model(config, weights)
    mx.random.seed(3)
    prompt = mx.random.randint(0, GEMMA3["vocab_size"], (1, 40))
    whole = model(prompt, model.make_cache())
    cache = model.make_cache()
    parts = [model(prompt[:, a:b], cache) for a, b in [(0, 7), (7, 25), (25, 26), (26, 40)]]
    assert mlx_lm_parity.rel_err(mx.concatenate(parts, axis=1), whole) < 1e-5
    last = model(prompt, model.make_cache(), last_only=True)
    assert last.shape == (1, 1, GEMMA3["vocab_size"])
    assert mlx_lm_parity.rel_err(last, whole[:, -1:]) < 1e-6


def test_layer_types_override_pattern():
    layer_types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    args = ModelArgs.from_dict({**GEMMA3, "layer_types": layer_types})
    model = Model(args)
    caches = model.make_cache()
    assert [type(c) for c in caches] == [KVCache, RotatingKVCache, RotatingKVCache, KVCache]
    assert all(c.max_size == 16 for c in caches if isinstance(c, RotatingKVCache))
    bases = [layer.self_attn.rope.base for layer in model.model.layers]
    assert bases == [1_000_000.0, 10_000.0, 10_000.0, 1_000_000.0]
    pattern = Model(ModelArgs.from_dict(GEMMA3)).make_cache()
    assert [type(c) for c in pattern] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]


def test_bad_layer_types_rejected():
    with pytest.raises(ConfigError, match=r"^layer_types has 3 entries for 4 layers$"):
        ModelArgs.from_dict({**GEMMA3, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ConfigError, match=r"^unsupported layer_types \['chunked_attention'\] \(supported: "):
        ModelArgs.from_dict({**GEMMA3, "layer_types": ["chunked_attention"] * 4})
