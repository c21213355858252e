// Device helpers of the fused decode step: the `header` of every kernel (pipeline/engine/cuda/sources.py
// passes the text after the marker below to mx.fast.cuda_kernel verbatim).
//@ header

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

// Shared-memory slot of x[k] for the tensor-core GEMV (pl_mma_rows, below): within each 8 values, the order
// x0 x4 x1 x5 x2 x6 x3 x7 of the half2 pairs its 4-bit words unpack to.
__device__ __forceinline__ int pl_mma_slot(int k) {
  const int o = k & 7;
  return (k & ~7) | (4 * ((o & 3) >> 1) + 2 * (o & 1) + (o >> 2));
}

template <typename T, int VALS, int K, bool MMA>
__device__ __forceinline__ int pl_x_slot(int k) {
  return MMA ? pl_mma_slot(k) : pl_swz<T, VALS, K>(k);
}

// x (K values) into shared memory (swizzled; MMA: in pl_mma_slot order), through RMSNorm when NORM:
// y = w * T(x * rsqrt(mean(x^2) + eps)) (MLX's rms_norm rounding: the normalized value is rounded to
// T, then multiplied by the weight in T).
template <typename T, int K, int NT, bool NORM, int VALS, bool MMA = false>
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
      xs[pl_x_slot<T, VALS, K, MMA>(i)] = static_cast<T>(static_cast<float>(nw[i]) * static_cast<float>(y));
    }
  } else {
    for (int i = threadIdx.x; i < K; i += NT) xs[pl_x_slot<T, VALS, K, MMA>(i)] = x[i];
  }
  __syncthreads();
}

