"""The structured-output mask kernel (``kernels/mask.cu``): a row's logits with every token its llguidance
bitmask does not allow at -inf, read from the bitmask words directly, in one launch on MLX's CUDA backend.

Why: with MLX's ops the words are unpacked first (a shift of ``(rows, words, 32)`` uint32, 50 MB for 256 rows
of a 49,152-token vocabulary, then a bool array and a ``where``); on an H200 at B=256 the shift alone took
0.44 ms a step (docs/BENCHMARKS.md). The kernel reads the words and the logits once.
"""

from __future__ import annotations

import mlx.core as mx

from .backend import on_cuda
from .sources import fill

THREADS = 256
ENABLED = True  # False: the MLX ops everywhere (tests compare the two)
_kernels: dict = {}


def mask_kernel(x: mx.array):
    """The kernel's call for logits ``x`` ``(rows, V)`` (float32, float16 or bfloat16), or None where it does
    not run (not MLX's CUDA backend or not the default GPU, another rank, ``ENABLED`` off). The call:
    ``(x, words)`` with ``words`` ``(rows, W)`` uint32 -> ``(rows, V)`` float32."""
    if not ENABLED or x.ndim != 2 or not on_cuda():
        return None
    return _call


def _call(x: mx.array, words: mx.array) -> mx.array:
    rows, vocab = x.shape
    key = (vocab, words.shape[1])
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = mx.fast.cuda_kernel(
            name="pl_mask", input_names=["x", "words"], output_names=["out"],
            source=fill("mask.cu", "body", vocab=vocab, words=words.shape[1]))
    n = rows * vocab
    return k(inputs=[x, words], grid=(-(-n // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
             output_shapes=[(rows, vocab)], output_dtypes=[mx.float32])[0]
