// pl_gemv_<mode>: one projection y = W x as a warp-per-row GEMV ($units rows, or row pairs, per warp);
// the prologue stages x in shared memory ($prologue: calls.cu's load_x or load_x_res), the epilogue
// stores the rows. Filled in by FusedDecoder._gemv_kernel (pipeline/engine/cuda/decoder.py), whose
// GEMV_MODES name the prologue and epilogue of each mode. MLX's rounding to T after each op.
//
// body_split: the same for a long input (prologue "copy", quantized weights): the block's 8 warps split
// every row of its $units, x read from global memory (no staging); the warps' sums added in shared memory.
//
// row_index: the weight row of unit u; row_index_pair (swiglu): the gate row and the up row N below it.
// dots_geglu: the gate and the up projection (two matrices) into acc and acc2.
// store_*: out = T(W x) (plain); T(T(W x) + r) (residual); silu(gate) * up (swiglu);
//   gelu_approx(gate) * up (geglu).
//@ row_index
rows[u] = min(u0 + u, N - 1);
//@ row_index_pair
rows[2 * u] = min(u0 + u, N - 1); rows[2 * u + 1] = rows[2 * u] + N;
//@ dots_geglu
float acc2[$n_rows];
  $gate_dot
  $up_dot
//@ store_plain
    out[u0 + u] = static_cast<T>(acc[u]);
//@ store_residual
    out[u0 + u] = static_cast<T>(static_cast<float>(static_cast<T>(acc[u])) + static_cast<float>(r[u0 + u]));
//@ store_swiglu
    const T gt = static_cast<T>(acc[2 * u]);
    const float gf = static_cast<float>(gt);
    const T sg = static_cast<T>(1.f / (1.f + expf(-gf)));
    const T sl = static_cast<T>(gf * static_cast<float>(sg));
    out[u0 + u] = static_cast<T>(static_cast<float>(sl) * static_cast<float>(static_cast<T>(acc[2 * u + 1])));
//@ store_geglu
    const T ge = pl_gelu_approx<T>(static_cast<float>(static_cast<T>(acc[u])));
    out[u0 + u] = static_cast<T>(static_cast<float>(ge) * static_cast<float>(static_cast<T>(acc2[u])));
//@ body

  constexpr int K = $in_dim, NT = 256, N = $n_out, U = $units;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  $prologue
  const int lane = threadIdx.x & 31;
  const int u0 = (blockIdx.x * (NT / 32) + (threadIdx.x >> 5)) * U;
  if (u0 >= N) return;
  int rows[$n_rows];
  float acc[$n_rows];
#pragma unroll
  for (int u = 0; u < U; u++) { $row_index }
  $dots
  if (lane != 0) return;
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (u0 + u >= N) break;
$store
  }
//@ body_split

  constexpr int K = $in_dim, NT = 256, N = $n_out, U = $units;
  __shared__ float part[NT / 32][$n_rows];
  const int lane = threadIdx.x & 31;
  const int u0 = blockIdx.x * U;
  int rows[$n_rows];
  float acc[$n_rows];
#pragma unroll
  for (int u = 0; u < U; u++) { $row_index }
  $dots
  if (lane == 0) {
#pragma unroll
    for (int u = 0; u < $n_rows; u++) part[threadIdx.x >> 5][u] = acc[u];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
#pragma unroll
  for (int u = 0; u < $n_rows; u++) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; w++) t += part[w][u];
    acc[u] = t;
  }
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (u0 + u >= N) break;
$store
  }
