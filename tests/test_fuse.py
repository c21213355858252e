"""Fused projections (q/k/v as one, gate/up as one) against mlx-lm's unfused models, and the layout
they leave."""

import pytest
from mlx.utils import tree_flatten

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_parity import compare_with_mlx_lm, reference_model
from pipeline.models import build_model
from pipeline.models.base import concat_linears, fuse_projections
from test_parity_gemma3 import GEMMA3
from test_parity_llama import LLAMA, MISTRAL
from test_parity_qwen import QWEN2, QWEN3

CONFIGS = [("llama", LLAMA), ("mistral", MISTRAL), ("qwen2-qkv-bias", QWEN2), ("qwen3-qk-norm", QWEN3)]


@pytest.mark.parametrize("name, config", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("quantization", [None, {"group_size": 64, "bits": 4}], ids=["fp32", "q4g64"])
def test_fused_model_matches_mlx_lm(name, config, quantization):
    compare_with_mlx_lm(config, quantization=quantization, fuse=True)


@pytest.mark.parametrize("quantization", [None, {"group_size": 32, "bits": 4}], ids=["fp32", "q4g32"])
def test_fused_layout_and_identical_logits(quantization):
    _, weights, config = reference_model(QWEN2, quantization)
    plain, fused = build_model(config, weights), build_model(config, weights)
    fuse_projections(fused)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert "qkv_proj" in attn and not any(k in attn for k in ("q_proj", "k_proj", "v_proj"))
    assert "gate_up_proj" in mlp and "gate_proj" not in mlp and "up_proj" not in mlp
    assert isinstance(attn.qkv_proj, nn.QuantizedLinear if quantization else nn.Linear)
    assert "bias" in attn.qkv_proj  # Qwen2's q/k/v biases travel along
    n_plain = sum(v.size for _, v in tree_flatten(plain.parameters()))
    assert sum(v.size for _, v in tree_flatten(fused.parameters())) == n_plain
    ids = mx.array([[3, 17, 42, 9, 88, 5, 61]])
    a, b = plain(ids, plain.make_cache()), fused(ids, fused.make_cache())
    # same dot products; a BLAS may block a wider float matrix differently (last-bit differences)
    assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()


def test_layers_that_differ_are_not_fused():
    a, b = nn.Linear(64, 32), nn.QuantizedLinear(64, 32, group_size=32, bits=4)
    assert concat_linears([a, b]) is None
    assert concat_linears([nn.QuantizedLinear(64, 32, group_size=32, bits=4),
                           nn.QuantizedLinear(64, 32, group_size=32, bits=8)]) is None
    assert concat_linears([nn.Linear(64, 32), nn.Linear(64, 32, bias=False)]) is None


def test_gemma3_keeps_its_layout():
    _, weights, config = reference_model(GEMMA3)
    model = build_model(config, weights)
    fuse_projections(model)
    assert "q_proj" in model.model.layers[0].self_attn and "gate_proj" in model.model.layers[0].mlp
