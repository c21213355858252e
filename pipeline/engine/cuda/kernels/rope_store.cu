// pl_rope_store (the batched step, Llama/Qwen2): RoPE of each row's query and key heads at the row's own
// position pos[b], as MLX's mx.fast.rope computes it (theta = $pos_scale * pos * inv_freq; cos/sin in
// float32; the result rounded to T), and the row's new key and value written IN PLACE into slot pos[b]
// (a ring of $window slots: pos[b] % $window) of its rows of the layer's buffers kc/vc
// (B, $n_kv_heads, capacity, $head_dim); the roped queries go to q (B, $n_heads * $head_dim). One thread
// per (row, rotation pair); qkv (B, 1, ($n_heads + 2 * $n_kv_heads) * $head_dim) is the fused projection's
// output (its bias added). Every input is indexed through its strides (the kernel is built with
// ensure_row_contiguous=False: a copy of a buffer would take the write). Filled in by
// BatchedDecoder._rope_kernel (pipeline/engine/cuda/batched.py).
//
// inv_base: nn.RoPE's frequency as MLX's rope kernel computes it, exp2(-(j / (D / 2)) * log2(base)), with
//   $log2_base = log2f(base) (the float MLX passes).
// inv_freqs: Llama3RoPE's, 1 / freqs[j] (divided in double, as MLX's rope kernel does).
//@ inv_base
exp2f(-(static_cast<float>(j) / static_cast<float>(D / 2)) * $log2_base)
//@ inv_freqs
static_cast<float>(1.0 / static_cast<double>(freqs[j]))
//@ body

  constexpr int D = $head_dim, H = $n_heads, KVH = $n_kv_heads, WIN = $window, PAIRS = (H + 2 * KVH) * D / 2;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int n_rows = pos_shape[0];
  if (i >= static_cast<long long>(n_rows) * PAIRS) return;
  const int b = static_cast<int>(i / PAIRS), p = static_cast<int>(i % PAIRS);
  const int head = p / (D / 2), j = p % (D / 2);
  const int r0 = head * D + ($traditional ? 2 * j : j);
  const int r1 = r0 + ($traditional ? 1 : D / 2);
  const T* row = qkv + b * qkv_strides[0];
  const T x0 = row[r0 * qkv_strides[2]], x1 = row[r1 * qkv_strides[2]];
  const int ps = pos[b * pos_strides[0]];
  T o0 = x0, o1 = x1;
  if (head < H + KVH) {
    const float inv = $inv_freq;
    const float theta = ($pos_scale * static_cast<float>(ps)) * inv;
    const float c = cosf(theta), s = sinf(theta);
    const float y0 = static_cast<float>(x0), y1 = static_cast<float>(x1);
    o0 = static_cast<T>(y0 * c - y1 * s);
    o1 = static_cast<T>(y0 * s + y1 * c);
  }
  if (head < H) {
    q[static_cast<size_t>(b) * H * D + r0] = o0;
    q[static_cast<size_t>(b) * H * D + r1] = o1;
  } else {
    const bool is_k = head < H + KVH;
    const int hh = is_k ? head - H : head - H - KVH;
    const int slot = WIN ? ps % WIN : ps;
    T* dst = const_cast<T*>(is_k ? kc : vc);
    const long long s0 = is_k ? kc_strides[0] : vc_strides[0], s1 = is_k ? kc_strides[1] : vc_strides[1];
    const long long s2 = is_k ? kc_strides[2] : vc_strides[2], s3 = is_k ? kc_strides[3] : vc_strides[3];
    const long long base = b * s0 + hh * s1 + slot * s2;
    dst[base + (r0 - head * D) * s3] = o0;
    dst[base + (r1 - head * D) * s3] = o1;
  }
