// pl_embed: the embedding row of token ids[0] ($hidden values) into out, from MLX's affine-quantized
// layout (value_quantized: $per_word values per uint32 word, low bits first; scale * q + bias per
// $group_size values) or dense weights (value_dense); Gemma 3 scales it (value_scaled: the row rounded
// to T, times $scale). Filled in by FusedDecoder._embed_kernel (pipeline/engine/cuda/decoder.py).
//@ value_quantized
static_cast<float>(s[(size_t)tok * $groups + i / $group_size]) * static_cast<float>((w[(size_t)tok * $words + i / $per_word] >> ($bits * (i % $per_word))) & ${mask}u) + static_cast<float>(b[(size_t)tok * $groups + i / $group_size])
//@ value_dense
static_cast<float>(w[(size_t)tok * $hidden + i])
//@ value_scaled
static_cast<float>(static_cast<T>($value)) * $scale
//@ body

  const size_t tok = static_cast<size_t>(ids[0]);
  for (int i = threadIdx.x; i < $hidden; i += blockDim.x) out[i] = static_cast<T>($value);
