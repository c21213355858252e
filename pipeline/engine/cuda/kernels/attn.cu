// pl_attn: attention of each head's query q over the cache's filled slots 0..pos (a ring of $window
// slots: its min(pos + 1, $window) slots, exactly the query's window), in blocks of $chunk keys (one
// thread per key's score; the weighted values summed a warp per 32 keys, each lane a run of a row's
// values; grid (chunks * $chunk, heads), chunks >= the ceil(L / $chunk) that hold keys: the blocks past them
// return at once, so one grid, sized by the caches' capacity, serves every position and the step
// can be replayed by mx.compile). With several chunks each block writes its partial
// softmax (max, sum, weighted values) to scratch and the last block of a head to finish combines them,
// as in flash-decoding (counts: per-head arrival counters, reset by that block). Filled in by
// FusedDecoder._attn_kernel (pipeline/engine/cuda/decoder.py).
//@ body

  constexpr int D = $head_dim, CH = $chunk, NT = $chunk, G = $group, WIN = $window;
  __shared__ float qs[D];
  __shared__ float pr[CH];
  __shared__ float red[32];
  __shared__ int last;
  const int h = blockIdx.y, s = blockIdx.x, t = threadIdx.x;
  const int L = WIN ? min(pos[0] + 1, WIN) : pos[0] + 1;
  const int NS = (L + CH - 1) / CH;
  if (s >= NS) return;
  const size_t cap = kc_shape[2];
  const int kvh = h / G;
$v_prefetch
  for (int d = t; d < D; d += NT) qs[d] = static_cast<float>(q[h * D + d]) * $scale;
  __syncthreads();
  const int k = s * CH + t;
  const float sc = k < L ? pl_key_dot<T, D>(kc + ((size_t)kvh * cap + k) * D, qs) : PL_NEG_INF;
  const float m = pl_block_max<NT>(sc, red);
  const float e = (k < L) ? expf(sc - m) : 0.f;
  pr[t] = e;
  const float l = pl_block_sum<NT>(e, red);
  const int kend = min(CH, L - s * CH);
  float* part = const_cast<float*>(scratch) + ((size_t)h * NS + s) * (D + 2);
  const T* vbase = vc + ((size_t)kvh * cap + (size_t)s * CH) * D;
  // values of a value row per lane; at least 1 and a power-of-two alignment, so the branch below compiles
  // for every head size (a kernel is no template: a discarded `if constexpr` branch is still compiled)
  constexpr int VD = D >= 32 ? D / 32 : 1;
  if constexpr (D % 32 == 0 && (VD & (VD - 1)) == 0 && VD <= 8) {
    // The weighted values: warp w sums keys w*32 .. w*32+31 of the chunk, each lane VD consecutive values of
    // every row (one coalesced row read per warp and key), then the warps' sums are added.
    struct alignas((VD & (VD - 1)) == 0 ? VD * sizeof(T) : sizeof(T)) Vec { T v[VD]; };
    constexpr int NW = NT / 32;
    __shared__ float vpart[NW][D];
    const int w = t >> 5, lane = t & 31;
    float acc[VD];
#pragma unroll
    for (int j = 0; j < VD; j++) acc[j] = 0.f;
    const int i1 = min((w + 1) * 32, kend);
#pragma unroll 8
    for (int i = w * 32; i < i1; i++) {
      const float p = pr[i];
      const Vec vv = *reinterpret_cast<const Vec*>(vbase + (size_t)i * D + lane * VD);
#pragma unroll
      for (int j = 0; j < VD; j++) acc[j] += p * static_cast<float>(vv.v[j]);
    }
#pragma unroll
    for (int j = 0; j < VD; j++) vpart[w][lane * VD + j] = acc[j];
    __syncthreads();
    for (int d = t; d < D; d += NT) {
      float a = 0.f;
#pragma unroll
      for (int k2 = 0; k2 < NW; k2++) a += vpart[k2][d];
      if (NS == 1) o[h * D + d] = static_cast<T>(a / l);
      else part[2 + d] = a;
    }
  } else {
    for (int d = t; d < D; d += NT) {
      const T* vr = vbase + d;
      float acc = 0.f;
      for (int i = 0; i < kend; i++) acc += pr[i] * static_cast<float>(vr[(size_t)i * D]);
      if (NS == 1) o[h * D + d] = static_cast<T>(acc / l);
      else part[2 + d] = acc;
    }
  }
  if (NS == 1) return;
  if (t == 0) {
    part[0] = m;
    part[1] = l;
  }
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
  for (int d = t; d < D; d += NT) {
    float num = 0.f;
    for (int i = 0; i < NS; i++)
      num += __ldcg(base + (size_t)i * (D + 2) + 2 + d) * expf(__ldcg(base + (size_t)i * (D + 2)) - M);
    o[h * D + d] = static_cast<T>(num / den);
  }
  if (t == 0) const_cast<int*>(counts)[h] = 0;
