// pl_qkv_norm (Gemma 3, Qwen 3): the previous layer's residual step (Gemma 3) or the embedding / hidden
// state ($prologue), RMSNorm, the q, k and v projections, the per-head q/k RMSNorms (weights qn, kn), RoPE,
// and the key and value written in place into slot pos (a ring of $window slots: pos % $window) of kc/vc.
// Each q, k or v head's rows are spread over S = head_dim / (8 warps * $units rows) blocks, which write them to
// `qkv_rows` (float32, global); the last block of a head to finish (its count in `arrivals`, reset by that block)
// reads the whole head back and does its norm, RoPE and store: the per-head norms need the whole head, and one
// block a head left the GPU idle (Gemma-3-1B, 6 heads: 38 us a call on an H100, docs/BENCHMARKS.md). Filled in
// by FusedDecoder._qkv_norm_kernel (pipeline/engine/cuda/decoder.py).
//
// head_rows: row i0 .. i0 + $units - 1 of the block's head ($first: the index of its first weight row, in
// head_dim rows) into hrow. Separate q/k/v matrices: the head's index among the q, k or v heads; one fused q/k/v
// matrix (rows q heads, then k, then v): the head index itself.
//@ head_rows
    {
      int rows[U];
      float acc[U];
#pragma unroll
      for (int u = 0; u < U; u++) rows[u] = ($first) * D + i0 + u;
      $rows_dot
      if (lane == 0) {
#pragma unroll
        for (int u = 0; u < U; u++) hrow[i0 + u] = static_cast<float>(static_cast<T>(acc[u]));
      }
    }
//@ body

  constexpr int K = $hidden, NT = 256, NW = NT / 32, D = $head_dim, H = $n_heads, KVH = $n_kv_heads, U = $units, WIN = $window;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ float ys[D];
  __shared__ float yn[D];
  __shared__ int last;
  $prologue
  constexpr int R = NW * U, S = (D + R - 1) / R;  // rows a block, blocks a head
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = blockIdx.x / S, i0 = (blockIdx.x % S) * R + warp * U;
  float* const hrow = const_cast<float*>(qkv_rows) + (size_t)head * D;
  if (i0 < D) {
    if (head < H) {
$q_rows
    } else if (head < H + KVH) {
$k_rows
    } else {
$v_rows
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the head's last block to arrive goes on (CUDA's threadFenceReduction pattern)
    unsigned* count = const_cast<unsigned*>(arrivals) + head;
    __threadfence();
    last = atomicAdd(count, 1u) == S - 1;
    if (last) atomicExch(count, 0u);
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int d = threadIdx.x; d < D; d += NT) ys[d] = __ldcg(hrow + d);
  __syncthreads();
  const int ps = pos[0];
  const int slot = WIN ? ps % WIN : ps;
  const size_t cap = kc_shape[2];
  if (head >= H + KVH) {
    T* dst = const_cast<T*>(vc) + ((size_t)(head - H - KVH) * cap + slot) * D;
    for (int d = threadIdx.x; d < D; d += NT) dst[d] = static_cast<T>(ys[d]);
    return;
  }
  const T* hw = head < H ? qn : kn;
  float ss = 0.f;
  for (int d = threadIdx.x; d < D; d += NT) ss += ys[d] * ys[d];
  const float rr = rsqrtf(pl_block_sum<NT>(ss, red) / D + $eps);
  for (int d = threadIdx.x; d < D; d += NT) {
    const T n = static_cast<T>(ys[d] * rr);
    yn[d] = static_cast<float>(static_cast<T>(static_cast<float>(hw[d]) * static_cast<float>(n)));
  }
  __syncthreads();
  T* dst = head < H ? q + (size_t)head * D : const_cast<T*>(kc) + ((size_t)(head - H) * cap + slot) * D;
  for (int j = threadIdx.x; j < D / 2; j += NT) {
    const int i0 = $traditional ? 2 * j : j, i1 = $traditional ? 2 * j + 1 : j + D / 2;
    const float th = static_cast<float>(ps) * $pos_scale * inv_freq[j];
    const float c = cosf(th), sn = sinf(th);
    dst[i0] = static_cast<T>(yn[i0] * c - yn[i1] * sn);
    dst[i1] = static_cast<T>(yn[i0] * sn + yn[i1] * c);
  }
