// pl_batch_attn (the batched step): attention of each row's $group query heads of one KV head over that
// row's filled slots of the layer's buffers kc/vc (B, $n_kv_heads, capacity, $head_dim): slots 0..pos[b]
// (a ring of $window slots: its min(pos[b] + 1, $window) slots, exactly the query's window). Grid
// (chunks * $chunk, $n_kv_heads, B), one block of $chunk threads per (chunk of $chunk keys, KV head, row),
// one thread per key; the K/V rows are read once for the head group (GQA). A chunk past the row's
// filled slots returns at once; a row of several chunks combines them as in flash-decoding (attn.cu):
// each block writes its partial softmax (max, sum, weighted values per head) to scratch
// (B * $n_heads * chunks * ($head_dim + 2) float32), and the last block of the (row, KV head) to arrive
// (counts: B * $n_kv_heads arrival counters, reset by that block) combines them in chunk order. float32
// throughout; o (B, $n_heads * $head_dim) in T. Filled in by BatchedDecoder._attn_kernel
// (pipeline/engine/cuda/batched.py).
//@ body

  constexpr int D = $head_dim, CH = $chunk, NT = $chunk, G = $group, KVH = $n_kv_heads, H = KVH * G;
  constexpr int VEC = 16 / sizeof(T), WIN = $window, P = D + 2;
  __shared__ float qs[G * D];
  __shared__ float pr[G * CH];
  __shared__ float ms[G], ls[G];
  __shared__ float red[32];
  __shared__ int last;
  const int s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, NS = gridDim.x, t = threadIdx.x;
  const int ps = pos[b];
  const int L = WIN ? min(ps + 1, WIN) : ps + 1;
  const int ns = min((L + CH - 1) / CH, NS);
  if (s >= ns) return;
  const size_t cap = kc_shape[2];
  const size_t kv_row = (static_cast<size_t>(b) * KVH + kvh) * cap;
  const T* qb = q + (static_cast<size_t>(b) * H + static_cast<size_t>(kvh) * G) * D;
  for (int i = t; i < G * D; i += NT) qs[i] = static_cast<float>(qb[i]) * $scale;
  __syncthreads();
  const int k = s * CH + t;
  const bool live = k < L;
  float sc[G];
#pragma unroll
  for (int g = 0; g < G; g++) sc[g] = 0.f;
  if (live) {
    const T* kr = kc + (kv_row + k) * D;
#pragma unroll 4
    for (int d = 0; d < D; d += VEC) {
      const uint4 v = *reinterpret_cast<const uint4*>(kr + d);
      const T* kv = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int e = 0; e < VEC; e++) {
        const float kf = static_cast<float>(kv[e]);
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] += qs[g * D + d + e] * kf;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; g++) {
    const float m = pl_block_max<NT>(live ? sc[g] : PL_NEG_INF, red);
    const float e = live ? expf(sc[g] - m) : 0.f;
    pr[g * CH + t] = e;
    const float l = pl_block_sum<NT>(e, red);
    if (t == 0) {
      ms[g] = m;
      ls[g] = l;
    }
  }
  __syncthreads();
  const int kend = min(CH, L - s * CH);
  float* scr = const_cast<float*>(scratch);
  const T* vb = vc + (kv_row + static_cast<size_t>(s) * CH) * D;
  for (int c = t; c < G * D; c += NT) {
    const int g = c / D, d = c % D;
    const float* pg = pr + g * CH;
    float acc = 0.f;
    for (int i = 0; i < kend; i++) acc += pg[i] * static_cast<float>(vb[static_cast<size_t>(i) * D + d]);
    const size_t h = static_cast<size_t>(b) * H + kvh * G + g;
    if (ns == 1) o[h * D + d] = static_cast<T>(acc / ls[g]);
    else scr[(h * NS + s) * P + 2 + d] = acc;
  }
  if (ns == 1) return;
  if (t < G) {
    const size_t h = static_cast<size_t>(b) * H + kvh * G + t;
    scr[(h * NS + s) * P] = ms[t];
    scr[(h * NS + s) * P + 1] = ls[t];
  }
  __threadfence();
  __syncthreads();
  int* cnt = const_cast<int*>(counts) + static_cast<size_t>(b) * KVH + kvh;
  if (t == 0) last = (atomicAdd(cnt, 1) == ns - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (t < G) {
    const float* base = scratch + (static_cast<size_t>(b) * H + kvh * G + t) * NS * P;
    float M = PL_NEG_INF;
    for (int i = 0; i < ns; i++) M = fmaxf(M, __ldcg(base + static_cast<size_t>(i) * P));
    float den = 0.f;
    for (int i = 0; i < ns; i++)
      den += __ldcg(base + static_cast<size_t>(i) * P + 1) * expf(__ldcg(base + static_cast<size_t>(i) * P) - M);
    ms[t] = M;
    ls[t] = den;
  }
  __syncthreads();
  for (int c = t; c < G * D; c += NT) {
    const int g = c / D, d = c % D;
    const size_t h = static_cast<size_t>(b) * H + kvh * G + g;
    const float* base = scratch + h * NS * P;
    float num = 0.f;
    for (int i = 0; i < ns; i++)
      num += __ldcg(base + static_cast<size_t>(i) * P + 2 + d) * expf(__ldcg(base + static_cast<size_t>(i) * P) - ms[g]);
    o[h * D + d] = static_cast<T>(num / ls[g]);
  }
  if (t == 0) *cnt = 0;
