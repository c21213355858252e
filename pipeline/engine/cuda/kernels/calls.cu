// Calls of common.cuh's helpers that the kernels share, filled in per projection by
// pipeline/engine/cuda/decoder.py (Proj.rows_dot, FusedDecoder._prologue). Each section after a
// "//@ name" line is one fragment; $names are string.Template placeholders.
//
// rows_dot_*: the warp's dot products of the weight rows rows[0..$rows) with the staged x (xs) into $acc;
//   $w, $s, $b the kernel's input names of the packed weights, scales and biases (quantized) or of the
//   dense weights ($w).
// rows_dot_split: the same, quantized, the row split over the block's threads (gemv.cu's body_split), x
//   read from global memory.
// load_x: x (or RMSNorm(x, nw) when $norm is true) into shared memory, swizzled for $vals-value loads.
// load_x_res: Gemma 3's residual step first (pl_load_x_res); $clip true in float16, $write true when the
//   kernel also writes the new residual stream ($hout = hout, else a null pointer).
// load_x_mma / load_x_res_mma: the same for the tensor-core GEMV (gemv.cu's body_mma): x in pl_mma_slot order and
//   each group's sum in sxs.
// prefetch_kv: the layer's filled cache rows into L2 (common.cuh's pl_prefetch_kv), by the whole grid.
//@ rows_dot_quantized
pl_rows_dot<T, $bits, $group_size, $in_dim, $rows, 32, false, $unroll>($w, (const T*)nullptr, $s, $b, rows, xs, lane, $acc);
//@ rows_dot_split
pl_rows_dot<T, $bits, $group_size, $in_dim, $rows, NT, true, $unroll>($w, (const T*)nullptr, $s, $b, rows, x, threadIdx.x, $acc);
//@ rows_dot_dense
pl_rows_dot<T, 0, 1, $in_dim, $rows, 32, false, $unroll>((const uint32_t*)nullptr, $w, (const T*)nullptr, (const T*)nullptr, rows, xs, lane, $acc);
//@ load_x
pl_load_x<T, K, NT, $norm, $vals>(x, $weight, $eps, xs, red);
//@ load_x_res
__shared__ __align__(16) T hs[K];
  pl_load_x_res<T, K, NT, $vals, $clip, $write>(h, x, wpost, nw, $eps, xs, hs, red, $hout);
//@ load_x_mma
pl_load_x_mma<T, K, NT, $norm, GS>(x, $weight, $eps, xs, sxs, red);
//@ load_x_res_mma
__shared__ __align__(16) T hs[K];
  pl_load_x_res<T, K, NT, 8, $clip, $write, true>(h, x, wpost, nw, $eps, xs, hs, red, $hout);
  pl_group_sums<T, K, NT, GS>(xs, sxs);
//@ prefetch_kv
  pl_prefetch_kv<T, $head_dim, $n_kv_heads, $window>(kc, vc, kc_shape[2], pos[0]);
