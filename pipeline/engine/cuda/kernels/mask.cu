// pl_mask (structured output): the logits x (rows, $vocab), any float dtype, as float32 with every token that
// the row's llguidance bitmask does not allow set to -inf: token i of row r is allowed where bit i % 32 of
// words[r, i / 32] is set (words (rows, $words) uint32; ids from 32 * $words on: not allowed). One thread per
// logit. The same values as mx.where(unpacked bits, x.astype(float32), -inf). Filled in by
// pipeline/engine/cuda/mask.py.
//@ body

  constexpr int V = $vocab, W = $words;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(x_shape[0]) * V) return;
  const int r = static_cast<int>(i / V), id = static_cast<int>(i % V);
  const bool ok = id < 32 * W && ((words[static_cast<long long>(r) * W + (id >> 5)] >> (id & 31)) & 1u);
  out[i] = ok ? static_cast<float>(x[i]) : __int_as_float(0xff800000);
