"""``BatchedDecoder``: the batched decode step on CUDA for the Llama/Qwen2 layer (``BatchEngine``'s B slots).

Why: the generic batched step (``views.BatchView``) on an NVIDIA H200 (Llama-3.2-1B shape, fp16, B=256)
spent 2.13 s of a 9.6 s job in masked attention over each buffer's whole capacity, 1.8 s copying whole
KV buffers (``put_along_axis`` returns a new buffer per layer per step) and 0.93 s in RoPE with per-row
offsets, against ~0.75 s of GEMMs (docs/BENCHMARKS.md). Here each layer runs

- MLX, exactly as the model's modules do (they are called: same ops, same rounding): the input RMSNorm,
  the fused ``qkv_proj`` (its bias included, Qwen2), ``o_proj`` and the residual add, the post-attention
  RMSNorm, the MLP and its residual add;
- ``kernels/rope_store.cu`` (one launch): RoPE of q and k at each row's own position ``pos[b]`` (MLX's
  rope formula, so q and k equal ``mx.fast.rope``'s) and the new key and value written in place into
  slot ``pos[b]`` (``pos[b] % window`` for a rotating layer) of that row's K/V buffers;
- ``kernels/batch_attn.cu`` (one launch): each row's query heads over that row's filled slots only
  (``0..pos[b]``; a ring: ``min(pos[b] + 1, window)`` slots), GQA, in 128-key chunks combined as in
  flash-decoding, float32 accumulation.

Everything that changes per step is an ``mx.array`` (tokens, positions, buffers); the one host int, the
bound that sizes the attention grid, is bucketed to a power-of-two number of chunks and is no part of any
kernel's source, so no kernel is rebuilt per step. The buffers must be materialized ``(B, n_kv_heads,
capacity, head_dim)`` arrays of the compute dtype; the write goes through their strides
(``ensure_row_contiguous=False``), and the attention copies a buffer that is not row-contiguous (correct,
slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import ClassVar

import mlx.core as mx
import numpy as np

from .backend import on_cuda
from .decoder import FusedDecoder
from .sources import fill, float_literal, header

ATTN_CHUNK = 128  # keys per attention block (one thread per key)
ROPE_THREADS = 256
MAX_SMEM_BYTES = 48 * 1024


def _log2f(x: float) -> float:
    """``std::log2(float(x))`` as MLX computes the base it passes its rope kernel: the C library's ``log2f``
    where it can be loaded, else numpy's float32 ``log2``."""
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        f = libm.log2f
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
        return float(f(float(x)))
    except (OSError, AttributeError):
        return float(np.log2(np.float32(x)))


