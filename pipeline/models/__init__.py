"""Model families, one module per HF ``model_type``, and the code that builds one from weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import gemma3_text
from . import llama
from . import qwen2
from . import qwen3
from .base import ConfigError, WeightsMismatch

# HF model_type -> family module (each has ModelArgs and Model).
FAMILIES = {"llama": llama, "mistral": llama, "qwen2": qwen2, "qwen3": qwen3, "gemma3_text": gemma3_text}


def build_model(config: dict, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Instantiate the family named by ``config["model_type"]`` and load ``weights`` into it.

    Quantized tensors (a ``name.weight`` with ``name.scales`` and ``name.biases``) stay quantized with
    MLX affine quantization; the bits and group size are read off each tensor's shapes, so layers may
    differ (GGUF files mix 4-bit layers with an 8-bit embedding). Floating-point tensors, including
    quantization scales and biases, are cast to ``dtype``.

    Raises:
        ConfigError: unknown ``model_type``, a config lacking required keys or with a value of the wrong
            type (``BaseModelArgs.from_dict``), a ``quantization`` that is not a dict or not affine.
        WeightsMismatch: weights that do not match the model (missing or unexpected names, wrong shapes).
    """
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(FAMILIES))})")
    quantization = config.get("quantization") or {}
    if not isinstance(quantization, dict):
        raise ConfigError(f"model config key 'quantization' must be dict, got {quantization!r:.60}")
    mode = quantization.get("mode", "affine")
    if mode != "affine":
        raise ConfigError(f"unsupported quantization mode {mode!r} (supported: affine)")
    family = FAMILIES[model_type]
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = model.sanitize(weights)

    def quant_params(path: str, module: nn.Module):
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        w = weights[f"{path}.weight"]
        in_features = module.weight.shape[-1]
        group_size = in_features // scales.shape[-1]
        bits = w.shape[-1] * 32 // in_features
        return {"group_size": group_size, "bits": bits}

    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    try:
        nn.quantize(model, class_predicate=quant_params)
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise WeightsMismatch(str(e)) from e
    model.eval()
    mx.eval(model.parameters())
    return model


def dequantized_weight(m: nn.Module, dtype: mx.Dtype) -> mx.array:
    """The weight of a quantized Linear/Embedding ``m`` expanded to ``dtype`` (``scale * q + bias``),
    ``(output_dims, input_dims)`` (an embedding: ``(num_embeddings, dims)``)."""
    return mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
                         mode=m.mode).astype(dtype)


def dequantize_model(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace every quantized Linear/Embedding of ``model`` in place by a plain one of ``dtype``
    holding the same values (``scale * q + bias``), after mlx-lm's ``mlx_lm.utils.dequantize_model``.
    More memory, but on the CPU a float32 BLAS GEMV/GEMM beats MLX's quantized kernels
    (see ``pipeline._blas``)."""
    replaced = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = dequantized_weight(m, dtype)
            if isinstance(m, nn.QuantizedLinear):
                out_dims, in_dims = w.shape
                new = nn.Linear(in_dims, out_dims, bias="bias" in m)
                if "bias" in m:
                    new.bias = m.bias
            else:
                new = nn.Embedding(*w.shape)
            new.weight = w
            replaced.append((path, new))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())


class DensePrefillLinear(nn.QuantizedLinear):
    """A ``QuantizedLinear`` whose multi-token inputs (a prefill chunk, a scored continuation) are multiplied by
    its weights dequantized at the call (``mx.dequantize``, then a dense matmul), while a single token (the
    decode step's GEMV) keeps MLX's quantized kernel and its 4x fewer bytes. Same weights, same values up to
    the order of float sums.

    Why: on MLX's CUDA backend (0.32) a quantized matmul of more than one row is a CUTLASS kernel that NVRTC
    compiles on its first use, per tile height (16, 32 or 64 rows) and kernel kind: on an H200 with empty
    kernel caches the default model's warm-up and first prompt compiled four of them, 17-34 s each, 104 s in
    all (docs/BENCHMARKS.md, 2026-12-05), while ``mx.dequantize`` and the dense matmul (cuBLAS) need none.

    ``x``: ``(..., input_dims)``; returns ``(..., output_dims)`` in ``x``'s dtype.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if x.size <= x.shape[-1]:  # one row: the quantized GEMV
            return super().__call__(x)
        x = x @ dequantized_weight(self, x.dtype).T
        if "bias" in self:
            x = x + self["bias"]
        return x


class DensePrefillEmbedding(nn.QuantizedEmbedding):
    """A ``QuantizedEmbedding`` whose ``as_linear`` (a tied output projection) of more than one row uses its
    weights dequantized at the call, as ``DensePrefillLinear`` (which says why). ``x``: ``(..., dims)``;
    ``as_linear`` returns ``(..., num_embeddings)``."""

    def as_linear(self, x: mx.array) -> mx.array:
        if x.size <= x.shape[-1]:
            return super().as_linear(x)
        return x @ dequantized_weight(self, x.dtype).T


def dense_prefill(model: nn.Module) -> int:
    """Give every quantized Linear/Embedding of ``model`` (in place; call after ``fuse_projections``) the
    multi-token path of ``DensePrefillLinear`` / ``DensePrefillEmbedding``. Returns how many layers changed."""
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = DensePrefillLinear
            n += 1
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = DensePrefillEmbedding
            n += 1
    return n


def dequantized_nbytes(model: nn.Module, dtype: mx.Dtype) -> int:
    """Bytes the model's weights would take with every quantized layer expanded to ``dtype``."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n += m.weight.shape[0] * m.scales.shape[-1] * m.group_size
    quantized = {id(a) for _, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for a in (m.weight, m.scales, m.biases)}
    n += sum(v.size for _, v in tree_flatten(model.parameters()) if id(v) not in quantized)
    return n * dtype.size
