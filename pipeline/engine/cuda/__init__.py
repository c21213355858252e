"""The fused CUDA decode step (batch 1; Llama, Qwen2, Qwen 3, Gemma 3): which decoder runs a model, or why none can.

Why: on an NVIDIA H200 (mlx 0.32.4) batch-1 decode of a small model is bound by the host, not the GPU:
MLX launches one kernel per primitive (~550 per token for SmolLM2-135M, ~7 us of host time each) while
the GPU is busy 1.5 of 4 ms per token (docs/BENCHMARKS.md). ``mx.compile`` does not merge them. This
package runs a decoder layer as five custom kernels (``mx.fast.cuda_kernel``) instead of ~18:

1. ``qkv``: RMSNorm of the hidden state, the fused q/k/v projection, bias, RoPE, and the new key and
   value written into slot ``pos`` of the layer's cache buffers (in place);
2. ``attn``: attention of the query over cache slots ``0..pos`` (a ``RotatingKVCache``: the ring's
   ``min(pos + 1, max_size)`` filled slots, exactly the query's window; split over 128-key chunks; the
   last chunk of each head to finish combines the partial softmaxes, as in flash-decoding);
3. ``o_proj`` + residual add;
4. RMSNorm + the fused gate/up projection + SiLU(gate) * up;
5. ``down_proj`` + residual add;

plus one kernel for the token's embedding row and one for the final norm + vocab projection
(``Gemma3Decoder`` fits Gemma 3's layer into the same five, ``Qwen3Decoder`` Qwen 3's per-head q/k
norms into the first: see their docstrings). Where a layer's weights are small
(``decoder.ONE_KERNEL_MAX_LAYER_BYTES``: SmolLM2-135M's, not Llama-3.2-1B's) launches bound the step, and the
Llama/Qwen2 layer runs as ONE kernel instead (``FusedDecoder.one_kernel_layers``, ``kernels/layer.cu``: the five
bodies as phases of one launch, between grid barriers). Every
projection is a warp-per-row GEMV (the gate/up projection of 4-bit float16 weights: a tensor-core GEMV,
``mma.sync`` with exact q * x products, ``kernels/gemv.cu``'s body_mma) over MLX's affine-quantized layout
(``w`` uint32 words holding
``32 / bits`` values, low bits first; ``value = scale * q + bias`` per ``group_size`` values; see
``mx.quantize``) or over dense weights, accumulating in float32 and rounding to the compute dtype
where MLX's own ops round (after each projection, the norm, SiLU, the residual add), so results match
the unfused model to rounding (``tests/test_fused_gpu.py`` checks them on a GPU).

The per-step state (the position) is an ``mx.array`` input, never a Python int, so no kernel is
rebuilt per step; the kernels are compiled once per shape by NVRTC and cached by MLX.

Only the CUDA backend runs these kernels; ``fused_blocker`` says why a model or cache layout cannot
(the engine then decodes as before, so Apple GPUs and CPUs keep the unfused path).

``batched`` (``BatchedDecoder``) is the batched counterpart for ``BatchEngine``: MLX runs the projections,
norms and MLP of B rows, two custom kernels per layer do RoPE at each row's position with the in-place
K/V write, and the attention over each row's own filled slots (see its docstring; ``batched_blocker``).

Layout: ``decoder`` (``FusedDecoder``: the Llama and Qwen2 layer; what the kernels read of the weights),
``gemma3`` (``Gemma3Decoder``), ``qwen3`` (``Qwen3Decoder``), ``batched`` (``BatchedDecoder``), ``sources``
(reads and fills in the CUDA text), ``kernels/`` (the CUDA:
``common.cuh``, the device helpers of every kernel; one ``.cu`` file per kernel; ``layer.cu``, the one-kernel
layer built from the others' bodies; ``calls.cu``, the
helper calls they share; package data).
Each decoder class names the HF ``model_type`` of the families it runs (``model_types``) and what it
needs of such a model (``blocker``).
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import KVCache, RotatingKVCache
from .backend import on_cuda
from .batched import BatchedDecoder, batched_blocker
from .decoder import FusedDecoder, units_per_warp
from .gemma3 import Gemma3Decoder
from .qwen3 import Qwen3Decoder

__all__ = ["BatchedDecoder", "FusedDecoder", "Gemma3Decoder", "Qwen3Decoder", "batched_blocker", "decoder_for",
           "fused_blocker", "model_blocker", "units_per_warp"]


def _decoder_class(model) -> type[FusedDecoder]:
    """The decoder class whose ``model_types`` hold ``model.args.model_type`` (``Gemma3Decoder``,
    ``Qwen3Decoder``), else ``FusedDecoder`` (whose ``blocker`` names a family that none runs)."""
    family = model.args.model_type
    return next((cls for cls in (Gemma3Decoder, Qwen3Decoder) if family in cls.model_types), FusedDecoder)


def decoder_for(model) -> FusedDecoder:
    """The fused decoder of ``model``'s family, built (``Gemma3Decoder`` for Gemma 3, ``Qwen3Decoder`` for
    Qwen 3).

    Raises:
        ValueError: the model is not supported (``model_blocker`` gives the reason).
    """
    return _decoder_class(model)(model)


def model_blocker(model) -> str | None:
    """Why the fused step cannot run ``model``, or None (``FusedDecoder.blocker``: its family, compute
    dtype, head size, RoPE, weights)."""
    return _decoder_class(model).blocker(model)


def fused_blocker(model, caches) -> str | None:
    """Why the engine cannot decode ``model`` with these caches through the fused step, or None: only
    MLX's CUDA backend, dense caches (``KVCache`` or ``RotatingKVCache``, not quantized), and
    ``model_blocker``."""
    if not on_cuda():
        return "not on MLX's CUDA backend"
    if any(type(c) not in (KVCache, RotatingKVCache) for c in caches):
        return "quantized KV caches"
    return model_blocker(model)