// Dot products of R weight rows with the staged x (K values), each summed over the warp into out[r].
// BITS 4 or 8: MLX affine quantization (uint32 words, 32/BITS values each, low bits first;
// value = scale * q + bias per GS values). BITS 0: dense weights of type T.
// Each lane reads 16-byte chunks of every row (a chunk never straddles a quantization group) and the
// matching x values once for all R rows: chunks lane, lane + STRIDE, ... (STRIDE 32: the warp covers the
// row; 256 with lane = threadIdx.x: the block's 8 warps split it, each warp's sums still partial).
// GX: x read from global memory in order (quantized only), not from the swizzled shared copy.
// UNROLL: the chunk loop's unrolling (how many chunks of every row a lane has in flight; calls.cu passes
// decoder.GEMV_UNROLL).
template <typename T, int BITS, int GS, int K, int R, int STRIDE = 32, bool GX = false, int UNROLL = 1>
__device__ __forceinline__ void pl_rows_dot(const uint32_t* wq, const T* wd, const T* sc, const T* bi,
                                            const int (&rows)[R], const T* xs, int lane, float (&out)[R]) {
  constexpr int PS = 16 / sizeof(T);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.f;
  if constexpr (BITS == 0) {
    constexpr int CH = K / PS;
#pragma unroll UNROLL
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
#pragma unroll UNROLL
    for (int c = lane; c < CH; c += STRIDE) {
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
        const uint4 xr = GX ? reinterpret_cast<const uint4*>(xs + c * VALS)[p]
                            : *reinterpret_cast<const uint4*>(xs + (p * CH + c) * PS);
        const T* xv = reinterpret_cast<const T*>(&xr);
#pragma unroll
        for (int e = 0; e < PS; e++) {
          xf[p * PS + e] = static_cast<float>(xv[e]);
          sx += xf[p * PS + e];
        }
      }
      // A quantized value q is read in place in its 16-bit half of the word, as the float 2^23 + q * 2^(BITS*p)
      // (p: its place in the half) minus 2^23, exactly q * 2^(BITS*p): a logic operation and a float add
      // instead of a shift and an integer-to-float conversion (a slower pipe than the FMA's). x is scaled by
      // 2^-(BITS*p) to match (exact: a power of two), so each product, and the sum, is bitwise what
      // float(q) * x gives.
      constexpr int HALF = PER / 2;
      float xg[VALS];
#pragma unroll
      for (int v = 0; v < VALS; v++) xg[v] = xf[v] * __uint_as_float((127u - BITS * ((v % PER) % HALF)) << 23);
#pragma unroll
      for (int r = 0; r < R; r++) {
        const uint32_t ws[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
        float qx = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const uint32_t lo = ws[i], hi = ws[i] >> 16;
#pragma unroll
          for (int j = 0; j < PER; j++) {
            const uint32_t m = (j < HALF ? lo : hi) & (((1u << BITS) - 1u) << (BITS * (j % HALF)));
            qx += (__uint_as_float(0x4B000000u | m) - 8388608.f) * xg[i * PER + j];
          }
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
// shared memory (swizzled; MMA: in pl_mma_slot order). hs: K values of shared memory for hn. When WRITE, the first
// block writes hn (the new residual stream) to hout.
template <typename T, int K, int NT, int VALS, bool CLIP, bool WRITE, bool MMA = false>
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
    xs[pl_x_slot<T, VALS, K, MMA>(i)] = static_cast<T>(static_cast<float>(wnorm[i]) * static_cast<float>(n));
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

// ---- Tensor-core GEMV of 4-bit weights (float16): pl_load_x_mma, pl_mma_rows (gemv.cu's body_mma) ----
// A warp computes 16 rows against x with mma.sync m16n8k16 (f16 inputs, f32 accumulation), x in column 0 of the
// 16x8 B tile (columns 1-7 zero). Lane (g = lane / 4, c = lane % 4) holds rows r0 (tile row g) and r1 (tile row
// g + 8); in group G (GS values) it reads GS / 32 words of each row, values G * GS + c * GS / 4 ... + GS / 4 - 1.
// A word's 8 values (q0 .. q7, low bits first) become the half2 pairs (q0, q4), (q1, q5), (q2, q6), (q3, q7) with
// one logic op and one exact float16 op each ((w & 0x000F000F) | 0x64006400 is the pair 1024 + q; the next nibble
// masked in place is 1024 + 16 q); the tile's k order is that pair order, so x is staged in the same order
// (pl_mma_slot). The products q * x are exact in the f32 accumulator; each group's sum is then scaled as in
// pl_rows_dot: s * sum(q x) + b * sum(x) (sum(x) per group staged in shared memory).

// x (or RMSNorm(x, nw)) into xs in pl_mma_slot order (pl_load_x), and sum(x) of each group into sxs.
template <typename T, int K, int NT, int GS>
__device__ __forceinline__ void pl_group_sums(const T* xs, float* sxs);

template <typename T, int K, int NT, bool NORM, int GS>
__device__ __forceinline__ void pl_load_x_mma(const T* x, const T* nw, float eps, T* xs, float* sxs, float* red) {
  pl_load_x<T, K, NT, NORM, 8, true>(x, nw, eps, xs, red);
  pl_group_sums<T, K, NT, GS>(xs, sxs);
}

// sum(x) of each group of GS staged values (any order within a group) into sxs; a block barrier after.
template <typename T, int K, int NT, int GS>
__device__ __forceinline__ void pl_group_sums(const T* xs, float* sxs) {
  const int lane = threadIdx.x & 31;
  for (int g = threadIdx.x >> 5; g < K / GS; g += NT / 32) {
    float v = 0.f;
    for (int k = lane; k < GS; k += 32) v += static_cast<float>(xs[g * GS + k]);
    v = pl_warp_sum(v);
    if (lane == 0) sxs[g] = v;
  }
  __syncthreads();
}

__device__ __forceinline__ uint32_t pl_q4_lo(uint32_t w) {  // (q0, q4) of w as exact float16 values
  const uint32_t h = (w & 0x000F000Fu) | 0x64006400u;
  const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pl_q4_hi(uint32_t w) {  // (q1, q5) of w: (1024 + 16 q) / 16 - 64
  const uint32_t h = (w & 0x00F000F0u) | 0x64006400u;
  const __half2 v = __hfma2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x2C00)),
                            __half2half2(__ushort_as_half(0xD400)));
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void pl_mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// N consecutive words (1, 2 or 4; aligned to 4 N bytes) in one load.
template <int N>
__device__ __forceinline__ void pl_load_words(const uint32_t* p, uint32_t (&q)[N]) {
  if constexpr (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    q[0] = v.x, q[1] = v.y, q[2] = v.z, q[3] = v.w;
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    q[0] = v.x, q[1] = v.y;
  } else {
    q[0] = p[0];
  }
}

// Rows r0 and r1 (see above) dotted with the staged x over the groups G = warp, warp + W, ... (W warps split
// the row), UG groups' words, scales and biases loaded before any is used (the scales loaded after each group's
// products left their latency exposed a group: Qwen2.5-7B shape, H200, replayed step 327.0 / 336.3 -> 353.6 / 355.3
// tok/s, docs/BENCHMARKS.md). o0 / o1: the sums of rows r0 / r1 in lanes c == 0.
// Row r1 is read from the second matrix (wq1, sc1, bi1): the same matrix again for one projection's rows, the up
// projection's for Gemma's gate/up (geglu).
template <typename T, int GS, int K, int W, int UG>
__device__ __forceinline__ void pl_mma_rows(const uint32_t* wq, const T* sc, const T* bi, const uint32_t* wq1,
                                            const T* sc1, const T* bi1, int r0, int r1, const T* xs,
                                            const float* sxs, int warp, int lane, float& o0, float& o1) {
  constexpr int NG = K / GS, WPT = GS / 32, WPR = K / 8;
  const int c = lane & 3;
  const uint32_t* w0 = wq + (size_t)r0 * WPR + c * WPT;
  const uint32_t* w1 = wq1 + (size_t)r1 * WPR + c * WPT;
  float acc0 = 0.f, acc1 = 0.f;
  for (int G0 = warp; G0 < NG; G0 += W * UG) {
    uint32_t q0[UG][WPT], q1[UG][WPT];
    T sb[UG][4];  // scale and bias of r0, then of r1
#pragma unroll
    for (int i = 0; i < UG; i++) {
      const int G = G0 + W * i;
      if (G < NG) {
        pl_load_words<WPT>(w0 + G * (GS / 8), q0[i]);
        pl_load_words<WPT>(w1 + G * (GS / 8), q1[i]);
        sb[i][0] = sc[(size_t)r0 * NG + G], sb[i][1] = bi[(size_t)r0 * NG + G];
        sb[i][2] = sc1[(size_t)r1 * NG + G], sb[i][3] = bi1[(size_t)r1 * NG + G];
      }
    }
#pragma unroll
    for (int i = 0; i < UG; i++) {
      const int G = G0 + W * i;
      if (G >= NG) break;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      const T* xg = xs + G * GS + c * (GS / 4);
#pragma unroll
      for (int j = 0; j < WPT; j++) {
        uint4 xv = make_uint4(0u, 0u, 0u, 0u);
        if (lane < 4) xv = *reinterpret_cast<const uint4*>(xg + 8 * j);
        const uint32_t a = q0[i][j], b = q1[i][j], a8 = a >> 8, b8 = b >> 8;
        pl_mma_f16(d, pl_q4_lo(a), pl_q4_lo(b), pl_q4_hi(a), pl_q4_hi(b), xv.x, xv.y);
        pl_mma_f16(d, pl_q4_lo(a8), pl_q4_lo(b8), pl_q4_hi(a8), pl_q4_hi(b8), xv.z, xv.w);
      }
      const float sx = sxs[G];
      acc0 += static_cast<float>(sb[i][0]) * d[0] + static_cast<float>(sb[i][1]) * sx;
      acc1 += static_cast<float>(sb[i][2]) * d[2] + static_cast<float>(sb[i][3]) * sx;
    }
  }
  o0 = acc0;
  o1 = acc1;
}

// Score of one key: the dot product of its row kr (D values of T, 16-byte aligned, read 16 bytes at a time) with the
// query qs (D floats, already scaled; shared memory), summed in float32 in index order (attn.cu's bodies).
template <typename T, int D>
__device__ __forceinline__ float pl_key_dot(const T* kr, const float* qs) {
  constexpr int VEC = 16 / sizeof(T);
  float acc = 0.f;
#pragma unroll
  for (int d = 0; d < D; d += VEC) {
    const uint4 v = *reinterpret_cast<const uint4*>(kr + d);
    const T* kv = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < VEC; i++) acc += qs[d + i] * static_cast<float>(kv[i]);
  }
  return acc;
}

// Prefetch of the n bytes at p into L2 (L1: into this SM's L1, PTX prefetch.global.L1): the caller asks for the
// 128-byte lines at byte offsets first, first + stride, ... (no registers, no wait).
template <bool L1>
__device__ __forceinline__ void pl_prefetch_lines(const void* p, size_t n, size_t first, size_t stride) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = first; o < n; o += stride) {
    if constexpr (L1) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(c + o));
    } else {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
    }
  }
}

