"""Fused single-token decode step for MLX's CUDA backend (batch 1; Llama, Qwen2 and Gemma 3 families).

Why: on an NVIDIA H200 (mlx 0.32.4) batch-1 decode of a small model is bound by the host, not the GPU:
MLX launches one kernel per primitive (~550 per token for SmolLM2-135M, ~7 us of host time each) while
the GPU is busy 1.5 of 4 ms per token (docs/BENCHMARKS.md). ``mx.compile`` does not merge them. This
module runs a decoder layer as five custom kernels (``mx.fast.cuda_kernel``) instead of ~18:

1. ``qkv``: RMSNorm of the hidden state, the fused q/k/v projection, bias, RoPE, and the new key and
   value written into slot ``pos`` of the layer's cache buffers (in place);
2. ``attn``: attention of the query over cache slots ``0..pos`` (a ``RotatingKVCache``: the ring's
   ``min(pos + 1, max_size)`` filled slots, exactly the query's window; split over 128-key chunks; the
   last chunk of each head to finish combines the partial softmaxes, as in flash-decoding);
3. ``o_proj`` + residual add;
4. RMSNorm + the fused gate/up projection + SiLU(gate) * up;
5. ``down_proj`` + residual add;

plus one kernel for the token's embedding row and one for the final norm + vocab projection
(``Gemma3Decoder`` fits Gemma 3's layer into the same five: see its docstring). Every
projection is a warp-per-row GEMV over MLX's affine-quantized layout (``w`` uint32 words holding
``32 / bits`` values, low bits first; ``value = scale * q + bias`` per ``group_size`` values; see
``mx.quantize``) or over dense weights, accumulating in float32 and rounding to the compute dtype
where MLX's own ops round (after each projection, the norm, SiLU, the residual add), so results match
the unfused model to rounding (``tests/test_fused_gpu.py`` checks them on a GPU).

The per-step state (the position) is an ``mx.array`` input, never a Python int, so no kernel is
rebuilt per step; the kernels are compiled once per shape by NVRTC and cached by MLX.

Only the CUDA backend runs these kernels; ``fused_blocker`` says why a model or cache layout cannot
(the engine then decodes as before, so Apple GPUs and CPUs keep the unfused path).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCache, RotatingKVCache

ATTN_CHUNK = 128  # keys per attention block (one thread per key)
WARPS_PER_BLOCK = 8  # per GEMV block of 256 threads


def units_per_warp(rows: int, mode: str) -> int:
    """Output rows (row pairs for "swiglu") one warp computes: more for large projections, so x is
    staged and read once for several weight rows (fewer x reads per weight byte, more loads in flight),
    one or two for small ones, so enough blocks exist to occupy the GPU."""
    if mode == "swiglu":
        return 2 if rows >= 16384 else 1
    return 4 if rows >= 16384 else 2
MAX_SMEM_BYTES = 48 * 1024  # static shared memory limit per block (CUDA)

_HEADER = r"""
#define PL_FULL 0xffffffffu
#define PL_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float pl_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(PL_FULL, v, o);
  return v;
}

__device__ __forceinline__ float pl_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(PL_FULL, v, o));
  return v;
}

// Sum over the block (NT threads, a multiple of 32); every thread gets the total.
template <int NT>
__device__ __forceinline__ float pl_block_sum(float v, float* red) {
  v = pl_warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = ((threadIdx.x & 31) < NT / 32) ? red[threadIdx.x & 31] : 0.f;
  return pl_warp_sum(t);
}

template <int NT>
__device__ __forceinline__ float pl_block_max(float v, float* red) {
  v = pl_warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = ((threadIdx.x & 31) < NT / 32) ? red[threadIdx.x & 31] : PL_NEG_INF;
  return pl_warp_max(t);
}

// Staged copy of x in shared memory, "swizzled": x is cut into chunks of VALS values (what one lane's
// 16-byte weight load covers), each chunk into 16-byte pieces; piece p of every chunk is stored
// contiguously across chunks, so the 32 lanes of a warp, each reading piece p of its own chunk, read
// consecutive 16-byte words (no shared-memory bank conflicts).
template <typename T, int VALS, int K>
__device__ __forceinline__ int pl_swz(int k) {
  constexpr int PS = 16 / sizeof(T);
  constexpr int NCH = K / VALS;
  const int c = k / VALS, o = k % VALS;
  return ((o / PS) * NCH + c) * PS + (o % PS);
}

// x (K values) into shared memory (swizzled), through RMSNorm when NORM:
// y = w * T(x * rsqrt(mean(x^2) + eps)) (MLX's rms_norm rounding: the normalized value is rounded to
// T, then multiplied by the weight in T).
template <typename T, int K, int NT, bool NORM, int VALS>
__device__ __forceinline__ void pl_load_x(const T* x, const T* nw, float eps, T* xs, float* red) {
  if (NORM) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < K; i += NT) {
      float v = static_cast<float>(x[i]);
      ss += v * v;
    }
    float r = rsqrtf(pl_block_sum<NT>(ss, red) / K + eps);
    for (int i = threadIdx.x; i < K; i += NT) {
      T y = static_cast<T>(static_cast<float>(x[i]) * r);
      xs[pl_swz<T, VALS, K>(i)] = static_cast<T>(static_cast<float>(nw[i]) * static_cast<float>(y));
    }
  } else {
    for (int i = threadIdx.x; i < K; i += NT) xs[pl_swz<T, VALS, K>(i)] = x[i];
  }
  __syncthreads();
}

