"""The sampling kernel (``kernels/sample.cu``): min_p, top_k, top_p and the draw of every row in one launch
on MLX's CUDA backend, the same token as ``sampler.keep_mask`` and ``sampler.draw`` for the same masses.

Why: on an H200 (Llama-3.2-1B shape, fp16, B=256, temperature 0.8 and top_p 0.95) the sort-based filter
(argsort of each row, a gather, two softmaxes and scans) made sampling 0.51x as fast as greedy decoding;
temperature alone was 0.89x (docs/BENCHMARKS.md). The kernel reads each row a few times and sorts nothing.
"""

from __future__ import annotations

import mlx.core as mx

from .sources import fill

THREADS = 1024
ENABLED = True  # False: the MLX ops everywhere (tests compare the two)
_kernels: dict = {}


def sample_kernel(x: mx.array):
    """The kernel's call for logits ``x`` ``(rows, V)`` float32, or None where it does not run (not MLX's
    CUDA backend, another dtype or rank, ``ENABLED`` off). The call: ``(x, top_k, top_p, min_p, u, filters)``
    with scalars or ``(rows, 1)`` settings -> ``(rows,)`` uint32 tokens."""
    if not ENABLED or x.ndim != 2 or x.dtype != mx.float32 or not mx.cuda.is_available() \
            or mx.default_device() != mx.gpu:
        return None
    return _call


def _kernel(vocab: int, filters: bool):
    k = _kernels.get((vocab, filters))
    if k is None:
        src = fill("sample.cu", "body", vocab=vocab, threads=THREADS, filters=int(filters))
        k = _kernels[(vocab, filters)] = mx.fast.cuda_kernel(
            name="pl_sample", input_names=["x", "top_k_in", "top_p_in", "min_p_in", "u"], output_names=["token"],
            source=src, header=fill("sample.cu", "header"))
    return k


def _column(a, dtype: mx.Dtype, rows: int) -> mx.array:
    """A setting (a Python or array scalar, or ``(rows, 1)``) as a ``(rows, 1)`` array of ``dtype``."""
    a = a if isinstance(a, mx.array) else mx.array(a)
    return mx.broadcast_to(a.astype(dtype).reshape(-1, 1), (rows, 1))


def _call(x: mx.array, top_k, top_p, min_p, u: mx.array, filters: bool) -> mx.array:
    rows, vocab = x.shape
    inputs = [x, _column(top_k, mx.int32, rows), _column(top_p, mx.float32, rows), _column(min_p, mx.float32, rows),
              _column(u, mx.float32, rows)]
    return _kernel(vocab, filters)(inputs=inputs, grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                                   output_shapes=[(rows,)], output_dtypes=[mx.uint32])[0]