// L2 prefetch of the n bytes at p by the whole grid: thread i of the grid (block-major) asks for lines i, i + grid
// threads, ...
__device__ __forceinline__ void pl_prefetch_l2(const void* p, size_t n) {
  const size_t stride = (size_t)gridDim.x * blockDim.x * 128;
  pl_prefetch_lines<false>(p, n, ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 128, stride);
}

// L2 prefetch, by the whole grid, of a layer's filled cache rows: each of the KVH kv heads' keys (kc) and values (vc),
// rows 0 .. min(pos + 1, WIN) - 1 (WIN 0: a full cache, rows 0 .. pos) of D values; the caches (.., KVH, cap, D), cap
// the caller's kc_shape[2] (MLX passes an input's shape as its own Shape type, not a pointer). Asked before the
// attention that reads them (LAYER_PREFETCH_KV, QKV_PREFETCH_KV).
template <typename T, int D, int KVH, int WIN>
__device__ __forceinline__ void pl_prefetch_kv(const T* kc, const T* vc, size_t cap, int pos) {
  const int len = WIN ? min(pos + 1, WIN) : pos + 1;
#pragma unroll 1
  for (int k = 0; k < KVH; k++) {
    pl_prefetch_l2(kc + (size_t)k * cap * D, (size_t)len * D * sizeof(T));
    pl_prefetch_l2(vc + (size_t)k * cap * D, (size_t)len * D * sizeof(T));
  }
}

