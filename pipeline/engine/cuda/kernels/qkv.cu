// pl_qkv (Llama, Qwen2): RMSNorm of the hidden state x, the fused q/k/v projection (plus its bias), RoPE,
// and the new key and value written in place into slot pos (a ring of $window slots: pos % $window) of
// the layer's caches kc/vc; the query goes to q. One warp per rotation pair (rows r0 and r1 of one head),
// 256-thread blocks. $prefetch_kv: calls.cu's prefetch_kv or nothing (QKV_PREFETCH_KV). Filled in by FusedDecoder._qkv_kernel (pipeline/engine/cuda/decoder.py).
//
// bias: adds the projection's bias to output $y of row $row (only for biased projections, Qwen2).
//@ bias
$y = static_cast<float>(static_cast<T>($y + static_cast<float>(bias[$row])));
//@ body

  constexpr int K = $hidden, NT = 256, D = $head_dim, H = $n_heads, KVH = $n_kv_heads, WIN = $window;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
$prefetch_kv
  pl_load_x<T, K, NT, true, $vals>(x, nw, $eps, xs, red);
  const int lane = threadIdx.x & 31;
  const int p = blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
  if (p >= $pairs) return;
  const int head = p / (D / 2), j = p % (D / 2);
  const int r0 = head * D + ($traditional ? 2 * j : j);
  const int r1 = r0 + ($traditional ? 1 : D / 2);
  const int rows[2] = {r0, r1};
  float acc[2];
  $rows_dot
  const float a0 = acc[0], a1 = acc[1];
  if (lane != 0) return;
  float y0 = static_cast<float>(static_cast<T>(a0)), y1 = static_cast<float>(static_cast<T>(a1));
  $bias0
  $bias1
  const int ps = pos[0];
  const int slot = WIN ? ps % WIN : ps;
  T o0, o1;
  if (head < H + KVH) {
    const float th = static_cast<float>(ps) * $pos_scale * inv_freq[j];
    const float c = cosf(th), s = sinf(th);
    o0 = static_cast<T>(y0 * c - y1 * s);
    o1 = static_cast<T>(y0 * s + y1 * c);
  } else {
    o0 = static_cast<T>(y0);
    o1 = static_cast<T>(y1);
  }
  if (head < H) {
    q[r0] = o0;
    q[r1] = o1;
  } else {
    const int kv = head - H;
    T* dst = const_cast<T*>(kv < KVH ? kc : vc);
    const int hh = kv < KVH ? kv : kv - KVH;
    const size_t base = ((size_t)hh * kc_shape[2] + slot) * D;
    dst[base + (r0 - head * D)] = o0;
    dst[base + (r1 - head * D)] = o1;
  }
