"""The sampling kernel (``kernels/sample.cu``): min_p, top_k, top_p and the draw of every row in one launch
(two where filters are on: the binned cut, then radix passes for the rows it hands on) on MLX's CUDA backend,
the same token as ``sampler.keep_mask`` and ``sampler.draw`` for the same masses.

Why: on an H200 (Llama-3.2-1B shape, fp16, B=256, temperature 0.8 and top_p 0.95) the sort-based filter
(argsort of each row, a gather, two softmaxes and scans) made sampling 0.51x as fast as greedy decoding;
temperature alone was 0.89x (docs/BENCHMARKS.md). The kernel reads each row a few times and sorts nothing
but the few tokens of one histogram bin.
"""

from __future__ import annotations

import mlx.core as mx

from .backend import on_cuda
from .sources import fill

THREADS = 1024
ENABLED = True  # False: the MLX ops everywhere (tests compare the two)
BINNED = True  # False: every cut by radix passes over the row (the binned cut hands rows on to them where it must)
BINS, BIN_SCALE, CAP = 4096, 128, 4096  # bins of 1/128 logit over m - x in [0, 32); tokens gathered per cut
VEC, UNROLL = True, 4  # 16-byte loads (where the vocabulary is a multiple of 4), UNROLL of them in flight a thread
_kernels: dict = {}


def sample_kernel(x: mx.array):
    """The kernel's call for logits ``x`` ``(rows, V)`` float32, or None where it does not run (not MLX's
    CUDA backend, another dtype or rank, ``ENABLED`` off). The call: ``(x, top_k, top_p, min_p, u, filters)``
    with scalars or ``(rows, 1)`` settings -> ``(rows,)`` uint32 tokens."""
    if not ENABLED or x.ndim != 2 or x.dtype != mx.float32 or not on_cuda():
        return None
    return _call


def _kernel(vocab: int, filters: bool, mode: int):
    """The kernel for ``vocab`` and ``filters`` in ``mode`` (``kernels/sample.cu``): 0 radix passes for every
    cut; 1 the binned cut, rows it cannot cut handed on as token 0xffffffff; 2 those rows by radix passes
    (an input ``first``: mode 1's tokens), the others copied."""
    key = (vocab, filters, mode, VEC, UNROLL)
    k = _kernels.get(key)
    if k is None:
        names = ["x", "top_k_in", "top_p_in", "min_p_in", "u"] + (["first"] if mode == 2 else [])
        prologue = "" if mode != 2 else \
            "  if (first[b] != 0xffffffffu) {\n    if (threadIdx.x == 0) token[b] = first[b];\n    return;\n  }\n"
        src = fill("sample.cu", "body", vocab=vocab, threads=THREADS, filters=int(filters), mode=mode,
                   prologue=prologue, bins=BINS, bin_scale=BIN_SCALE, cap=CAP, vec=int(VEC), unroll=UNROLL)
        k = _kernels[key] = mx.fast.cuda_kernel(
            name=f"pl_sample{mode}{'v' if VEC else ''}", input_names=names, output_names=["token"], source=src,
            header=fill("sample.cu", "header"))
    return k


def _column(a, dtype: mx.Dtype, rows: int) -> mx.array:
    """A setting (a Python or array scalar, or ``(rows, 1)``) as a ``(rows, 1)`` array of ``dtype``."""
    a = a if isinstance(a, mx.array) else mx.array(a)
    return mx.broadcast_to(a.astype(dtype).reshape(-1, 1), (rows, 1))


def _inputs(x: mx.array, top_k, top_p, min_p, u: mx.array) -> list[mx.array]:
    rows = x.shape[0]
    return [x, _column(top_k, mx.int32, rows), _column(top_p, mx.float32, rows), _column(min_p, mx.float32, rows),
            _column(u, mx.float32, rows)]


def launch(mode: int, inputs: list[mx.array], filters: bool = True) -> mx.array:
    """One launch of the kernel in ``mode`` (``_kernel``) over ``inputs`` (``x``, ``top_k``, ``top_p``, ``min_p``,
    ``u`` as ``(rows, 1)`` columns, and for mode 2 mode 1's tokens) -> ``(rows,)`` uint32."""
    rows, vocab = inputs[0].shape
    return _kernel(vocab, filters, mode)(inputs=inputs, grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                                         output_shapes=[(rows,)], output_dtypes=[mx.uint32])[0]


def _call(x: mx.array, top_k, top_p, min_p, u: mx.array, filters: bool) -> mx.array:
    inputs = _inputs(x, top_k, top_p, min_p, u)
    if not (filters and BINNED):
        return launch(0, inputs, filters)
    return launch(2, inputs + [launch(1, inputs)])