// Barrier over the whole grid of a kernel whose blocks are all resident at once (pl_layer's grid: see layer.cu): bar[0] counts the blocks arrived, bar[32] (another 128-byte line, so the waiting
// blocks' reads do not contend with the arrivals) is the barrier's generation; the last block to arrive resets the
// count and advances the generation, which the others wait for. The state returns to count 0 after every barrier,
// so one buffer serves every launch. Writes before the barrier are visible to every block after it (fences before
// arriving and after leaving, as cooperative_groups' grid sync). A block that waits ~2^34 clock cycles (seconds)
// traps: a grid too large to be resident fails loudly rather than hanging.
__device__ __forceinline__ void pl_grid_sync(const unsigned* bar_in) {
  unsigned* bar = const_cast<unsigned*>(bar_in);
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* gen = bar + 32;
    const unsigned g = *gen;
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 32, 1u);
    } else {
      const long long t0 = clock64();
      while (*gen == g) {
        if (clock64() - t0 > (1ll << 34)) __trap();
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// The same barrier as one word (cooperative_groups' grid sync, CUDA 12 cooperative_groups/details/sync.h): every
// block adds 1 to bar[0], block 0 adds 0x80000000 - (gridDim.x - 1), so when the last block has arrived the word's
// top bit has flipped and its other bits are back where they were; each block waits for its top bit to differ from
// the one its own add returned. The last arrival itself releases the others (no reset, no second word), and any
// starting value works. With PL_SYNC_RA the arrival is an atom.add.release.gpu and the wait ld.acquire.gpu, instead
// of __threadfence() (fence.sc.gpu) on each side. Traps as pl_grid_sync.
template <bool PL_SYNC_RA>
__device__ __forceinline__ void pl_grid_sync_flip(const unsigned* bar_in) {
  unsigned* bar = const_cast<unsigned*>(bar_in);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned nb = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    unsigned old, now;
    if constexpr (PL_SYNC_RA) {
      asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(bar), "r"(nb) : "memory");
    } else {
      __threadfence();
      old = atomicAdd(bar, nb);
    }
    const long long t0 = clock64();
    do {
      if constexpr (PL_SYNC_RA) {
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
      } else {
        now = *reinterpret_cast<volatile unsigned*>(bar);
      }
      if (clock64() - t0 > (1ll << 34)) __trap();
    } while (((now ^ old) & 0x80000000u) == 0);
    if constexpr (!PL_SYNC_RA) __threadfence();
  }
  __syncthreads();
}