// Dot products of R weight rows with the staged x (K values), each summed over the warp into out[r].
// BITS 4 or 8: MLX affine quantization (uint32 words, 32/BITS values each, low bits first;
// value = scale * q + bias per GS values). BITS 0: dense weights of type T.
// Each lane reads 16-byte chunks of every row (a chunk never straddles a quantization group) and the
// matching x values once for all R rows.
template <typename T, int BITS, int GS, int K, int R>
__device__ __forceinline__ void pl_rows_dot(const uint32_t* wq, const T* wd, const T* sc, const T* bi,
                                            const int (&rows)[R], const T* xs, int lane, float (&out)[R]) {
  constexpr int PS = 16 / sizeof(T);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.f;
  if constexpr (BITS == 0) {
    constexpr int CH = K / PS;
#pragma unroll 2
    for (int c = lane; c < CH; c += 32) {
      uint4 wv[R];
#pragma unroll
      for (int r = 0; r < R; r++) wv[r] = reinterpret_cast<const uint4*>(wd + (size_t)rows[r] * K)[c];
      const uint4 xr = *reinterpret_cast<const uint4*>(xs + c * PS);
      const T* xv = reinterpret_cast<const T*>(&xr);
#pragma unroll
      for (int r = 0; r < R; r++) {
        const T* w = reinterpret_cast<const T*>(&wv[r]);
#pragma unroll
        for (int j = 0; j < PS; j++) acc[r] += static_cast<float>(w[j]) * static_cast<float>(xv[j]);
      }
    }
  } else {
    constexpr int PER = 32 / BITS;
    constexpr int VALS = 4 * PER;
    constexpr int CH = K / VALS;
    constexpr int NG = K / GS;
    constexpr int NP = VALS / PS;
#pragma unroll 2
    for (int c = lane; c < CH; c += 32) {
      uint4 wv[R];
      float s[R], b[R];
#pragma unroll
      for (int r = 0; r < R; r++) {
        wv[r] = reinterpret_cast<const uint4*>(wq + (size_t)rows[r] * (K / PER))[c];
        s[r] = static_cast<float>(sc[(size_t)rows[r] * NG + (c * VALS) / GS]);
        b[r] = static_cast<float>(bi[(size_t)rows[r] * NG + (c * VALS) / GS]);
      }
      float xf[VALS];
      float sx = 0.f;
#pragma unroll
      for (int p = 0; p < NP; p++) {
        const uint4 xr = *reinterpret_cast<const uint4*>(xs + (p * CH + c) * PS);
        const T* xv = reinterpret_cast<const T*>(&xr);
#pragma unroll
        for (int e = 0; e < PS; e++) {
          xf[p * PS + e] = static_cast<float>(xv[e]);
          sx += xf[p * PS + e];
        }
      }
#pragma unroll
      for (int r = 0; r < R; r++) {
        const uint32_t ws[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
        float qx = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
          for (int j = 0; j < PER; j++)
            qx += static_cast<float>((ws[i] >> (BITS * j)) & ((1u << BITS) - 1u)) * xf[i * PER + j];
        }
        acc[r] += s[r] * qx + b[r] * sx;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) out[r] = pl_warp_sum(acc[r]);
}

// Gemma 3's residual step before a projection: hn = h + rms_norm(y, wpost) (float16: summed in float32
// and clipped to the float16 range, as mlx-lm's clip_residual), then x = rms_norm(hn, wnorm) into
// shared memory (swizzled). hs: K values of shared memory for hn. When WRITE, the first block writes hn
// (the new residual stream) to hout.
template <typename T, int K, int NT, int VALS, bool CLIP, bool WRITE>
__device__ __forceinline__ void pl_load_x_res(const T* h, const T* y, const T* wpost, const T* wnorm, float eps,
                                              T* xs, T* hs, float* red, T* hout) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < K; i += NT) {
    float v = static_cast<float>(y[i]);
    ss += v * v;
  }
  const float r = rsqrtf(pl_block_sum<NT>(ss, red) / K + eps);
  float ss2 = 0.f;
  for (int i = threadIdx.x; i < K; i += NT) {
    const T n = static_cast<T>(static_cast<float>(y[i]) * r);
    const T pn = static_cast<T>(static_cast<float>(wpost[i]) * static_cast<float>(n));
    float v = static_cast<float>(h[i]) + static_cast<float>(pn);
    if (CLIP) v = fminf(fmaxf(v, -65504.f), 65504.f);
    const T hv = static_cast<T>(v);
    hs[i] = hv;
    const float f = static_cast<float>(hv);
    ss2 += f * f;
  }
  const float r2 = rsqrtf(pl_block_sum<NT>(ss2, red) / K + eps);
  for (int i = threadIdx.x; i < K; i += NT) {
    const T n = static_cast<T>(static_cast<float>(hs[i]) * r2);
    xs[pl_swz<T, VALS, K>(i)] = static_cast<T>(static_cast<float>(wnorm[i]) * static_cast<float>(n));
    if (WRITE && blockIdx.x == 0) hout[i] = hs[i];
  }
  __syncthreads();
}

