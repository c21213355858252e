// pl_load_slots (the batched step's admission, Llama/Qwen2): copy the keys and values of requests just
// prefilled together (rows rows[i] of a group prefill's caches sk/sv (R, n_kv_heads, S, $head_dim)) IN
// PLACE into batch slots slots[i] of one layer's buffers dk/dv (B, n_kv_heads, capacity, $head_dim):
// position p < lengths[i] (the prompt) from the caches, every other position of the slot zero, as a fresh
// slot reads. One thread per (request, KV head, position, element); every array is indexed through its
// strides (built with ensure_row_contiguous=False: a copy of a buffer would take the write). done (1,) is
// written by thread 0 only, the array an evaluation waits on. Filled in by BatchedDecoder.load_slots
// (pipeline/engine/cuda/batched.py).
//@ body

  constexpr int D = $head_dim;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int n = slots_shape[0], H = dk_shape[1], CAP = dk_shape[2];
  if (i == 0) done[0] = n;
  if (i >= static_cast<long long>(n) * H * CAP * D) return;
  const int d = static_cast<int>(i % D), p = static_cast<int>((i / D) % CAP);
  const int h = static_cast<int>((i / (static_cast<long long>(D) * CAP)) % H);
  const int r = static_cast<int>(i / (static_cast<long long>(D) * CAP * H));
  const int row = rows[r * rows_strides[0]], slot = slots[r * slots_strides[0]];
  T k = static_cast<T>(0), v = static_cast<T>(0);
  if (p < lengths[r * lengths_strides[0]]) {
    k = sk[row * sk_strides[0] + h * sk_strides[1] + p * sk_strides[2] + d * sk_strides[3]];
    v = sv[row * sv_strides[0] + h * sv_strides[1] + p * sv_strides[2] + d * sv_strides[3]];
  }
  const_cast<T*>(dk)[slot * dk_strides[0] + h * dk_strides[1] + p * dk_strides[2] + d * dk_strides[3]] = k;
  const_cast<T*>(dv)[slot * dv_strides[0] + h * dv_strides[1] + p * dv_strides[2] + d * dv_strides[3]] = v;
