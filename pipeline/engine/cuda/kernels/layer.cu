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
$qkv
  pl_grid_sync(bar);
$attn
  pl_grid_sync(bar);
$o_proj
  pl_grid_sync(bar);
$gate_up
  pl_grid_sync(bar);
$down
