"""Dense prefill matmuls (``pipeline.models.dense_prefill``, on by ``load_model`` on a CUDA GPU for small
quantized models): inputs of several rows go through the layer's weights dequantized at the call, one row
through MLX's quantized kernel. Checked on the CPU against mlx-lm's models and MLX's own quantized layers."""

from __future__ import annotations

import pytest

import pipeline  # noqa: F401  (OpenBLAS before mlx.core loads, as in `pipeline run`)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from mlx_lm_parity import compare_with_mlx_lm, reference_model
from pipeline import loader
from pipeline.models import DensePrefillEmbedding, DensePrefillLinear, build_model, dense_prefill
from test_parity_llama import LLAMA, MISTRAL
from test_parity_qwen import QWEN2, QWEN3

CONFIGS = [("llama-tied", LLAMA), ("mistral-untied", MISTRAL), ("qwen2-qkv-bias", QWEN2), ("qwen3-qk-norm", QWEN3)]
QUANT = [{"group_size": 32, "bits": 4}, {"group_size": 64, "bits": 8}]
# On MLX's CUDA backend float32 matmuls (cuBLAS) and the quantized kernel sum in different orders and
# precisions: on an H100 the layer below differed by up to ~3e-4; on the CPU by 0 to 1e-6.
TOL = 2e-3 if mx.default_device() == mx.gpu else 1e-4


@pytest.mark.parametrize("name, config", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("quantization", QUANT, ids=["q4g32", "q8g64"])
def test_model_with_dense_prefill_matches_mlx_lm(name, config, quantization):
    out = compare_with_mlx_lm(config, quantization=quantization, fuse=True, dense_prefill=True)
    assert out["prefill_err"] < 1e-4 and len(out["tokens"]) == 20


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_dense_one_row_quantized(bits, group_size, bias):
    mx.random.seed(3)
    q = nn.QuantizedLinear(128, 96, bias=bias, group_size=group_size, bits=bits)
    if bias:
        q.bias = mx.random.normal((96,))
    x = mx.random.normal((2, 7, 128))
    want_rows, want_one = q(x), q(x[:1, :1])
    layer = nn.Sequential(q)
    assert dense_prefill(layer) == 1
    assert type(layer.layers[0]) is DensePrefillLinear and isinstance(layer.layers[0], nn.QuantizedLinear)
    got_rows = layer(x)
    assert got_rows.shape == (2, 7, 96) and got_rows.dtype == x.dtype
    assert mx.allclose(got_rows, want_rows, atol=TOL, rtol=TOL).item()
    # the single row is MLX's quantized GEMV itself, bit for bit
    assert mx.array_equal(layer(x[:1, :1]), want_one).item()
    # and the several rows really are the dequantized weights' product (not the quantized kernel again)
    w = mx.dequantize(q.weight, q.scales, q.biases, group_size=group_size, bits=bits)
    dense = x @ w.T + (q.bias if bias else 0)
    assert mx.array_equal(got_rows, dense).item()


def test_tied_embedding_as_linear_rows_dense():
    mx.random.seed(4)
    e = nn.QuantizedEmbedding(300, 64, group_size=32, bits=4)
    h = mx.random.normal((1, 5, 64))
    want_rows, want_one = e.as_linear(h), e.as_linear(h[:, -1:])
    ids = mx.array([[1, 299, 7]])
    want_lookup = e(ids)
    m = nn.Sequential(e)
    assert dense_prefill(m) == 1 and type(m.layers[0]) is DensePrefillEmbedding
    assert mx.allclose(m.layers[0].as_linear(h), want_rows, atol=TOL, rtol=TOL).item()
    assert mx.array_equal(m.layers[0].as_linear(h[:, -1:]), want_one).item()
    assert mx.array_equal(m.layers[0](ids), want_lookup).item()  # the lookup is unchanged


def test_dense_prefill_leaves_float_layers_and_counts_quantized_ones():
    _, weights, config = reference_model(LLAMA, {"group_size": 32, "bits": 4})
    model = build_model(config, weights)
    quantized = sum(type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding) for _, m in model.named_modules())
    assert quantized > 0 and dense_prefill(model) == quantized
    assert not any(type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding) for _, m in model.named_modules())
    assert dense_prefill(model) == 0  # already done: nothing left to change
    _, weights, config = reference_model(LLAMA, None)
    assert dense_prefill(build_model(config, weights)) == 0


def test_load_model_turns_it_on_only_where_the_rule_says(default_model_path, monkeypatch):
    # the real default model (Q4_1 GGUF: 4-bit weights kept with dequantize=False); the rule: a CUDA GPU and
    # a small model, so on a CPU it says no
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    lm = pipeline.load_model(path=default_model_path, dequantize=False)
    kinds = {type(m) for _, m in lm.model.named_modules()}
    if on_cuda:
        assert DensePrefillLinear in kinds and nn.QuantizedLinear not in kinds
    else:
        assert nn.QuantizedLinear in kinds and DensePrefillLinear not in kinds
    # the wiring: where the rule says yes, the quantized layers change; dequantized weights have none left
    monkeypatch.setattr(loader, "should_dense_prefill", lambda model, dtype: True)
    lm = pipeline.load_model(path=default_model_path, dequantize=False)
    kinds = {type(m) for _, m in lm.model.named_modules()}
    assert DensePrefillLinear in kinds and nn.QuantizedLinear not in kinds
    ids = lm.tokenizer.encode("The capital of France is")
    out = lm.engine.generate(ids, pipeline.engine.GenerateParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4 and "Paris" in lm.tokenizer.decode(out.token_ids)
    lm = pipeline.load_model(path=default_model_path, dequantize=False, batch_size=4)  # batched: never
    assert not any(isinstance(m, DensePrefillLinear) for _, m in lm.model.named_modules())
    lm = pipeline.load_model(path=default_model_path, dequantize=True)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in lm.model.named_modules())


def test_the_rule_is_false_off_cuda_and_for_large_models(monkeypatch):
    _, weights, config = reference_model(LLAMA, {"group_size": 32, "bits": 4})
    model = build_model(config, weights)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert loader.should_dense_prefill(model, mx.float16) == on_cuda
    monkeypatch.setattr(loader, "DENSE_PREFILL_MAX_BYTES", 0)
    assert not loader.should_dense_prefill(model, mx.float16)