//@ v_prefetch
  // The chunk's value rows (contiguous: its min(CH, L - s * CH) rows of D values) asked of L2 (L1 when $l1) before the
  // scores, which they do not depend on, so the weighted sum below finds them there (ATTN_V_PREFETCH): a 128-byte
  // line a thread in turn.
  pl_prefetch_lines<$l1>(vc + ((size_t)kvh * cap + (size_t)s * CH) * D, (size_t)min(CH, L - s * CH) * D * sizeof(T),
                         (size_t)t * 128, (size_t)NT * 128);
//@ warp_body
  // One WARP (not a block) per chunk of 32 keys of head h (pl_layer's "warps" phase, LAYER_ATTN "warp"): lane i
  // scores key s * 32 + i, the softmax's max and sum are the warp's, each lane sums $head_dim / 32 consecutive values
  // of the 32 value rows (all 32 loads in flight), and with several chunks the last warp of the head to finish
  // combines the partials (max, sum, weighted values) from scratch as the block version above does. Needs
  // $head_dim a multiple of 32 with $head_dim / 32 a power of two <= 8 (FusedDecoder.layer_attn).
  constexpr int D = $head_dim, G = $group, WIN = $window, VD = D / 32;
  static_assert(D % 32 == 0 && (VD & (VD - 1)) == 0 && VD <= 8, "warp attention: head size");
  struct alignas(VD * sizeof(T)) Vec { T v[VD]; };
  __shared__ float pl_aq[8][D];
  const int h = blockIdx.y, s = blockIdx.x, lane = threadIdx.x & 31;
  float* const qs = pl_aq[threadIdx.x >> 5];
  const int L = WIN ? min(pos[0] + 1, WIN) : pos[0] + 1;
  const int NS = (L + 31) / 32;
  const size_t cap = kc_shape[2];
  const int kvh = h / G;
#pragma unroll
  for (int j = 0; j < VD; j++) qs[lane * VD + j] = static_cast<float>(q[h * D + lane * VD + j]) * $scale;
  __syncwarp();
  const int k = s * 32 + lane;
  const float sc = k < L ? pl_key_dot<T, D>(kc + ((size_t)kvh * cap + k) * D, qs) : PL_NEG_INF;
  const float m = pl_warp_max(sc);
  const float e = (k < L) ? expf(sc - m) : 0.f;
  const float l = pl_warp_sum(e);
  const int kend = min(32, L - s * 32);
  const T* vbase = vc + ((size_t)kvh * cap + (size_t)s * 32) * D + lane * VD;
  float acc[VD];
#pragma unroll
  for (int j = 0; j < VD; j++) acc[j] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; i++) {
    const float p = __shfl_sync(0xffffffffu, e, i);
    if (i < kend) {
      const Vec vv = *reinterpret_cast<const Vec*>(vbase + (size_t)i * D);
#pragma unroll
      for (int j = 0; j < VD; j++) acc[j] += p * static_cast<float>(vv.v[j]);
    }
  }
  if (NS == 1) {
#pragma unroll
    for (int j = 0; j < VD; j++) o[h * D + lane * VD + j] = static_cast<T>(acc[j] / l);
    return;
  }
  float* part = const_cast<float*>(scratch) + ((size_t)h * NS + s) * (D + 2);
  if (lane == 0) {
    part[0] = m;
    part[1] = l;
  }
#pragma unroll
  for (int j = 0; j < VD; j++) part[2 + lane * VD + j] = acc[j];
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(const_cast<int*>(counts) + h, 1) == NS - 1;
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  const float* base = scratch + (size_t)h * NS * (D + 2);
  float M = PL_NEG_INF;
  for (int i = lane; i < NS; i += 32) M = fmaxf(M, __ldcg(base + (size_t)i * (D + 2)));
  M = pl_warp_max(M);
  float den = 0.f;
  for (int i = lane; i < NS; i += 32)
    den += __ldcg(base + (size_t)i * (D + 2) + 1) * expf(__ldcg(base + (size_t)i * (D + 2)) - M);
  den = pl_warp_sum(den);
  float num[VD];
#pragma unroll
  for (int j = 0; j < VD; j++) num[j] = 0.f;
  for (int i = 0; i < NS; i++) {
    const float f = expf(__ldcg(base + (size_t)i * (D + 2)) - M);
#pragma unroll
    for (int j = 0; j < VD; j++) num[j] += __ldcg(base + (size_t)i * (D + 2) + 2 + lane * VD + j) * f;
  }
#pragma unroll
  for (int j = 0; j < VD; j++) o[h * D + lane * VD + j] = static_cast<T>(num[j] / den);
  if (lane == 0) const_cast<int*>(counts)[h] = 0;
