// pl_sample: min_p, top_k and top_p as thresholds, then the draw, for every row of x (B, $vocab) float32
// (penalized, temperature-scaled logits), one block of $threads threads per row: the same token as the MLX
// ops of pipeline/engine/sampler.py (token_mass, keep_mask, draw) for the same masses. Masses are int64 fixed
// point (floor(exp(x - max) * 2^40)), so every sum is exact in any order. top_k (B, 1) int32, top_p and min_p
// (B, 1) float32 (off: vocab, 2, 0), u (B, 1) float32 uniform in [0, 1); out: token (B,) uint32. The ranking is
// the stable descending sort's (larger value first, ties by lower id). A filter's cut (the rank where the
// count of tokens, top_k, or the kept mass, top_p, from the top reaches its target) is found in one of two ways:
// binned ($mode 1): a histogram of the amounts over bins of max - x in shared memory, then the cut bin's tokens
// gathered, sorted (bitonic) and scanned: three passes over the row; or by radix selection ($mode 0 and 2),
// 4 bits per pass (16 counters per thread in registers, block-reduced) over the order-preserving uint32 key
// of x and, where the cut splits tokens of equal value, over their ids: 8 to 13 passes. Mode 1 hands the rows
// it cannot cut (a cut bin of more than $cap tokens, an infinite max) on as token 0xffffffff; mode 2 cuts
// those rows by radix passes and copies the others (two kernels, so that mode 1 keeps its 32 registers and two
// blocks per SM). $filters: 0 skips the filters (every token kept). Filled in by pipeline/engine/cuda/sample.py.
//@ header
#define PL_FULL 0xffffffffu
#define PL_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned int pl_key(float f) {
  const unsigned int u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float pl_unkey(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// floor(total * fraction / 2^24), exact: total < 2^58, fraction <= 2^25.
__device__ __forceinline__ long long pl_scale(long long total, long long fraction) {
  return (total >> 24) * fraction + (((total & 0xffffffll) * fraction) >> 24);
}

// f(value, id) for thread t's share of the ids of a row of V floats, in some order: with VEC (V a multiple of 4,
// row 16-byte aligned) by 16-byte loads, UNROLL of them in flight, else one float at a time.
template <int V, int NT, bool VEC, int UNROLL, class F>
__device__ __forceinline__ void pl_each(const float* row, int t, F f) {
  if (VEC) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll UNROLL
    for (int q = t; q < V / 4; q += NT) {
      const float4 v = r4[q];
      f(v.x, 4 * q);
      f(v.y, 4 * q + 1);
      f(v.z, 4 * q + 2);
      f(v.w, 4 * q + 3);
    }
  } else {
    for (int i = t; i < V; i += NT) f(row[i], i);
  }
}

__device__ __forceinline__ long long pl_warp_sum64(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(PL_FULL, v, o);
  return v;
}
//@ body

  constexpr int V = $vocab, NT = $threads, NW = NT / 32, CH = (V + NT - 1) / NT, IBITS = 20;
  static_assert(V <= (1 << IBITS), "vocabulary too large for the index passes");
  static_assert($bins % NT == 0 && ($bins & ($bins - 1)) == 0, "bins: a power of two, a multiple of the threads");
  __shared__ long long red[NW * 16];
  __shared__ float redf[NW];
  __shared__ unsigned int s_prefix;
  __shared__ long long s_base, s_bin, s_target;
  __shared__ int s_found, s_n;
  __shared__ unsigned long long s_entry;
  __shared__ unsigned long long cand[$cap > $bins ? $cap : $bins];  // select_binned's histogram, then its tokens
  const int b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