def attn_chunks(capacity: int, n_ctx: int) -> int:
    """Key chunks of a layer's attention grid: enough for ``min(n_ctx, capacity)`` keys, rounded up to a
    power of two, at most the ``ceil(capacity / 128)`` that cover the buffer."""
    need = -(-min(n_ctx, capacity) // ATTN_CHUNK)
    return min(1 << (max(need, 1) - 1).bit_length(), -(-capacity // ATTN_CHUNK))


class BatchedDecoder:
    """The batched CUDA step of one Llama-family or Qwen2 model over ``BatchEngine``'s buffers.

    ``step(tokens, pos, n_ctx, buffers)``: ``tokens`` ``(B,)`` integer array, ``pos`` ``(B,)`` int32 (each
    row's new position), ``n_ctx`` a host int > every ``pos[b]`` that sizes the attention grid (None: each
    layer's capacity, always enough; a row's keys past the grid would be left out), ``buffers``
    the per-layer ``[keys, values, keys, values, ...]`` ``(B, n_kv_heads, capacity, head_dim)`` arrays of
    the compute dtype -> logits ``(B, vocab)`` in the compute dtype. Writes each row's new key and value
    into its buffers in place.

    Args:
        model: a model of ``model_types`` with fused q/k/v projections.
        kinds: each layer's ``views.LayerKind`` (dense: full or rotating).

    Raises:
        ValueError (constructor): ``blocker`` gives a reason.
    """

    model_types: ClassVar[tuple[str, ...]] = FusedDecoder.model_types

    def __init__(self, model, kinds):
        reason = self.blocker(model, kinds)
        if reason:
            raise ValueError(reason)
        inner = model.model
        a0 = inner.layers[0].self_attn
        self.model, self.kinds = model, tuple(kinds)
        self.dtype = inner.norm.weight.dtype
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = a0.n_heads, a0.n_kv_heads, a0.head_dim, a0.scale
        self.ropes = [self._rope_of(layer.self_attn.rope) for layer in inner.layers]
        self._kernels: dict = {}
        self._scratch: mx.array | None = None
        self._counts: mx.array | None = None

    @classmethod
    def blocker(cls, model, kinds) -> str | None:
        """Why this class cannot run ``model`` over buffers of these layer kinds, or None: a family not in
        ``model_types``, a quantized KV layer, the compute dtype, head sizes, unfused q/k/v projections, a
        RoPE variant other than ``nn.RoPE`` / ``Llama3RoPE`` over the whole head."""
        family = model.args.model_type
        if family not in cls.model_types:
            return f"model family {family} has no batched CUDA step"
        if any(k.quantized for k in kinds):
            return "quantized KV caches"
        inner = model.model
        if len(kinds) != len(inner.layers):
            return "one layer kind per layer expected"
        dtype = inner.norm.weight.dtype
        if dtype not in (mx.float16, mx.bfloat16, mx.float32):
            return f"compute dtype {dtype}"
        a0 = inner.layers[0].self_attn
        H, KVH, D = a0.n_heads, a0.n_kv_heads, a0.head_dim
        if D % 8 or H % KVH:
            return f"head_dim {D}, {H} heads, {KVH} KV heads"
        if 4 * (H // KVH) * (D + ATTN_CHUNK + 2) + 256 > MAX_SMEM_BYTES:
            return f"{H // KVH} query heads per KV head of {D} too large for one block's shared memory"
        for layer in inner.layers:
            a = layer.self_attn
            if "qkv_proj" not in a:
                return "q/k/v projections are not fused (their weights differ in kind)"
            if getattr(a, "qk_norm", False):
                return "q/k norms"
            if type(a.rope).__name__ not in ("RoPE", "Llama3RoPE") or a.rope.dims != D:
                return "RoPE variant"
        return None

    @staticmethod
    def _rope_of(rope) -> tuple:
        """``(variant, value, position scale, traditional)``: ``("freqs", freqs array)`` for Llama3RoPE,
        ``("base", log2f(base))`` for nn.RoPE (what MLX's rope kernel is given)."""
        freqs = getattr(rope, "_freqs", None)
        if freqs is not None:
            f = freqs.astype(mx.float32)
            mx.eval(f)
            return "freqs", f, 1.0, bool(rope.traditional)
        return "base", _log2f(rope.base), float(rope.scale), bool(rope.traditional)

    # -- kernels --------------------------------------------------------------------------------------

    def _kernel(self, key, make):
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = make()
        return k

    def _rope_kernel(self, rope: tuple, window: int):
        """``kernels/rope_store.cu`` for a layer's RoPE and window."""
        variant, value, pscale, trad = rope
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim

        def make():
            inv = fill("rope_store.cu", "inv_freqs") if variant == "freqs" else \
                fill("rope_store.cu", "inv_base", log2_base=float_literal(value))
            src = fill("rope_store.cu", "body", head_dim=D, n_heads=H, n_kv_heads=KVH, window=window,
                       traditional=int(trad), pos_scale=float_literal(pscale), inv_freq=inv)
            names = ["qkv", "pos", *(["freqs"] if variant == "freqs" else []), "kc", "vc"]
            return mx.fast.cuda_kernel(name="pl_rope_store", input_names=names, output_names=["q"], source=src,
                                       header=header(), ensure_row_contiguous=False)

        sig = ("rope", variant, None if variant == "freqs" else value, pscale, trad, window)
        return self._kernel(sig, make)

    def _attn_kernel(self, window: int):
        """``kernels/batch_attn.cu`` for a layer's window (0: a full cache)."""
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim

        def make():
            src = fill("batch_attn.cu", "body", head_dim=D, chunk=ATTN_CHUNK, group=H // KVH, n_kv_heads=KVH,
                       window=window, scale=float_literal(self.scale))
            return mx.fast.cuda_kernel(name="pl_batch_attn", input_names=["q", "kc", "vc", "pos", "scratch", "counts"],
                                       output_names=["o"], source=src, header=header())

        return self._kernel(("attn", window), make)

    def _load_kernel(self):
        """``kernels/load_slots.cu``."""

        def make():
            src = fill("load_slots.cu", "body", head_dim=self.head_dim)
            return mx.fast.cuda_kernel(name="pl_load_slots", input_names=["sk", "sv", "rows", "slots", "lengths", "dk", "dv"],
                                       output_names=["done"], source=src, header=header(), ensure_row_contiguous=False)

        return self._kernel(("load",), make)

    # -- the step -------------------------------------------------------------------------------------

    def prepare(self, B: int) -> None:
        """Size the attention scratch (``B * n_heads * chunks * (head_dim + 2)`` float32, chunks covering
        the largest capacity) and the ``B * n_kv_heads`` arrival counters (zeros; the kernel resets them)."""
        chunks = max(-(-k.capacity // ATTN_CHUNK) for k in self.kinds)
        need = B * self.n_heads * chunks * (self.head_dim + 2)
        if self._scratch is None or self._scratch.size < need or self._counts.size != B * self.n_kv_heads:
            self._scratch = mx.zeros((need,), mx.float32)
            self._counts = mx.zeros((B * self.n_kv_heads,), mx.int32)
            mx.eval(self._scratch, self._counts)

    def rope_store(self, i: int, qkv: mx.array, pos: mx.array, kc: mx.array, vc: mx.array) -> mx.array:
        """Layer ``i``'s roped queries ``(B, n_heads * head_dim)``; writes the new keys/values into ``kc``/``vc``."""
        B, kind, rope = pos.shape[0], self.kinds[i], self.ropes[i]
        window = kind.window or 0
        pairs = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim // 2
        inputs = [qkv, pos, *([rope[1]] if rope[0] == "freqs" else []), kc, vc]
        return self._rope_kernel(rope, window)(
            inputs=inputs, template=[("T", self.dtype)], grid=(-(-B * pairs // ROPE_THREADS) * ROPE_THREADS, 1, 1),
            threadgroup=(ROPE_THREADS, 1, 1), output_shapes=[(B, self.n_heads * self.head_dim)],
            output_dtypes=[self.dtype])[0]

    def load_slots(self, i: int, sk: mx.array, sv: mx.array, rows: mx.array, slots: mx.array, lengths: mx.array,
                   dk: mx.array, dv: mx.array) -> mx.array:
        """Write requests' keys and values from a group prefill's caches into their slots of layer ``i``'s
        buffers, in place (one launch): slot ``slots[r]`` gets row ``rows[r]`` of ``sk``/``sv`` ``(R,
        n_kv_heads, S, head_dim)`` at positions ``< lengths[r]`` and zeros at the rest of its ``capacity``
        (``rows``, ``slots``, ``lengths``: ``(n,)`` int32). Returns a ``(1,)`` int32 array to evaluate: the
        buffers come back as they were (the same arrays), so nothing else makes MLX run the copy."""
        if not (sk.dtype == sv.dtype == dk.dtype == dv.dtype == self.dtype):
            raise ValueError(f"caches of {sk.dtype}, buffers of {dk.dtype}, compute dtype {self.dtype}")
        n, (_, H, cap, D) = slots.shape[0], dk.shape
        return self._load_kernel()(
            inputs=[sk, sv, rows, slots, lengths, dk, dv], template=[("T", self.dtype)],
            grid=(-(-n * H * cap * D // ROPE_THREADS) * ROPE_THREADS, 1, 1), threadgroup=(ROPE_THREADS, 1, 1),
            output_shapes=[(1,)], output_dtypes=[mx.int32])[0]

    def attend(self, i: int, q: mx.array, pos: mx.array, n_ctx: int | None, kc: mx.array, vc: mx.array) -> mx.array:
        """Layer ``i``'s attention output ``(B, n_heads * head_dim)`` over each row's filled slots."""
        B, kind = pos.shape[0], self.kinds[i]
        chunks = attn_chunks(kind.capacity, kind.capacity if n_ctx is None else n_ctx)
        return self._attn_kernel(kind.window or 0)(
            inputs=[q, kc, vc, pos, self._scratch, self._counts], template=[("T", self.dtype)],
            grid=(chunks * ATTN_CHUNK, self.n_kv_heads, B), threadgroup=(ATTN_CHUNK, 1, 1),
            output_shapes=[(B, self.n_heads * self.head_dim)], output_dtypes=[self.dtype])[0]

    def step(self, tokens: mx.array, pos: mx.array, n_ctx: int | None, buffers) -> mx.array:
        model, inner = self.model, self.model.model
        B = tokens.shape[0]
        if buffers[0].dtype != self.dtype:
            raise ValueError(f"KV buffers of {buffers[0].dtype}, compute dtype {self.dtype}")
        self.prepare(B)
        h = inner.embed_tokens(tokens.reshape(B, 1))
        for i, layer in enumerate(inner.layers):
            kc, vc = buffers[2 * i], buffers[2 * i + 1]
            a = layer.self_attn
            q = self.rope_store(i, a.qkv_proj(layer.input_layernorm(h)), pos, kc, vc)
            o = self.attend(i, q, pos, n_ctx, kc, vc)
            h = h + a.o_proj(o.reshape(B, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = inner.norm(h)
        logits = model.lm_head(h) if "lm_head" in model else inner.embed_tokens.as_linear(h)
        return logits[:, -1, :]


def batched_blocker(model, kinds) -> str | None:
    """Why ``BatchEngine`` cannot decode ``model`` over these layer kinds through ``BatchedDecoder``, or
    None: only on MLX's CUDA backend (the default device a GPU), then ``BatchedDecoder.blocker``."""
    if not on_cuda():
        return "not on MLX's CUDA backend"
    return BatchedDecoder.blocker(model, kinds)