// MLX's nn.gelu_approx, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), rounded to T after
// every op as MLX's compiled elementwise kernel does (x is already a T value).
template <typename T>
__device__ __forceinline__ T pl_gelu_approx(float x) {
  const T x3 = static_cast<T>(x * x * x);
  const T t1 = static_cast<T>(static_cast<float>(static_cast<T>(0.044715f)) * static_cast<float>(x3));
  const T t2 = static_cast<T>(x + static_cast<float>(t1));
  const T t3 = static_cast<T>(static_cast<float>(static_cast<T>(0.7978845608028654f)) * static_cast<float>(t2));
  const T t4 = static_cast<T>(tanhf(static_cast<float>(t3)));
  const T t5 = static_cast<T>(1.f + static_cast<float>(t4));
  const T t6 = static_cast<T>(0.5f * x);
  return static_cast<T>(static_cast<float>(t6) * static_cast<float>(t5));
}
"""


class Proj:
    """One projection's weights as the kernels read them: ``bits`` 0 (dense), 4 or 8."""

    def __init__(self, layer: nn.Module):
        self.bias = layer.get("bias") if isinstance(layer, nn.Module) else None
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            self.bits, self.group_size = layer.bits, layer.group_size
            self.arrays = [layer.weight, layer.scales, layer.biases]
            self.out_dim = layer.weight.shape[0]
            self.in_dim = layer.weight.shape[1] * 32 // layer.bits
        else:
            self.bits, self.group_size = 0, 1
            self.arrays = [layer.weight]
            self.out_dim, self.in_dim = layer.weight.shape

    def problem(self, dtype: mx.Dtype) -> str | None:
        """Why the GEMV cannot read these weights, or None."""
        if self.bits not in (0, 4, 8):
            return f"{self.bits}-bit weights"
        if self.bits and (getattr(self.arrays[1], "dtype", None) != dtype or len(self.arrays) != 3
                          or self.arrays[2] is None):
            return "quantized weights without affine scales/biases of the compute dtype"
        if not self.bits and self.arrays[0].dtype != dtype:
            return f"dense weights of {self.arrays[0].dtype}, compute dtype {dtype}"
        vals = 128 // self.bits if self.bits else 16 // dtype.size
        if self.in_dim % vals or (self.bits and self.group_size % vals):
            return f"input size {self.in_dim} / group size {self.group_size} not a multiple of {vals}"
        if self.in_dim * dtype.size > MAX_SMEM_BYTES - 1024:
            return f"input size {self.in_dim} too large for one block's shared memory"
        return None

    def names(self, prefix: str = "") -> list[str]:
        """The kernel's input names for ``arrays`` (``prefix`` tells two projections of a kernel apart)."""
        return [prefix + n for n in (["w", "s", "b"] if self.bits else ["w"])]

    def vals(self, dtype: mx.Dtype) -> int:
        """Input values one lane's 16-byte weight load covers."""
        return 128 // self.bits if self.bits else 16 // dtype.size

    def rows_dot(self, r: int, prefix: str = "", acc: str = "acc") -> str:
        """CUDA statement: the warp's dot products of rows ``rows[0..r)`` with ``xs`` into ``acc``."""
        w, s, b = self.names(prefix) if self.bits else (self.names(prefix)[0], "", "")
        if self.bits:
            return (f"pl_rows_dot<T, {self.bits}, {self.group_size}, {self.in_dim}, {r}>"
                    f"({w}, (const T*)nullptr, {s}, {b}, rows, xs, lane, {acc});")
        return (f"pl_rows_dot<T, 0, 1, {self.in_dim}, {r}>((const uint32_t*)nullptr, {w}, "
                f"(const T*)nullptr, (const T*)nullptr, rows, xs, lane, {acc});")


def _rope_table(rope: nn.Module, head_dim: int) -> tuple[mx.array, float, bool]:
    """``(inverse frequencies (head_dim/2,) float32, position scale, traditional)`` of a RoPE module
    (``nn.RoPE``: ``base ** (-2j / dims)``, positions times ``scale``; ``Llama3RoPE``: ``1 / freqs``)."""
    if rope.dims != head_dim:
        raise ValueError("partial RoPE")
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:
        return (1.0 / freqs.astype(mx.float32)).astype(mx.float32), 1.0, rope.traditional
    j = mx.arange(0, head_dim, 2, dtype=mx.float32)
    inv = mx.power(mx.array(rope.base, mx.float32), -j / head_dim)
    return inv.astype(mx.float32), float(rope.scale), rope.traditional


def _head_dim(model) -> int:
    """Per-head size of ``model``'s attention (Gemma 3's attention module does not store it)."""
    attn0 = model.model.layers[0].self_attn
    return getattr(attn0, "head_dim", None) or model.args.head_dim


def _f(x: float) -> str:
    return repr(float(x)) + "f"