$prologue  const float* row = x + static_cast<size_t>(b) * V;
  constexpr bool VEC = $vec && V % 4 == 0;  // 16-byte loads (the rows then start 16-byte aligned)

  // The exclusive prefix of s over the threads in order, and the block's total in total (red[0..NW) reused).
  auto block_scan = [&](long long s, long long& total) -> long long {
    long long incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long v = __shfl_up_sync(PL_FULL, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) red[warp] = incl;
    __syncthreads();
    long long before = 0;
    total = 0;
    for (int w = 0; w < NW; ++w) {
      if (w < warp) before += red[w];
      total += red[w];
    }
    __syncthreads();
    return before + incl - s;
  };

  // the row's max
  float mval = PL_NEG_INF;
  pl_each<V, NT, VEC, $unroll>(row, t, [&](float xv, int) { mval = fmaxf(mval, xv); });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mval = fmaxf(mval, __shfl_xor_sync(PL_FULL, mval, o));
  if (lane == 0) redf[warp] = mval;
  __syncthreads();
  mval = redf[0];
  for (int w = 1; w < NW; ++w) mval = fmaxf(mval, redf[w]);
  const float m = mval;
  const bool inf_max = isinf(m);
  auto weight = [&](float xv) -> float { return inf_max ? (xv == m ? 1.f : 0.f) : expf(xv - m); };
  auto mass_of = [&](float w) -> long long { return static_cast<long long>(w * 1099511627776.0f); };

  const int top_k = top_k_in[b];
  const float min_p = min_p_in[b];
  long long frac = static_cast<long long>(top_p_in[b] * 16777216.0f);
  frac = frac < 1 ? 1 : frac;

  // A threshold in the ranking "larger value first, then lower id" (the stable descending sort): token i is
  // at or above (K, I) when key(x_i) > K, or key(x_i) == K and i <= I.
  bool k_on = false, p_on = false;
  unsigned int kK = 0, pK = 0;
  int kI = 0x7fffffff, pI = 0x7fffffff;
  auto at_or_above = [&](unsigned int key, int i, unsigned int K, int I) { return key > K || (key == K && i <= I); };
  auto first_kept = [&](float xv, unsigned int key, int i, float w) {
    return w >= min_p && (!k_on || at_or_above(key, i, kK, kI));
  };
  // A token's amount toward a cut: 1 (top_k counts tokens), or its mass where it is first kept (top_p).
  auto amount = [&](bool by_mass, float xv, unsigned int key, int i) -> long long {
    if (!by_mass) return 1;
    const float w = weight(xv);
    return first_kept(xv, key, i, w) ? mass_of(w) : 0;
  };

  // Block-reduce 16 counters and let thread 0 pick a bin: the highest (descending) or lowest (ascending) bin at
  // which base + the amount of the bins before it, and it, reaches target. Returns false (uniformly) if none.
  // of_total: target becomes the fraction frac / 2^24 of base + all 16 bins (top_p's share of the kept mass,
  // counted by the first pass, which sees every token).
  auto pick = [&](long long* c, long long& target, bool descending, unsigned int& prefix, int shift,
                  long long& base, bool of_total) -> bool {
#pragma unroll
    for (int j = 0; j < 16; ++j) c[j] = pl_warp_sum64(c[j]);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < 16; ++j) red[warp * 16 + j] = c[j];
    }
    __syncthreads();
    if (t == 0) {
      long long cum = base, bin = 0;
      int d = -1;
      if (of_total) {
        long long all = base;
        for (int j = 0; j < 16; ++j)
          for (int w = 0; w < NW; ++w) all += red[w * 16 + j];
        target = pl_scale(all, frac);
      }
      s_target = target;
      for (int n = 0; n < 16; ++n) {
        const int j = descending ? 15 - n : n;
        long long h = 0;
        for (int w = 0; w < NW; ++w) h += red[w * 16 + j];
        if (cum + h >= target) { d = j; bin = h; break; }
        cum += h;
      }
      s_found = d >= 0;
      s_prefix = d >= 0 ? (prefix | (static_cast<unsigned int>(d) << shift)) : prefix;
      s_base = cum;
      s_bin = bin;
    }
    __syncthreads();
    const bool found = s_found;
    prefix = s_prefix;
    base = s_base;
    target = s_target;
    __syncthreads();
    return found;
  };

  // The rank at which the amount (1 per token, or the kept mass of first_kept tokens) of the tokens at or above
  // it first reaches target (target < 0: top_p's share of all the kept mass): its (K, I). False if all of them
  // together do not reach it.
  auto select = [&](bool by_mass, long long target, unsigned int& K_out, int& I_out) -> bool {
    const bool of_total = target < 0;
    unsigned int prefix = 0;
    long long base = 0, group = 0;
    for (int shift = 28; shift >= 0; shift -= 4) {  // the value: 8 passes over the key's nibbles
      const unsigned int hi_mask = shift == 28 ? 0u : (0xffffffffu << (shift + 4));
      long long c[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) c[j] = 0;
      for (int i = t; i < V; i += NT) {
        const float xv = row[i];
        const unsigned int key = pl_key(xv);
        if ((key & hi_mask) != prefix) continue;
        const long long a = amount(by_mass, xv, key, i);
        const int d = (key >> shift) & 15;
#pragma unroll
        for (int j = 0; j < 16; ++j) c[j] += (d == j) ? a : 0;
      }
      if (!pick(c, target, true, prefix, shift, base, of_total && shift == 28)) return false;
      group = s_bin;
    }
    K_out = prefix;
    I_out = 0x7fffffff;
    const long long need = target - base;  // 0 < need <= group: the amount wanted from the tokens of value K
    if (need == group) return true;
    int n = 0;
    for (int i = t; i < V; i += NT) n += pl_key(row[i]) == prefix;
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(PL_FULL, n, o);
    if (lane == 0) red[warp] = n;
    __syncthreads();
    n = 0;
    for (int w = 0; w < NW; ++w) n += static_cast<int>(red[w]);
    __syncthreads();
    if (n == 1) return true;
    // ties at K split: the lowest ids first, 5 passes over the index's nibbles
    unsigned int ip = 0;
    long long ibase = 0;
    for (int shift = IBITS - 4; shift >= 0; shift -= 4) {
      const unsigned int hi_mask = shift == IBITS - 4 ? 0u : (0xffffffffu << (shift + 4));
      long long c[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) c[j] = 0;
      for (int i = t; i < V; i += NT) {
        const float xv = row[i];
        const unsigned int key = pl_key(xv);
        if (key != prefix || (static_cast<unsigned int>(i) & hi_mask) != ip) continue;
        const long long a = amount(by_mass, xv, key, i);
        const int d = (i >> shift) & 15;
#pragma unroll
        for (int j = 0; j < 16; ++j) c[j] += (d == j) ? a : 0;
      }
      long long want = need;
      pick(c, want, false, ip, shift, ibase, false);
    }
    I_out = static_cast<int>(ip);
    return true;
  };

  // The same cut in fewer passes over the row: a histogram of the amounts over bins of m - x (1/$bin_scale of a
  // logit each, monotone in x; the last bin holds the rest: m - x >= $bins / $bin_scale, where exp underflows
  // the fixed point), the bin where the amount from the top reaches target, then its tokens gathered into
  // shared memory, sorted by rank (bitonic) and scanned. The same (K, I) as select() up to ties of zero amount,
  // which neither filter nor the draw can tell apart. 1: found, 0: not reached, -1: the bin holds more than
  // $cap tokens (the caller runs select()).
  auto select_binned = [&](bool by_mass, long long target, unsigned int& K_out, int& I_out) -> int {
    constexpr int NB = $bins, CAP = $cap;
    const bool of_total = target < 0;
    auto bin_of = [&](float xv) -> int {
      const float d = (m - xv) * static_cast<float>($bin_scale);
      return d < static_cast<float>(NB - 1) ? static_cast<int>(d) : NB - 1;  // NaN: the last bin
    };
    for (int j = t; j < NB; j += NT) cand[j] = 0ull;
    __syncthreads();
    pl_each<V, NT, VEC, $unroll>(row, t, [&](float xv, int i) {
      const long long a = amount(by_mass, xv, pl_key(xv), i);
      if (a != 0) atomicAdd(&cand[bin_of(xv)], static_cast<unsigned long long>(a));
    });
    __syncthreads();
    // each thread scans its NB / NT bins in order; the block scan finds the bin where the amount reaches target
    constexpr int BPT = NB / NT;
    long long s = 0;
#pragma unroll
    for (int j = 0; j < BPT; ++j) s += static_cast<long long>(cand[t * BPT + j]);
    long long total;
    const long long excl = block_scan(s, total);
    if (of_total) target = pl_scale(total, frac);
    if (t == 0) s_found = 0;
    __syncthreads();
    if (excl < target && target <= excl + s) {
      long long run = excl;
#pragma unroll
      for (int j = 0; j < BPT; ++j) {
        const long long h = static_cast<long long>(cand[t * BPT + j]);
        if (run + h >= target) { s_bin = t * BPT + j; s_base = run; break; }
        run += h;
      }
      s_found = 1;
    }
    __syncthreads();
    if (!s_found) return 0;
    const int cut = static_cast<int>(s_bin);
    const long long need = target - s_base;  // 0 < need <= the cut bin's amount
    if (t == 0) s_n = 0;
    __syncthreads();
    pl_each<V, NT, VEC, $unroll>(row, t, [&](float xv, int i) {
      if (bin_of(xv) != cut) return;
      const int slot = atomicAdd(&s_n, 1);
      if (slot < CAP)
        cand[slot] = (static_cast<unsigned long long>(pl_key(xv)) << 32) | (0xffffffffu - static_cast<unsigned int>(i));
    });
    __syncthreads();
    const int n = s_n;
    if (n > CAP) return -1;
    int P = 1;
    while (P < n) P <<= 1;
    for (int j = n + t; j < P; j += NT) cand[j] = 0ull;  // padding ranks last
    __syncthreads();
    for (int k = 2; k <= P; k <<= 1) {  // bitonic sort, descending: rank order (larger key, then lower id)
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = t; i < P; i += NT) {
          const int l = i ^ j;
          if (l > i) {
            const unsigned long long a = cand[i], c = cand[l];
            if (((i & k) == 0) ? a < c : a > c) { cand[i] = c; cand[l] = a; }
          }
        }
        __syncthreads();
      }
    }
    const int per = (n + NT - 1) / NT, lo = t * per, hi = min(n, lo + per);
    auto entry_amount = [&](int e) -> long long {
      const unsigned long long c = cand[e];
      const unsigned int key = static_cast<unsigned int>(c >> 32);
      return amount(by_mass, pl_unkey(key), key, static_cast<int>(0xffffffffu - static_cast<unsigned int>(c)));
    };
    long long es = 0;
    for (int e = lo; e < hi; ++e) es += entry_amount(e);
    long long etotal;
    const long long eexcl = block_scan(es, etotal);
    if (eexcl < need && need <= eexcl + es) {
      long long run = eexcl;
      for (int e = lo; e < hi; ++e) {
        run += entry_amount(e);
        if (run >= need) { s_entry = cand[e]; break; }
      }
    }
    __syncthreads();
    K_out = static_cast<unsigned int>(s_entry >> 32);
    I_out = static_cast<int>(0xffffffffu - static_cast<unsigned int>(s_entry));
    __syncthreads();
    return 1;
  };
  // $mode 1: the binned cut, or the row handed on (token 0xffffffff) where it cannot be used; 2: the rows handed
  // on (first, the tokens of mode 1) by radix passes, the others copied; 0: radix passes everywhere.
  bool handed_on = false;
  auto cut_at = [&](bool by_mass, long long target, unsigned int& K, int& I) -> bool {
    if ($mode == 1) {
      const int r = inf_max ? -1 : select_binned(by_mass, target, K, I);
      handed_on = r < 0;
      return r == 1;
    }
    return select(by_mass, target, K, I);
  };

  if ($filters) {
    if (top_k < V) k_on = cut_at(false, static_cast<long long>(top_k < 1 ? 1 : top_k), kK, kI);
    if (!handed_on && frac < 16777216ll) p_on = cut_at(true, -1, pK, pI);  // the first pass sums the kept mass too
    if (handed_on) {
      if (t == 0) token[b] = 0xffffffffu;
      return;
    }
  }

  // the draw: each thread sums a contiguous chunk of kept mass (a multiple of 4 tokens with VEC: 16-byte loads);
  // a block scan finds the chunk holding the target, whose thread walks it again
  auto kept_mass = [&](float xv, int i) -> long long {
    const float w = weight(xv);
    const unsigned int key = pl_key(xv);
    const bool keep = !$filters || (first_kept(xv, key, i, w) && (!p_on || at_or_above(key, i, pK, pI)));
    return keep ? mass_of(w) : 0;
  };
  constexpr int CHD = VEC ? (CH + 3) / 4 * 4 : CH;
  const int lo = min(V, t * CHD), hi = min(V, lo + CHD);
  long long s = 0;
  if (VEC) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll $unroll
    for (int q = lo / 4; q < hi / 4; ++q) {
      const float4 v = r4[q];
      s += kept_mass(v.x, 4 * q) + kept_mass(v.y, 4 * q + 1) + kept_mass(v.z, 4 * q + 2) + kept_mass(v.w, 4 * q + 3);
    }
  } else {
    for (int i = lo; i < hi; ++i) s += kept_mass(row[i], i);
  }
  if (t == 0) token[b] = 0u;
  long long total;
  const long long excl = block_scan(s, total);
  const long long target = pl_scale(total, static_cast<long long>(u[b] * 16777216.0f));
  if (excl <= target && target < excl + s) {
    long long run = excl;
    for (int i = lo; i < hi; ++i) {
      run += kept_mass(row[i], i);
      if (run > target) { token[b] = static_cast<unsigned int>(i); break; }
    }
  }
