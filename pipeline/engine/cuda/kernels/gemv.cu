// pl_gemv_<mode>: one projection y = W x as a warp-per-row GEMV ($units rows, or row pairs, per warp);
// the prologue stages x in shared memory ($prologue: calls.cu's load_x or load_x_res), the epilogue
// stores the rows. Filled in by FusedDecoder._gemv_kernel (pipeline/engine/cuda/decoder.py), whose
// GEMV_MODES name the prologue and epilogue of each mode. MLX's rounding to T after each op.
//
// body_mma: the same with tensor cores (4-bit weights, float16; common.cuh's pl_mma_rows): a block of 8 warps
// computes 16 rows (swiglu, geglu: 8 row pairs), each warp every 8th quantization group of them. $prologue stages x
// in pl_mma_slot order with each group's sum (calls.cu's load_x_mma or load_x_res_mma); $pair_row is the second row
// of a pair (swiglu: N rows below in the same matrix; geglu: the same row of the up matrix, $w1 / $s1 / $b1).
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
  // Warp-stride loop over the groups of U units: a grid smaller than N / U warps (decoder.gemv_blocks) stages
  // x once for several groups and leaves no partial last wave.
  for (int g = blockIdx.x * (NT / 32) + (threadIdx.x >> 5); g * U < N; g += gridDim.x * (NT / 32)) {
    const int u0 = g * U;
    int rows[$n_rows];
    float acc[$n_rows];
#pragma unroll
    for (int u = 0; u < U; u++) { $row_index }
    $dots
    if (lane == 0) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (u0 + u >= N) break;
$store
      }
    }
  }
//@ body_split

  constexpr int K = $in_dim, NT = 256, N = $n_out, U = $units;
  __shared__ float part[NT / 32][$n_rows];
  const int lane = threadIdx.x & 31;
  // Block-stride loop over the groups of U units (uniform over the block: the barrier below is reached by all).
  for (int g = blockIdx.x; g * U < N; g += gridDim.x) {
    const int u0 = g * U;
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
    if (threadIdx.x == 0) {
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
    }
    __syncthreads();
  }
//@ body_mma

  constexpr int K = $in_dim, NT = 256, N = $n_out, GS = $group_size, PAIR = $pair;
  constexpr int UT = PAIR ? 8 : 16;  // units a tile: 16 rows (swiglu: 8 gate rows and their 8 up rows)
  __shared__ __align__(16) T xs[K];
  __shared__ float sxs[K / GS];
  __shared__ float red[32];
  __shared__ float part[NT / 32][16];
  $prologue
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  for (int tile = blockIdx.x; tile * UT < N; tile += gridDim.x) {  // uniform over the block
    const int tb = tile * UT;  // the tile's first unit (not `ub`: geglu's up biases)
    const int r0 = min(tb + g, N - 1);
    const int r1 = PAIR ? $pair_row : min(tb + g + 8, N - 1);
    float s0, s1;
    pl_mma_rows<T, GS, K, NT / 32, $groups_in_flight>($w0, $s0, $b0, $w1, $s1, $b1, r0, r1, xs, sxs, warp, lane, s0,
                                                      s1);
    if ((lane & 3) == 0) {
      part[warp][g] = s0;
      part[warp][g + 8] = s1;
    }
    __syncthreads();
    if (threadIdx.x < UT) {
      float t0 = 0.f, t1 = 0.f;
#pragma unroll
      for (int v = 0; v < NT / 32; v++) {
        t0 += part[v][threadIdx.x];
        if (PAIR) t1 += part[v][threadIdx.x + 8];
      }
      // One unit a thread, in the names the store_* fragments read: row u0 + u, sums acc[u] (swiglu: acc[2 u],
      // acc[2 u + 1]; geglu: acc[u], acc2[u]).
      const int u0 = tb + threadIdx.x, u = 0;
      if (u0 < N) {
        float acc[2] = {t0, t1};
        const float acc2[1] = {t1};
        (void)acc2;
$store
      }
    }
    __syncthreads();
  }
