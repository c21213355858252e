// pl_layer: a whole Llama/Qwen2 decoder layer in ONE kernel (FusedDecoder.one_kernel_layers): the five kernels
// of the layer (qkv.cu, attn.cu, and gemv.cu's o, gate/up and down projections) run as phases of one launch,
// separated by grid barriers (common.cuh's pl_grid_sync), so a token costs the host one launch a layer instead of
// five. The grid is LAYER_BLOCKS_PER_SM 256-thread blocks an SM (default 1, resident whatever the registers: the
// barrier needs every block resident). Each phase is the other kernels' own body, filled in unchanged except for
// its block index: blockIdx.x / .y and gridDim.x read pl_bx / pl_by / pl_gx, the virtual block the loop below
// hands it (a phase's `return` leaves that virtual block). The phases' intermediate vectors live in `work` (q, the
// attention output, the residual stream after attention, the MLP's activation); inputs named as each body reads
// them are aliased per phase. Filled in by FusedDecoder._layer_kernel (pipeline/engine/cuda/decoder.py).
//
// blocks: a body run once per virtual block 0..$blocks-1 (qkv.cu: one warp a rotation pair).
// heads: attn.cu's body over the virtual grid (key chunk, head), the chunks those of the filled slots.
// warps: attn.cu's warp_body, a WARP per virtual (key chunk of 32, head), the chunks those of the filled slots, the
// virtual blocks dealt to the grid's warps SM by SM (warp 0 of every block first).
// strided: a body that strides over its rows by the grid itself (gemv.cu's bodies), run once.
//@ blocks
  {
$aliases
    auto pl_run = [&](const int pl_bx) {
$body
    };
    for (int pl_v = blockIdx.x; pl_v < $blocks; pl_v += gridDim.x) {
      pl_run(pl_v);
      __syncthreads();
    }
  }
//@ heads
  {
$aliases
    const int pl_len = $window ? min(pos[0] + 1, $window) : pos[0] + 1;
    const int pl_chunks = (pl_len + $chunk - 1) / $chunk;
    auto pl_run = [&](const int pl_bx, const int pl_by) {
$body
    };
    for (int pl_v = blockIdx.x; pl_v < pl_chunks * $n_heads; pl_v += gridDim.x) {
      pl_run(pl_v % pl_chunks, pl_v / pl_chunks);
      __syncthreads();
    }
  }
//@ warps
  {
$aliases
    const int pl_len = $window ? min(pos[0] + 1, $window) : pos[0] + 1;
    const int pl_chunks = (pl_len + 31) / 32;
    auto pl_run = [&](const int pl_bx, const int pl_by) {
$body
    };
    for (int pl_v = (threadIdx.x >> 5) * gridDim.x + blockIdx.x; pl_v < pl_chunks * $n_heads;
         pl_v += gridDim.x * (blockDim.x >> 5)) {
      pl_run(pl_v % pl_chunks, pl_v / pl_chunks);
      __syncwarp();
    }
    __syncthreads();
  }
//@ strided
  {
$aliases
    auto pl_run = [&](const int pl_bx, const int pl_gx) {
$body
    };
    pl_run(blockIdx.x, gridDim.x);
    __syncthreads();
  }
//@ body

  T* const pl_work = const_cast<T*>(work);
  T* const pl_q = pl_work;
  T* const pl_o = pl_q + $q_size;
  T* const pl_h = pl_o + $q_size;
  T* const pl_act = pl_h + $hidden;
$trace_begin
$prefetch
$qkv
$mark1
  $sync;
$mark2
$attn
$mark3
  $sync;
$mark4
$o_proj
$mark5
  $sync;
$mark6
$gate_up
$mark7
  $sync;
$mark8
$down
$mark9
$trace_end
//@ prefetch
  // the next phases' weights into L2 while the first runs (LAYER_PREFETCH), a 128-byte line a thread in turn
  pl_prefetch_l2($array, $bytes);
//@ trace_begin
  // trace (FusedDecoder.layer_trace, benchmarks only): thread 0 of each block adds up, over its calls, the clock
  // cycles of each span between marks (phase, barrier, phase, ...), at trace[block * 16 + 0..8]; the call's
  // globaltimer nanoseconds at [9], its cycles at [10] (their ratio: the SM clock) and its calls at [11]
  long long pl_t[10];
  unsigned long long pl_g0 = 0;
  if (threadIdx.x == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(pl_g0));
    pl_t[0] = clock64();
  }
//@ mark
  if (threadIdx.x == 0) pl_t[$i] = clock64();
//@ trace_end
  if (threadIdx.x == 0) {
    unsigned long long pl_g1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(pl_g1));
    unsigned long long* pl_tr = reinterpret_cast<unsigned long long*>(const_cast<uint64_t*>(trace)) + blockIdx.x * 16;
    for (int i = 0; i < 9; i++) atomicAdd(pl_tr + i, static_cast<unsigned long long>(pl_t[i + 1] - pl_t[i]));
    atomicAdd(pl_tr + 9, pl_g1 - pl_g0);
    atomicAdd(pl_tr + 10, static_cast<unsigned long long>(pl_t[9] - pl_t[0]));
    atomicAdd(pl_tr + 11, 1ull);
  }