class FusedDecoder:
    """The fused decode step of one Llama-family or Qwen2 model (see the module docstring);
    ``Gemma3Decoder`` is the Gemma 3 variant. Build one with ``decoder_for(model)``.

    ``step(token, pos, n_ctx, caches)``: ``token`` ``(1,)`` integer array, ``pos`` ``(1,)`` int32 array
    (the token's position = positions already in the caches), ``n_ctx`` the same position as a host int
    (sizes the attention grid) -> logits ``(1, vocab)`` in the compute dtype. Writes the token's keys
    and values in place into each cache's buffers: slot ``pos`` of a ``KVCache``, slot
    ``pos % max_size`` of a ``RotatingKVCache`` (``pipeline.cache``: the ring's layout). The buffers must
    be materialized, row-contiguous and long enough (``prepare``).

    Raises:
        ValueError (constructor): the model is not supported (``model_blocker`` gives the reason).
    """

    def __init__(self, model):
        reason = model_blocker(model)
        if reason:
            raise ValueError(reason)
        args = model.args
        inner = model.model
        self.dtype = inner.norm.weight.dtype
        self.hidden = args.hidden_size
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        attn0 = inner.layers[0].self_attn
        self.head_dim = _head_dim(model)
        self.scale = attn0.scale
        self.eps = args.rms_norm_eps
        self.embed = Proj(inner.embed_tokens)
        self.head = Proj(model.lm_head) if "lm_head" in model else self.embed
        self.final_norm = inner.norm.weight
        self.embed_scale: float | None = None
        self.layers = [self._read_layer(layer) for layer in inner.layers]
        mx.eval([v for lay in self.layers for v in lay.values() if isinstance(v, mx.array)])
        self._kernels: dict = {}
        self._scratch = None
        self._counts = mx.zeros((self.n_heads,), mx.int32)

    def _read_layer(self, layer) -> dict:
        a, m = layer.self_attn, layer.mlp
        inv, pscale, trad = _rope_table(a.rope, self.head_dim)
        return {"in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                "qkv": Proj(a.qkv_proj), "o": Proj(a.o_proj), "gu": Proj(m.gate_up_proj), "down": Proj(m.down_proj),
                "inv_freq": inv, "pos_scale": pscale, "traditional": trad}

    # -- kernels --------------------------------------------------------------------------------------

    def _kernel(self, key, make):
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = make()
        return k

    def _qkv_kernel(self, qkv: Proj, trad: bool, pscale: float, win: int):
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim
        has_bias = qkv.bias is not None

        def make():
            pairs = (H + 2 * KVH) * D // 2
            src = f"""
  constexpr int K = {self.hidden}, NT = 256, D = {D}, H = {H}, KVH = {KVH}, WIN = {win};
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  pl_load_x<T, K, NT, true, {qkv.vals(self.dtype)}>(x, nw, {_f(self.eps)}, xs, red);
  const int lane = threadIdx.x & 31;
  const int p = blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
  if (p >= {pairs}) return;
  const int head = p / (D / 2), j = p % (D / 2);
  const int r0 = head * D + ({int(trad)} ? 2 * j : j);
  const int r1 = r0 + ({int(trad)} ? 1 : D / 2);
  const int rows[2] = {{r0, r1}};
  float acc[2];
  {qkv.rows_dot(2)}
  const float a0 = acc[0], a1 = acc[1];
  if (lane != 0) return;
  float y0 = static_cast<float>(static_cast<T>(a0)), y1 = static_cast<float>(static_cast<T>(a1));
  {"y0 = static_cast<float>(static_cast<T>(y0 + static_cast<float>(bias[r0])));" if has_bias else ""}
  {"y1 = static_cast<float>(static_cast<T>(y1 + static_cast<float>(bias[r1])));" if has_bias else ""}
  const int ps = pos[0];
  const int slot = WIN ? ps % WIN : ps;
  T o0, o1;
  if (head < H + KVH) {{
    const float th = static_cast<float>(ps) * {_f(pscale)} * inv_freq[j];
    const float c = cosf(th), s = sinf(th);
    o0 = static_cast<T>(y0 * c - y1 * s);
    o1 = static_cast<T>(y0 * s + y1 * c);
  }} else {{
    o0 = static_cast<T>(y0);
    o1 = static_cast<T>(y1);
  }}
  if (head < H) {{
    q[r0] = o0;
    q[r1] = o1;
  }} else {{
    const int kv = head - H;
    T* dst = const_cast<T*>(kv < KVH ? kc : vc);
    const int hh = kv < KVH ? kv : kv - KVH;
    const size_t base = ((size_t)hh * kc_shape[2] + slot) * D;
    dst[base + (r0 - head * D)] = o0;
    dst[base + (r1 - head * D)] = o1;
  }}
"""
            names = ["x", "nw", *qkv.names(), *(["bias"] if has_bias else []), "inv_freq", "pos", "kc", "vc"]
            return mx.fast.cuda_kernel(name="pl_qkv", input_names=names, output_names=["q"], source=src,
                                       header=_HEADER), pairs

        return self._kernel(("qkv", qkv.bits, qkv.group_size, qkv.in_dim, qkv.out_dim, trad, pscale, has_bias, win),
                            make)

    def _attn_kernel(self, win: int):
        """Attention of each head's query over the cache's filled slots: ``0..pos`` (full cache) or
        ``0..min(pos + 1, win) - 1`` (a ring of ``win`` slots: exactly the query's window)."""
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim

        def make():
            src = f"""
  constexpr int D = {D}, CH = {ATTN_CHUNK}, NT = {ATTN_CHUNK}, G = {H // KVH}, VEC = 16 / sizeof(T), WIN = {win};
  __shared__ float qs[D];
  __shared__ float pr[CH];
  __shared__ float red[32];
  __shared__ int last;
  const int h = blockIdx.y, s = blockIdx.x, NS = gridDim.x, t = threadIdx.x;
  const int L = WIN ? min(pos[0] + 1, WIN) : pos[0] + 1;
  const size_t cap = kc_shape[2];
  const int kvh = h / G;
  for (int d = t; d < D; d += NT) qs[d] = static_cast<float>(q[h * D + d]) * {_f(self.scale)};
  __syncthreads();
  const int k = s * CH + t;
  float sc = PL_NEG_INF;
  if (k < L) {{
    const T* kr = kc + ((size_t)kvh * cap + k) * D;
    float acc = 0.f;
#pragma unroll
    for (int d = 0; d < D; d += VEC) {{
      uint4 v = *reinterpret_cast<const uint4*>(kr + d);
      const T* kv = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int i = 0; i < VEC; i++) acc += qs[d + i] * static_cast<float>(kv[i]);
    }}
    sc = acc;
  }}
  const float m = pl_block_max<NT>(sc, red);
  const float e = (k < L) ? expf(sc - m) : 0.f;
  pr[t] = e;
  const float l = pl_block_sum<NT>(e, red);
  const int kend = min(CH, L - s * CH);
  float* part = const_cast<float*>(scratch) + ((size_t)h * NS + s) * (D + 2);
  for (int d = t; d < D; d += NT) {{
    const T* vr = vc + ((size_t)kvh * cap + (size_t)s * CH) * D + d;
    float acc = 0.f;
    for (int i = 0; i < kend; i++) acc += pr[i] * static_cast<float>(vr[(size_t)i * D]);
    if (NS == 1) o[h * D + d] = static_cast<T>(acc / l);
    else part[2 + d] = acc;
  }}
  if (NS == 1) return;
  if (t == 0) {{
    part[0] = m;
    part[1] = l;
  }}
  __threadfence();
  __syncthreads();
  if (t == 0) last = (atomicAdd(const_cast<int*>(counts) + h, 1) == NS - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const float* base = scratch + (size_t)h * NS * (D + 2);
  float M = PL_NEG_INF;
  for (int i = 0; i < NS; i++) M = fmaxf(M, __ldcg(base + (size_t)i * (D + 2)));
  float den = 0.f;
  for (int i = 0; i < NS; i++) den += __ldcg(base + (size_t)i * (D + 2) + 1) * expf(__ldcg(base + (size_t)i * (D + 2)) - M);
  for (int d = t; d < D; d += NT) {{
    float num = 0.f;
    for (int i = 0; i < NS; i++)
      num += __ldcg(base + (size_t)i * (D + 2) + 2 + d) * expf(__ldcg(base + (size_t)i * (D + 2)) - M);
    o[h * D + d] = static_cast<T>(num / den);
  }}
  if (t == 0) const_cast<int*>(counts)[h] = 0;
"""
            return mx.fast.cuda_kernel(name="pl_attn", input_names=["q", "kc", "vc", "pos", "scratch", "counts"],
                                       output_names=["o"], source=src, header=_HEADER)

        return self._kernel(("attn", win), make)

    # GEMV modes: (prologue staging x, epilogue storing the rows).
    # prologue "copy": x as is; "norm": rms_norm(x, nw); "res" (Gemma 3): hout = h + rms_norm(x, wpost),
    # then rms_norm(hout, nw); "res_final": the same without writing hout.
    # epilogue "plain": out = T(W x); "residual": out = T(T(W x) + r); "swiglu": out[i] = silu(T(W x)[i]) *
    # T(W x)[i + n] (gate and up rows of one fused matrix); "geglu": out = gelu_approx(T(G x)) * T(U x)
    # (two matrices, the second passed as ``proj2``); MLX's rounding after each op.
    GEMV_MODES = {
        "residual": ("copy", "residual"),
        "swiglu": ("norm", "swiglu"),
        "norm": ("norm", "plain"),
        "plain": ("copy", "plain"),
        "geglu": ("res", "geglu"),
        "res_logits": ("res_final", "plain"),
    }
    # The inputs each prologue reads, in the kernels' order (the weights follow).
    PROLOGUE_INPUTS = {"copy": ["x"], "norm": ["x", "nw"], "res": ["x", "h", "wpost", "nw"],
                       "res_final": ["x", "h", "wpost", "nw"]}

    def _prologue(self, pre: str, vals: int) -> str:
        """CUDA statements staging the GEMV's input in ``xs`` (see ``GEMV_MODES``)."""
        eps = _f(self.eps)
        if pre in ("copy", "norm"):
            return (f"pl_load_x<T, K, NT, {str(pre == 'norm').lower()}, {vals}>"
                    f"(x, {'nw' if pre == 'norm' else 'x'}, {eps}, xs, red);")
        write = pre == "res"
        return (f"__shared__ __align__(16) T hs[K];\n"
                f"  pl_load_x_res<T, K, NT, {vals}, {str(self.dtype == mx.float16).lower()}, {str(write).lower()}>"
                f"(h, x, wpost, nw, {eps}, xs, hs, red, {'hout' if write else '(T*)nullptr'});")

    def _gemv_kernel(self, proj: Proj, mode: str, proj2: Proj | None = None):
        pre, post = self.GEMV_MODES[mode]

        def make():
            pair = post in ("swiglu", "geglu")
            n_out = proj.out_dim // 2 if post == "swiglu" else proj.out_dim
            units = units_per_warp(2 * n_out if pair else n_out, "swiglu" if pair else mode)
            r = 2 * units if post == "swiglu" else units
            if post == "swiglu":
                rows = f"rows[2 * u] = min(u0 + u, N - 1); rows[2 * u + 1] = rows[2 * u] + N;"
                store = """
    const T gt = static_cast<T>(acc[2 * u]);
    const float gf = static_cast<float>(gt);
    const T sg = static_cast<T>(1.f / (1.f + expf(-gf)));
    const T sl = static_cast<T>(gf * static_cast<float>(sg));
    out[u0 + u] = static_cast<T>(static_cast<float>(sl) * static_cast<float>(static_cast<T>(acc[2 * u + 1])));"""
            elif post == "geglu":
                rows = "rows[u] = min(u0 + u, N - 1);"
                store = """
    const T ge = pl_gelu_approx<T>(static_cast<float>(static_cast<T>(acc[u])));
    out[u0 + u] = static_cast<T>(static_cast<float>(ge) * static_cast<float>(static_cast<T>(acc2[u])));"""
            elif post == "residual":
                rows = "rows[u] = min(u0 + u, N - 1);"
                store = """
    out[u0 + u] = static_cast<T>(static_cast<float>(static_cast<T>(acc[u])) + static_cast<float>(r[u0 + u]));"""
            else:
                rows = "rows[u] = min(u0 + u, N - 1);"
                store = """
    out[u0 + u] = static_cast<T>(acc[u]);"""
            if post == "geglu":
                dots = f"float acc2[{r}];\n  {proj.rows_dot(r, 'g')}\n  {proj2.rows_dot(r, 'u', 'acc2')}"
            else:
                dots = proj.rows_dot(r)
            src = f"""
  constexpr int K = {proj.in_dim}, NT = 256, N = {n_out}, U = {units};
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  {self._prologue(pre, proj.vals(self.dtype))}
  const int lane = threadIdx.x & 31;
  const int u0 = (blockIdx.x * (NT / 32) + (threadIdx.x >> 5)) * U;
  if (u0 >= N) return;
  int rows[{r}];
  float acc[{r}];
#pragma unroll
  for (int u = 0; u < U; u++) {{ {rows} }}
  {dots}
  if (lane != 0) return;
#pragma unroll
  for (int u = 0; u < U; u++) {{
    if (u0 + u >= N) break;{store}
  }}
"""
            names = list(self.PROLOGUE_INPUTS[pre])
            names += [*proj.names("g"), *proj2.names("u")] if post == "geglu" else proj.names()
            names += ["r"] if post == "residual" else []
            outs = ["out", "hout"] if pre == "res" else ["out"]
            return mx.fast.cuda_kernel(name=f"pl_gemv_{mode}", input_names=names, output_names=outs,
                                       source=src, header=_HEADER), -(-n_out // units), n_out

        sig = lambda p: None if p is None else (p.bits, p.group_size, p.in_dim, p.out_dim)  # noqa: E731
        return self._kernel(("gemv", mode, sig(proj), sig(proj2)), make)

    def _embed_kernel(self):
        e = self.embed

        def make():
            n = self.hidden
            if e.bits:
                per = 32 // e.bits
                val = (f"static_cast<float>(s[(size_t)tok * {n // e.group_size} + i / {e.group_size}]) * "
                       f"static_cast<float>((w[(size_t)tok * {n // per} + i / {per}] >> ({e.bits} * (i % {per}))) "
                       f"& {(1 << e.bits) - 1}u) + "
                       f"static_cast<float>(b[(size_t)tok * {n // e.group_size} + i / {e.group_size}])")
            else:
                val = f"static_cast<float>(w[(size_t)tok * {n} + i])"
            if self.embed_scale is not None:  # Gemma 3: the embedding (in T) times the scale (in T)
                val = f"static_cast<float>(static_cast<T>({val})) * {_f(self.embed_scale)}"
            src = f"""
  const size_t tok = static_cast<size_t>(ids[0]);
  for (int i = threadIdx.x; i < {n}; i += blockDim.x) out[i] = static_cast<T>({val});
"""
            return mx.fast.cuda_kernel(name="pl_embed", input_names=["ids", *e.names()], output_names=["out"],
                                       source=src, header=_HEADER)

        return self._kernel(("embed",), make)

    # -- the step -------------------------------------------------------------------------------------

    def prepare(self, caches, n_positions: int) -> None:
        """Make every cache buffer hold at least ``n_positions`` positions (a ring: ``min(n_positions,
        max_size)`` slots), row-contiguous and materialized (MLX returns the update itself for a slice
        update that covers the whole buffer: a prefill that fills the buffer leaves it a transposed view of
        the new keys), and size the attention scratch (``n_heads * ceil(n_positions /
        128) * (head_dim + 2)`` float32)."""
        for c in caches:
            c.reserve(n_positions)
            if c.keys is not None:  # a prefill that filled the whole buffer left it a view of its keys
                c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)
        mx.eval([c.state for c in caches])
        splits = -(-n_positions // ATTN_CHUNK)
        need = self.n_heads * splits * (self.head_dim + 2)
        if self._scratch is None or self._scratch.size < need:
            self._scratch = mx.zeros((need,), mx.float32)
            mx.eval(self._scratch, self._counts)

    def _embed(self, token: mx.array) -> mx.array:
        return self._embed_kernel()(inputs=[token, *self.embed.arrays], template=[("T", self.dtype)],
                                    grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(self.hidden,)],
                                    output_dtypes=[self.dtype])[0]

    def _attend(self, q: mx.array, pos: mx.array, n_ctx: int, cache) -> mx.array:
        """Attention output ``(n_heads * head_dim,)`` of the query ``q`` at position ``n_ctx`` over ``cache``."""
        win = cache.max_size or 0
        n_keys = min(n_ctx + 1, win) if win else n_ctx + 1
        splits = -(-n_keys // ATTN_CHUNK)
        return self._attn_kernel(win)(
            inputs=[q, cache.keys, cache.values, pos, self._scratch, self._counts], template=[("T", self.dtype)],
            grid=(splits * ATTN_CHUNK, self.n_heads, 1), threadgroup=(ATTN_CHUNK, 1, 1),
            output_shapes=[(self.n_heads * self.head_dim,)], output_dtypes=[self.dtype])[0]

    def step(self, token: mx.array, pos: mx.array, n_ctx: int, caches) -> mx.array:
        H, D = self.n_heads, self.head_dim
        h = self._embed(token)
        for lay, c in zip(self.layers, caches):
            qkv = lay["qkv"]
            kern, pairs = self._qkv_kernel(qkv, lay["traditional"], lay["pos_scale"], c.max_size or 0)
            extra = [qkv.bias] if qkv.bias is not None else []
            q = self._launch(kern, [h, lay["in_norm"], *qkv.arrays, *extra, lay["inv_freq"], pos, c.keys, c.values],
                             -(-pairs // WARPS_PER_BLOCK), H * D)
            o = self._attend(q, pos, n_ctx, c)
            h = self._gemv(lay["o"], "residual", [o, *lay["o"].arrays, h])
            a = self._gemv(lay["gu"], "swiglu", [h, lay["post_norm"], *lay["gu"].arrays])
            h = self._gemv(lay["down"], "residual", [a, *lay["down"].arrays, h])
        logits = self._gemv(self.head, "norm", [h, self.final_norm, *self.head.arrays])
        return logits[None]

    def _launch(self, kern, inputs: list, blocks: int, n_out: int, res: bool = False):
        """Run a kernel of 256-thread blocks whose output is ``(n_out,)`` in the compute dtype; with
        ``res`` (a "res" prologue) also returns the new residual stream ``(hidden,)`` it writes."""
        outs = kern(inputs=inputs, template=[("T", self.dtype)], grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[(n_out,), (self.hidden,)] if res else [(n_out,)],
                    output_dtypes=[self.dtype] * (2 if res else 1))
        return (outs[0], outs[1]) if res else outs[0]

    def _gemv(self, proj: Proj, mode: str, inputs: list, proj2: Proj | None = None):
        """Launch a GEMV kernel (``GEMV_MODES``): its output ``(rows,)``, and for prologue "res" also
        the new residual stream ``(hidden,)``."""
        kern, warps, n_out = self._gemv_kernel(proj, mode, proj2)
        return self._launch(kern, inputs, -(-warps // WARPS_PER_BLOCK), n_out, self.GEMV_MODES[mode][0] == "res")


class Gemma3Decoder(FusedDecoder):
    """The fused decode step of a Gemma 3 text model (``pipeline.models.gemma3_text``, after mlx-lm's
    gemma3_text.py). Per layer five kernels:

    1. the previous layer's residual step (``h + rms_norm(down_out, post_feedforward_layernorm)``; the
       first layer starts from the scaled embedding), RMSNorm, the q/k/v projections, the per-head
       q/k RMSNorms, RoPE (local base on sliding layers), and the key/value written into the cache
       (one block per head: the per-head norms need the whole head);
    2. attention (a sliding layer's ``RotatingKVCache`` ring holds exactly the query's window);
    3. o_proj;
    4. ``h + rms_norm(o_out, post_attention_layernorm)``, ``pre_feedforward_layernorm``, the gate and up
       projections and ``gelu_approx(gate) * up``;
    5. down_proj;

    and the final kernel does the last residual step, the final norm and the (tied) output projection.
    Gemma's norm weights are offsets from 1 (``1 + w`` is precomputed in the compute dtype, as the model
    computes it); in float16 the residual sums are taken in float32 and clipped to the float16 range;
    the embedding is scaled by ``sqrt(hidden_size)`` rounded to bfloat16 — all as mlx-lm's model does.
    """

    def __init__(self, model):
        super().__init__(model)
        self.final_norm = 1.0 + model.model.norm.weight
        self.embed_scale = mx.array(self.hidden**0.5, mx.bfloat16).astype(self.dtype).item()
        mx.eval(self.final_norm)

    def _read_layer(self, layer) -> dict:
        a, m = layer.self_attn, layer.mlp
        inv, pscale, trad = _rope_table(a.rope, self.head_dim)
        one = lambda norm: 1.0 + norm.weight  # noqa: E731 - Gemma's RMSNorm scales by 1 + weight
        return {"in_norm": one(layer.input_layernorm), "post_attn": one(layer.post_attention_layernorm),
                "pre_ff": one(layer.pre_feedforward_layernorm), "post_ff": one(layer.post_feedforward_layernorm),
                "q_norm": one(a.q_norm), "k_norm": one(a.k_norm),
                "q": Proj(a.q_proj), "k": Proj(a.k_proj), "v": Proj(a.v_proj), "o": Proj(a.o_proj),
                "gate": Proj(m.gate_proj), "up": Proj(m.up_proj), "down": Proj(m.down_proj),
                "inv_freq": inv, "pos_scale": pscale, "traditional": trad}

    def _gemma_qkv_kernel(self, lay: dict, res: bool, win: int):
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = lay["q"], lay["k"], lay["v"]
        trad, pscale = lay["traditional"], lay["pos_scale"]
        units = 4

        def make():
            def head_rows(proj: Proj, prefix: str, first: str) -> str:
                return f"""
    for (int i0 = warp * U; i0 < D; i0 += NW * U) {{
      int rows[U];
      float acc[U];
#pragma unroll
      for (int u = 0; u < U; u++) rows[u] = ({first}) * D + i0 + u;
      {proj.rows_dot(units, prefix)}
      if (lane == 0) {{
#pragma unroll
        for (int u = 0; u < U; u++) ys[i0 + u] = static_cast<float>(static_cast<T>(acc[u]));
      }}
    }}"""

            prologue = self._prologue("res" if res else "norm", q.vals(self.dtype))
            src = f"""
  constexpr int K = {self.hidden}, NT = 256, NW = NT / 32, D = {D}, H = {H}, KVH = {KVH}, U = {units}, WIN = {win};
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ float ys[D];
  __shared__ float yn[D];
  {prologue}
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = blockIdx.x;
  if (head < H) {{{head_rows(q, "q", "head")}
  }} else if (head < H + KVH) {{{head_rows(k, "k", "head - H")}
  }} else {{{head_rows(v, "v", "head - H - KVH")}
  }}
  __syncthreads();
  const int ps = pos[0];
  const int slot = WIN ? ps % WIN : ps;
  const size_t cap = kc_shape[2];
  if (head >= H + KVH) {{
    T* dst = const_cast<T*>(vc) + ((size_t)(head - H - KVH) * cap + slot) * D;
    for (int d = threadIdx.x; d < D; d += NT) dst[d] = static_cast<T>(ys[d]);
    return;
  }}
  const T* hw = head < H ? qn : kn;
  float ss = 0.f;
  for (int d = threadIdx.x; d < D; d += NT) ss += ys[d] * ys[d];
  const float rr = rsqrtf(pl_block_sum<NT>(ss, red) / D + {_f(self.eps)});
  for (int d = threadIdx.x; d < D; d += NT) {{
    const T n = static_cast<T>(ys[d] * rr);
    yn[d] = static_cast<float>(static_cast<T>(static_cast<float>(hw[d]) * static_cast<float>(n)));
  }}
  __syncthreads();
  T* dst = head < H ? q + (size_t)head * D : const_cast<T*>(kc) + ((size_t)(head - H) * cap + slot) * D;
  for (int j = threadIdx.x; j < D / 2; j += NT) {{
    const int i0 = {int(trad)} ? 2 * j : j, i1 = {int(trad)} ? 2 * j + 1 : j + D / 2;
    const float th = static_cast<float>(ps) * {_f(pscale)} * inv_freq[j];
    const float c = cosf(th), sn = sinf(th);
    dst[i0] = static_cast<T>(yn[i0] * c - yn[i1] * sn);
    dst[i1] = static_cast<T>(yn[i0] * sn + yn[i1] * c);
  }}
"""
            names = [*self.PROLOGUE_INPUTS["res" if res else "norm"], *q.names("q"), *k.names("k"),
                     *v.names("v"), "qn", "kn", "inv_freq", "pos", "kc", "vc"]
            return mx.fast.cuda_kernel(name="pl_qkv_gemma", input_names=names,
                                       output_names=["q", "hout"] if res else ["q"], source=src, header=_HEADER)

        sig = tuple((p.bits, p.group_size, p.in_dim, p.out_dim) for p in (q, k, v))
        return self._kernel(("gemma_qkv", sig, trad, pscale, res, win), make)

    def step(self, token: mx.array, pos: mx.array, n_ctx: int, caches) -> mx.array:
        H, D = self.n_heads, self.head_dim
        h = self._embed(token)
        pending = None  # the previous layer's down_proj output and post-feedforward norm, not yet added to h
        for lay, c in zip(self.layers, caches):
            kern = self._gemma_qkv_kernel(lay, pending is not None, c.max_size or 0)
            qkv = [*lay["q"].arrays, *lay["k"].arrays, *lay["v"].arrays]
            front = [pending[0], h, pending[1]] if pending is not None else [h]
            inputs = [*front, lay["in_norm"], *qkv, lay["q_norm"], lay["k_norm"], lay["inv_freq"], pos, c.keys, c.values]
            blocks = H + 2 * self.n_kv_heads  # one per q, k and v head
            if pending is None:
                q = self._launch(kern, inputs, blocks, H * D)
            else:
                q, h = self._launch(kern, inputs, blocks, H * D, res=True)
            o = self._attend(q, pos, n_ctx, c)
            y = self._gemv(lay["o"], "plain", [o, *lay["o"].arrays])
            a, h = self._gemv(lay["gate"], "geglu", [y, h, lay["post_attn"], lay["pre_ff"], *lay["gate"].arrays,
                                                     *lay["up"].arrays], proj2=lay["up"])
            y = self._gemv(lay["down"], "plain", [a, *lay["down"].arrays])
            pending = (y, lay["post_ff"])
        logits = self._gemv(self.head, "res_logits", [pending[0], h, pending[1], self.final_norm, *self.head.arrays])
        return logits[None]


def decoder_for(model) -> FusedDecoder:
    """The fused decoder class for ``model``'s family, built (``Gemma3Decoder`` for Gemma 3).

    Raises:
        ValueError: the model is not supported (``model_blocker`` gives the reason).
    """
    from ..models import gemma3_text

    return (Gemma3Decoder if type(model) is gemma3_text.Model else FusedDecoder)(model)


def model_blocker(model) -> str | None:
    """Why the fused step cannot run ``model``, or None."""
    from ..models import gemma3_text, llama, qwen2

    gemma = type(model) is gemma3_text.Model
    if type(model) not in (llama.Model, qwen2.Model) and not gemma:
        return f"model family {type(model).__module__.rsplit('.', 1)[-1]} has no fused step"
    inner = model.model
    dtype = inner.norm.weight.dtype
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"compute dtype {dtype}"
    attn0 = inner.layers[0].self_attn
    head_dim = _head_dim(model)
    if head_dim % 8 or head_dim > 1024 or attn0.n_heads % attn0.n_kv_heads:
        return f"head_dim {head_dim}"
    # Gemma's q/k/v kernel stages x and the residual (hidden values each) and two head rows of floats.
    if gemma and 2 * model.args.hidden_size * dtype.size + 2 * 4 * head_dim > MAX_SMEM_BYTES - 1024:
        return f"hidden size {model.args.hidden_size} too large for one block's shared memory"
    projs = [Proj(inner.embed_tokens)] + ([Proj(model.lm_head)] if "lm_head" in model else [])
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        if type(a.rope).__name__ not in ("RoPE", "Llama3RoPE") or a.rope.dims != head_dim:
            return "RoPE variant"
        if gemma:
            groups = [[Proj(a.q_proj), Proj(a.k_proj), Proj(a.v_proj)], [Proj(m.gate_proj), Proj(m.up_proj)]]
            for group in groups:
                if len({(p.bits, p.group_size) for p in group}) > 1:
                    return "q/k/v or gate/up projections of different quantization"
            layer_projs = [*groups[0], *groups[1], Proj(a.o_proj), Proj(m.down_proj)]
            if any(p.bias is not None for p in layer_projs):
                return "biased projections"
            projs += layer_projs
            continue
        if "qkv_proj" not in a or "gate_up_proj" not in m:
            return "q/k/v or gate/up projections are not fused (their weights differ in kind)"
        if "bias" in m.down_proj or "bias" in a.o_proj or "bias" in m.gate_up_proj:
            return "biased o/MLP projections"
        projs += [Proj(a.qkv_proj), Proj(a.o_proj), Proj(m.gate_up_proj), Proj(m.down_proj)]
    for p in projs:
        why = p.problem(dtype)
        if why:
            return why
    if projs[0].bits and projs[0].group_size > model.args.hidden_size:
        return "embedding group size"
    return None


def fused_blocker(model, caches) -> str | None:
    """Why the engine cannot decode ``model`` with these caches through the fused step, or None: only
    MLX's CUDA backend, dense caches (``KVCache`` or ``RotatingKVCache``, not quantized), and
    ``model_blocker``."""
    if not mx.cuda.is_available() or mx.default_device() != mx.gpu:
        return "not on MLX's CUDA backend"
    if any(type(c) not in (KVCache, RotatingKVCache) for c in caches):
        return "quantized KV caches"
    return model_blocker(model)
