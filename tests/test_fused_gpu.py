"""The fused CUDA decode step (pipeline/engine/cuda/) against the unfused model it replaces.

The kernel tests run only where MLX's CUDA backend is available (the kernels are CUDA source); elsewhere
they are skipped, ``test_fused_blocker_*`` check that the engine does not pick the fused step, and the
launch-plan tests check the host side with a recording stand-in for ``mx.fast.cuda_kernel``.

Reference: the same model's ordinary forward (MLX's quantized_matmul, rms_norm, rope and
scaled_dot_product_attention — the ops mlx-lm's llama/qwen2 use) on an identical, separately prefilled
cache. The fused kernels accumulate in float32 and round where MLX rounds, so logits agree to float16
rounding noise; greedy tokens are compared only where the reference's top-2 margin is clear of it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from pipeline.bench import random_weights
from pipeline.engine.cache import KVCache, QuantizedKVCache, RotatingKVCache
from pipeline.jobspec import CacheSpec
from pipeline.engine import Engine, GenerateParams
from pipeline.engine.cuda import FusedDecoder, Gemma3Decoder, Qwen3Decoder, decoder_for, fused_blocker, model_blocker
from pipeline.engine.cuda import decoder as decoder_module
from pipeline.engine.cuda.decoder import SPLIT_MIN_IN, SPLIT_UNITS, WARPS_PER_BLOCK, Proj
from pipeline.models import build_model, dequantize_model
from pipeline.models.base import fuse_projections

CUDA = mx.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="MLX CUDA backend not available")

BASE = {
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 3, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}


# A small Gemma 3: sliding layers (window 64, local RoPE base) alternating with global ones, one KV head.
GEMMA = {
    "model_type": "gemma3_text", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64,
    "sliding_window": 64, "sliding_window_pattern": 2, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}

# A small Qwen 3: per-head q/k RMSNorms over head_dim, no q/k/v biases.
QWEN3 = {**BASE, "model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}


def make_model(dtype=mx.float16, bits=4, group_size=64, dense=False, fuse_qkv=True, **overrides):
    """A random model of ``BASE`` + ``overrides``, with fused projections as ``load_model`` builds it
    (``fuse_qkv`` False: only gate/up fused, q/k/v left as three matrices)."""
    config = {**BASE, **overrides}
    weights = random_weights(config, dtype, bits=bits, group_size=group_size, seed=1)
    model = build_model(config, weights, dtype)
    if dense:
        dequantize_model(model, dtype)
    if fuse_qkv:
        fuse_projections(model)
    else:
        for layer in model.model.layers:
            layer.mlp.fuse()
    return model


def prefilled(model, prompt, make_caches=None):
    caches = make_caches() if make_caches else model.make_cache()
    logits = model(mx.array(prompt)[None], caches)[:, -1, :]
    mx.eval(logits, [c.state for c in caches])
    return caches, logits


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def float32_twin(model):
    """``model`` turned, in place, into its float32 twin: every float16/bfloat16 parameter (norm weights,
    quantization scales and biases, dense weights) cast exactly to float32, then quantized weights expanded to
    float32 (``scale * q + bias``, the values a quantized matmul uses). Dense, because MLX CUDA 0.32.4's
    float32 quantized matmul fails on group-128 prefills (``cuGraphAddKernelNode ... invalid argument`` for a
    64-row prompt on an H100, 2026-12-07; float16 and single rows work). Pass a second copy of the model
    (same seed), not the one under test."""
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a,
                          model.parameters()))
    dequantize_model(model, mx.float32)
    return model


def compare_steps(model, prompt_len=37, steps=6, seed=0, make_caches=None, twin=None, one_kernel_layers=False,
                  configure=None):
    """Run ``steps`` decode steps through the fused decoder and the model; returns the worst relative
    L2 error of the logits and the count of clear-margin argmax disagreements.

    With ``twin`` (``float32_twin`` of a copy of the model), also runs it and returns ``(worst error of
    the fused step vs float32, worst error of the model's own compute dtype vs float32, mismatches)``:
    how close each comes to the exact result of the same weights. ``one_kernel_layers``: the decoder runs each
    layer as one kernel (``FusedDecoder.one_kernel_layers``). ``configure``: called with the decoder before the
    first step."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.args.vocab_size, prompt_len).tolist()
    ref_caches, logits = prefilled(model, prompt, make_caches)
    fused_caches, _ = prefilled(model, prompt, make_caches)
    exact = twin is not None
    twin_caches = prefilled(twin, prompt, make_caches)[0] if exact else None
    dec = decoder_for(model)
    if one_kernel_layers:
        assert dec.layer_blocker() is None
    dec.one_kernel_layers = one_kernel_layers
    if configure is not None:
        configure(dec)
    dec.prepare(fused_caches, prompt_len + steps)
    y = mx.argmax(logits, axis=-1).astype(mx.uint32)
    pos = mx.array([prompt_len], mx.int32)
    worst, worst32, worst_ref32, clear_mismatch = 0.0, 0.0, 0.0, 0
    for i in range(steps):
        ref = model(y[None], ref_caches)[:, -1, :].astype(mx.float32)
        got = dec.step(y, pos, prompt_len + i, fused_caches).astype(mx.float32)
        assert got.shape == ref.shape
        r, g = np.array(ref)[0], np.array(got)[0]
        assert np.isfinite(g).all()
        worst = max(worst, rel_err(g, r))
        if exact:
            r32 = np.array(twin(y[None], twin_caches)[:, -1, :])[0]
            worst32, worst_ref32 = max(worst32, rel_err(g, r32)), max(worst_ref32, rel_err(r, r32))
        top2 = np.sort(r)[-2:]
        if top2[1] - top2[0] > 0.05 * max(1.0, abs(top2[1])) and int(g.argmax()) != int(r.argmax()):
            clear_mismatch += 1
        y = mx.array([int(r.argmax())], mx.uint32)
        pos = pos + 1
    return (worst32, worst_ref32, clear_mismatch) if exact else (worst, clear_mismatch)


@gpu
@pytest.mark.parametrize("case", [
    dict(),                                                      # llama, 4-bit group 64, non-traditional RoPE
    dict(rope_traditional=True, group_size=32),                  # GGUF-style: interleaved RoPE, group 32
    dict(bits=8, group_size=32),
    dict(dense=True),
    dict(dtype=mx.bfloat16),
    dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1),
    dict(model_type="qwen2", tie_word_embeddings=False),          # q/k/v biases, untied head
    dict(rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 256}),
    dict(head_dim=96, num_attention_heads=2, num_key_value_heads=1),  # attention's fallback value loop
    dict(intermediate_size=4096),                                 # down: a row split over the block
    dict(intermediate_size=4096, bits=8, group_size=32),
    dict(intermediate_size=SPLIT_MIN_IN),                         # the smallest input that splits
], ids=["llama-q4g64", "trad-q4g32", "q8", "dense", "bf16", "hd128", "qwen2", "llama3-rope", "hd96",
        "split-q4", "split-q8", "split-min"])
def test_fused_step_matches_the_model(case):
    model = make_model(**case)
    assert model_blocker(model) is None
    worst, mismatches = compare_steps(model)
    tol = 3e-2 if case.get("dtype") is mx.bfloat16 else 5e-3
    assert worst < tol, worst
    assert mismatches == 0
    if case.get("intermediate_size", 0) >= SPLIT_MIN_IN:  # the split kernel is what ran
        down = Proj(model.model.layers[0].mlp.down_proj)
        warps = decoder_for(model)._gemv_kernel(down, "residual")[1]
        assert warps == -(-down.out_dim // SPLIT_UNITS) * WARPS_PER_BLOCK  # a block of SPLIT_UNITS rows


@gpu
@pytest.mark.parametrize("case", [dict(), dict(group_size=32), dict(group_size=128), dict(vocab_size=1000),
                                  dict(intermediate_size=4096), dict(model_type="qwen2", tie_word_embeddings=False)],
                         ids=["g64", "g32", "g128", "rows-not-16", "split-size", "qwen2"])
def test_tensor_core_gemvs_match_the_model(case, monkeypatch):
    """Every projection the tensor-core GEMV can take (swiglu, the o/down residuals, the vocab projection) run on it
    (4-bit float16): the logits match the model's."""
    from pipeline.engine.cuda import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "GEMV_MMA_MODES", ("swiglu", "residual", "norm"))
    model = make_model(**case)
    dec = decoder_for(model)
    lay = dec.layers[0]
    assert all(dec._mma_problem(p, m) is None for p, m in [(lay["gu"], "swiglu"), (lay["o"], "residual"),
                                                           (lay["down"], "residual"), (dec.head, "norm")])
    worst, mismatches = compare_steps(model, steps=4)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("case", [dict(), dict(intermediate_size=4096),
                                  dict(model_type="qwen2", tie_word_embeddings=False)], ids=["llama", "split", "qwen2"])
def test_a_capped_gemv_grid_loops_over_every_row(case, monkeypatch):
    """Every warp-per-row GEMV launched as ONE block (GEMV_BLOCKS_PER_SM 1 on "1 SM"; the tensor-core gate/up
    kernel as MMA_BLOCKS_PER_SM blocks): each warp (or block) loops over many row groups, and the logits still
    match the model."""
    from pipeline.engine.cuda import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "sm_count", lambda: 1)
    monkeypatch.setattr(decoder_module, "GEMV_BLOCKS_PER_SM", 1)
    assert decoder_module.gemv_blocks(64, decoder_module.GEMV_BLOCKS_PER_SM) == 1
    model = make_model(**case)
    worst, mismatches = compare_steps(model, steps=3)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("prompt_len", [1, 127, 128, 129, 300, 700])
def test_attention_splits_and_chunk_edges(prompt_len, monkeypatch):
    """Contexts of one to several 128-key chunks (the split path and its combine; ``ATTN_CHUNK``, which models
    of at least ``ATTN_FEW_HEADS`` heads use)."""
    monkeypatch.setattr(decoder_module, "ATTN_FEW_HEADS", 1)
    model = make_model()
    assert decoder_for(model).attn_chunk == decoder_module.ATTN_CHUNK == 128
    worst, mismatches = compare_steps(model, prompt_len=prompt_len, steps=4)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("chunk, prompt_len", [(32, 31), (32, 33), (32, 300), (64, 63), (64, 65), (64, 300)])
def test_attention_chunks_of_few_heads(chunk, prompt_len, monkeypatch):
    """A model with fewer than ``ATTN_FEW_HEADS`` query heads attends in chunks of ``ATTN_FEW_HEADS_CHUNK`` keys
    (threads): one-warp and two-warp blocks, one chunk, just over one, and many to combine."""
    monkeypatch.setattr(decoder_module, "ATTN_FEW_HEADS_CHUNK", chunk)
    model = make_model()
    assert model.args.num_attention_heads < decoder_module.ATTN_FEW_HEADS
    assert decoder_for(model).attn_chunk == chunk
    worst, mismatches = compare_steps(model, prompt_len=prompt_len, steps=4)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("prompt_len", [1, 64, 200])
def test_rotating_caches(prompt_len):
    """Llama with sliding-window caches (``cache.max_kv_size``): the key/value go to slot ``pos % 64`` and
    attention reads the ring, before, at and after it wraps."""
    model = make_model()
    worst, mismatches = compare_steps(model, prompt_len=prompt_len, steps=6,
                                      make_caches=lambda: [RotatingKVCache(64) for _ in range(3)])
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("prompt_len", [37, 200])
def test_llama_sliding_attention_layers(prompt_len):
    """A llama config whose ``layer_types`` marks "sliding_attention" layers (window 64) beside a full one, as
    mlx-lm's llama reads it: the fused step reads each layer's own cache (a ring or a full one), before the
    ring fills and after it wraps."""
    model = make_model(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=64)
    assert model_blocker(model) is None
    worst, mismatches = compare_steps(model, prompt_len=prompt_len, steps=6)
    assert worst < 5e-3, worst
    assert mismatches == 0


LAYER_CASES = {
    "llama-q4g64": (dict(), 37),
    "chunk-edge-255": (dict(), 255),
    "chunk-edge-256": (dict(), 256),
    "chunks-700": (dict(), 700),
    "trad-q4g32": (dict(rope_traditional=True, group_size=32), 37),
    "q8": (dict(bits=8, group_size=32), 37),
    "dense": (dict(dense=True), 37),
    "bf16": (dict(dtype=mx.bfloat16), 37),
    "qwen2": (dict(model_type="qwen2", tie_word_embeddings=False), 37),
    "split-q4": (dict(intermediate_size=4096), 37),
    "hd128": (dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1), 300),
}


@gpu
@pytest.mark.parametrize("case, prompt_len", LAYER_CASES.values(), ids=list(LAYER_CASES))
def test_one_kernel_layers_match_the_model(case, prompt_len):
    """Each layer as ONE kernel (kernels/layer.cu: the five kernels' bodies between grid barriers): the logits
    match the model's as the five kernels' do, across 256-key attention chunks, every weight kind, q/k/v biases,
    the split down projection and head size 128."""
    model = make_model(**case)
    worst, mismatches = compare_steps(model, prompt_len=prompt_len, steps=4, one_kernel_layers=True)
    assert worst < (3e-2 if case.get("dtype") is mx.bfloat16 else 5e-3), worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("prompt_len", [1, 64, 200])
def test_one_kernel_layers_on_rotating_caches(prompt_len):
    """The one-kernel layer over a 64-slot ring, before, at and after it wraps."""
    worst, mismatches = compare_steps(make_model(), prompt_len=prompt_len, steps=6, one_kernel_layers=True,
                                      make_caches=lambda: [RotatingKVCache(64) for _ in range(3)])
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
def test_one_kernel_layer_on_a_grid_of_one_block(monkeypatch):
    """A grid of ONE block (``sm_count`` 1): that block runs every virtual block of every phase in turn (and the
    grid barrier with one block passes at once); the logits still match the model's."""
    from pipeline.engine.cuda import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "sm_count", lambda: 1)
    worst, mismatches = compare_steps(make_model(), prompt_len=300, steps=3, one_kernel_layers=True)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("barrier", ["gen", "flip", "flip-ra"])
@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_one_kernel_layer_barriers_and_trace(barrier, traced, monkeypatch):
    """Every grid barrier (``decoder.LAYER_BARRIER``), with and without the benchmarks' phase trace compiled in: the
    logits match the model's over 300 keys (two attention chunks, so the phases read what other blocks wrote), and
    the trace counts one call a layer a token in every block, with nonzero spans."""
    monkeypatch.setattr(decoder_module, "LAYER_BARRIER", barrier)
    model = make_model()
    seen = {}

    def traced_decoder(dec):
        if traced:
            grid = decoder_module.sm_count() * decoder_module.LAYER_BLOCKS_PER_SM
            dec.layer_trace = mx.zeros((grid * 16,), mx.uint64)
            seen["dec"] = dec

    worst, mismatches = compare_steps(model, prompt_len=300, steps=3, one_kernel_layers=True, configure=traced_decoder)
    assert worst < 5e-3, worst
    assert mismatches == 0
    if traced:
        tr = np.array(seen["dec"].layer_trace).reshape(-1, 16)
        assert (tr[:, 11] == 3 * len(model.model.layers)).all()
        assert (tr[:, :11] > 0).all()


@gpu
@pytest.mark.parametrize("case, prompt_len, ring", [
    (dict(), 1, None), (dict(), 31, None), (dict(), 32, None), (dict(), 300, None), (dict(), 700, None),
    (dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1), 300, None), (dict(), 200, 64),
    (dict(head_dim=96, num_attention_heads=2, num_key_value_heads=1), 300, None),
], ids=["one-key", "keys-32", "keys-33", "keys-301", "keys-701", "hd128", "ring-64", "hd96-block"])
def test_one_kernel_layer_warp_attention(case, prompt_len, ring, monkeypatch):
    """The one-kernel layer with attention a warp per 32 keys (``LAYER_ATTN`` "warp": one chunk, a chunk's edges,
    the partials of up to 22 chunks combined, head size 128, a ring before and after it wraps) matches the model;
    head size 96 runs the block attention instead."""
    monkeypatch.setattr(decoder_module, "LAYER_ATTN", "warp")
    model = make_model(**case)
    assert decoder_for(model).layer_attn() == ("block" if case.get("head_dim") == 96 else "warp")
    caches = (lambda: [RotatingKVCache(ring) for _ in range(3)]) if ring else None
    worst, mismatches = compare_steps(model, prompt_len=prompt_len, steps=4, one_kernel_layers=True,
                                      make_caches=caches)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
@pytest.mark.parametrize("attn, prefetch", [("block", "none"), ("block", "ogd"), ("warp", "all")])
@pytest.mark.parametrize("prompt_len, ring", [(1, None), (300, None), (700, None), (200, 64)],
                         ids=["one-key", "keys-301", "keys-701", "ring-64"])
def test_one_kernel_layer_prefetch(attn, prefetch, prompt_len, ring, monkeypatch):
    """Each L2 prefetch of the layer's weights (``LAYER_PREFETCH``), after either attention phase: the logits match
    the model's for one chunk, several, and a ring after it wraps."""
    monkeypatch.setattr(decoder_module, "LAYER_ATTN", attn)
    monkeypatch.setattr(decoder_module, "LAYER_PREFETCH", prefetch)
    caches = (lambda: [RotatingKVCache(ring) for _ in range(3)]) if ring else None
    worst, mismatches = compare_steps(make_model(), prompt_len=prompt_len, steps=4, one_kernel_layers=True,
                                      make_caches=caches)
    assert worst < 5e-3, worst
    assert mismatches == 0


@gpu
def test_one_kernel_layers_replayed_in_the_engine():
    """The engine's replayed step (``Engine.compile_fused``) with one kernel a layer gives bitwise the tokens and
    logprobs of the same step built token by token, and, over 40 greedy tokens, nearly the tokens of the five-kernel step
    (as close as the engine test's unfused and fused steps: the attention's chunks differ, 256 keys against 128)."""
    model = make_model()
    prompt = list(range(5, 305))
    params = GenerateParams(max_tokens=40, ignore_eos=True, logprobs=0)
    runs = {}
    for layers, replay in ((True, True), (True, False), (False, True)):
        eng = Engine(model, [], 2048)
        eng.fused.one_kernel_layers = layers
        eng.compile_fused = replay
        g = eng.generate(prompt, params)
        assert g.fused
        runs[layers, replay] = g
    assert runs[True, True].token_ids == runs[True, False].token_ids
    assert runs[True, True].logprobs == runs[True, False].logprobs
    agree = sum(a == b for a, b in zip(runs[True, True].token_ids, runs[False, True].token_ids))
    assert agree >= 30, (runs[True, True].token_ids, runs[False, True].token_ids)


GEMMA_CASES = {
    "bf16": dict(dtype=mx.bfloat16),
    "q8": dict(bits=8, group_size=32),
    "dense": dict(dense=True),
    "hd256": dict(head_dim=256, num_attention_heads=2, query_pre_attn_scalar=256),
    "gqa2-linear-rope": dict(num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 8.0}),
}


@gpu
@pytest.mark.parametrize("case, prompt_len", [({}, 37), ({}, 64), ({}, 130), ({}, 300)]
                         + [(case, 130) for case in GEMMA_CASES.values()],
                         ids=["q4-37", "q4-64", "q4-130", "q4-300", *GEMMA_CASES])
def test_gemma3_fused_step_matches_the_model(case, prompt_len):
    """Gemma 3: q/k norms, four norms per layer, GELU, the scaled embedding, sliding layers whose ring
    (window 64) fills or wraps in the prompt or during the steps, global layers across 128-key chunks.

    Gemma's float16 logits sit far from exact (norm weights 1 + w, four norms a layer): the model's own
    float16 path is ~1.5% from its float32 twin here (bfloat16: ~10%), so the fused step is held to that
    measure — at least as close to the float32 result as MLX's float16 (bfloat16) ops, give or take 50%
    — and to the same clear-margin argmax. On the H200: fused 1.1-1.2% vs MLX's float16 1.4-1.6% (q4);
    bfloat16 fused 11.1%."""
    assert_as_close_as_the_model({**GEMMA, **case}, prompt_len, Gemma3Decoder)


@gpu
@pytest.mark.parametrize("case, prompt_len", [({}, 37), ({}, 130), (dict(group_size=32), 130),
                                              (dict(group_size=128), 64)],
                         ids=["q4-37", "q4-130", "g32", "g128"])
def test_gemma3_gemvs_on_tensor_cores(case, prompt_len, monkeypatch):
    """Gemma 3's gate/up kernel (the residual step, two norms, the gate and the up projection, gelu_approx(gate) * up;
    GEMV_MMA_MODES "geglu", its up rows from the second matrix) and its vocabulary projection (the last residual step,
    the final norm; "res_logits") on tensor cores: as close to the float32 twin as the warp-per-row kernels are held
    to, the same clear-margin argmax."""
    monkeypatch.setattr(decoder_module, "GEMV_MMA_MODES", ("swiglu", "geglu", "res_logits"))
    model = make_model(**{**GEMMA, **case})
    dec = decoder_for(model)
    lay = dec.layers[0]
    assert dec._gemv_kernel(lay["gate"], "geglu", lay["up"])[3]  # built on tensor cores
    assert dec._gemv_kernel(dec.head, "res_logits")[3]
    assert_as_close_as_the_model({**GEMMA, **case}, prompt_len, Gemma3Decoder)


def assert_as_close_as_the_model(config: dict, prompt_len: int, decoder: type) -> None:
    """The fused step of ``make_model(**config)`` is ``decoder``'s, at least as close to the float32 twin's
    logits as the model's own compute dtype (give or take 50%), never off like a wrong kernel (~1), and
    with the same clear-margin argmax."""
    model = make_model(**config)
    assert model_blocker(model) is None
    assert isinstance(decoder_for(model), decoder)
    twin = float32_twin(make_model(**config))
    fused_err, model_err, mismatches = compare_steps(model, prompt_len=prompt_len, steps=6, twin=twin)
    assert fused_err < 1.5 * model_err + 1e-3, (fused_err, model_err)
    assert fused_err < (0.3 if config.get("dtype") is mx.bfloat16 else 0.05)
    assert mismatches == 0


QWEN3_CASES = {
    "q4-37": (dict(), 37),
    "q4-130": (dict(), 130),
    "q4-300": (dict(), 300),
    "q8g32": (dict(bits=8, group_size=32), 130),
    "dense": (dict(dense=True), 130),
    "bf16": (dict(dtype=mx.bfloat16), 130),
    "hd128-untied": (dict(head_dim=128, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False), 130),
    "qkv-unfused": (dict(fuse_qkv=False), 130),
    "linear-rope": (dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), 130),
}


@gpu
@pytest.mark.parametrize("case, prompt_len", QWEN3_CASES.values(), ids=list(QWEN3_CASES))
def test_qwen3_fused_step_matches_the_model(case, prompt_len):
    """Qwen 3: the per-head q/k RMSNorms inside the q/k/v kernel (one fused q/k/v matrix or three), across
    128-key chunks, every weight kind, both 16-bit dtypes, head size 128, an untied head, linear RoPE scaling.
    Held, as Gemma 3 is, to at least the closeness of MLX's own compute dtype to the float32 twin (give or
    take 50%), and to the same clear-margin argmax."""
    assert_as_close_as_the_model({**QWEN3, **case}, prompt_len, Qwen3Decoder)


@gpu
@pytest.mark.parametrize("config, prompt, decoder", [({}, list(range(5, 60)), FusedDecoder),
                                                     (GEMMA, list(range(5, 100)), Gemma3Decoder),
                                                     (QWEN3, list(range(5, 100)), Qwen3Decoder)],
                         ids=["llama", "gemma3", "qwen3"])
def test_engine_uses_fused_step_and_reuses_caches(config, prompt, decoder):
    """The engine picks the model's fused step on CUDA; a second prompt on the same engine (caches reset,
    not reallocated) gives exactly what a fresh engine gives."""
    model = make_model(**config)
    params = GenerateParams(max_tokens=40, ignore_eos=True)
    b = list(range(100, 120))
    eng = Engine(model, [], 2048)
    assert type(eng.fused) is decoder
    first = eng.generate(prompt, params)
    assert first.fused and len(first.token_ids) == 40
    assert all(c.offset == len(prompt) + 39 for c in eng.cache)
    again = eng.generate(b, params)
    fresh = Engine(model, [], 2048).generate(b, params)
    assert again.token_ids == fresh.token_ids
    plain = Engine(model, [], 2048, fused=False, compile=False).generate(b, params)
    assert not plain.fused
    agree = sum(x == y for x, y in zip(plain.token_ids, fresh.token_ids))
    assert agree >= 30, (plain.token_ids, fresh.token_ids)


@gpu
@pytest.mark.parametrize("config, prompt_len", [({}, 120), ({}, 300), (GEMMA, 64), (QWEN3, 130),
                                                (dict(max_kv_size=64), 100)],
                         ids=["llama", "llama-3-chunks", "gemma3", "qwen3", "llama-ring"])
def test_the_replayed_step_is_the_step_built_each_token(config, prompt_len):
    """``Engine.compile_fused``: the fused step over the caches' whole capacity (``n_ctx`` None), compiled once
    and replayed, gives bitwise the tokens and logprobs of the step built token by token with its position's
    grid, over positions that cross 128-key chunks (and a ring that wraps)."""
    config = dict(config)
    window = config.pop("max_kv_size", None)
    model = make_model(**config)
    prompt = list(range(5, 5 + prompt_len))
    spec = None if window is None else CacheSpec(max_kv_size=window)
    params = GenerateParams(max_tokens=20, ignore_eos=True, logprobs=0)
    runs = {}
    for replay in (True, False):
        eng = Engine(model, [], 2048, cache_spec=spec)
        eng.compile_fused = replay
        builds = []
        orig = eng.fused.step
        eng.fused.step = lambda *a, orig=orig, builds=builds: builds.append(a[2]) or orig(*a)
        g = eng.generate(prompt, params)
        assert g.fused
        runs[replay] = (g.token_ids, g.logprobs, builds, len(eng._fused_closures))
    (tok_r, lp_r, built_r, n_closures), (tok_e, lp_e, built_e, _) = runs[True], runs[False]
    assert tok_r == tok_e and lp_r == lp_e
    assert built_r == [None] and n_closures == 1  # traced once, over the whole capacity
    assert built_e == list(range(prompt_len, prompt_len + 19))


def test_fused_blocker_off_cuda_or_unsupported_caches():
    model = make_model()
    if not CUDA:
        assert fused_blocker(model, model.make_cache()) == "not on MLX's CUDA backend"
        assert Engine(model, [], 2048).fused is None
    else:
        assert fused_blocker(model, [QuantizedKVCache(8, 64, 0) for _ in range(3)]) == "quantized KV caches"
        assert fused_blocker(model, [RotatingKVCache(64) for _ in range(3)]) is None
        assert fused_blocker(model, [KVCache() for _ in range(3)]) is None


def test_model_blocker_names_the_reason():
    assert model_blocker(make_model(**QWEN3)) is None
    assert model_blocker(make_model(bits=3, group_size=32)) == "3-bit weights"
    gemma = make_model(**GEMMA)
    gemma.args.model_type = "gemma2"
    assert model_blocker(gemma) == "model family gemma2 has no fused step"
    assert model_blocker(make_model(head_dim=16)) == "head_dim 16"  # the tiny test models' size: unfused


class _RecordingKernel:
    """Stands in for ``mx.fast.cuda_kernel`` on machines without CUDA: records each launch (name, grid,
    threadgroup, input names and shapes) and returns zeros of the declared outputs.

    Each launch also records what MLX builds the kernel's full CUDA text from (tests/test_cuda_sources.py):
    the kernel's ``source``, ``header`` and ``output_names``, and the call's ``input_dtypes``, ``input_ndims``,
    ``template`` and ``output_dtypes``."""

    launches: list = []
    sources: list = []

    def __init__(self, name, input_names, output_names, source, header="", **_):
        self.name, self.input_names, self.source = name, input_names, source
        self.output_names, self.header = output_names, header
        _RecordingKernel.sources.append(source)

    def __call__(self, inputs, grid, threadgroup, output_shapes, output_dtypes, template=None, **_):
        assert len(inputs) == len(self.input_names), self.name
        _RecordingKernel.launches.append({"name": self.name, "grid": grid, "threadgroup": threadgroup,
                                          "inputs": dict(zip(self.input_names, (a.shape for a in inputs))),
                                          "source": self.source, "header": self.header,
                                          "input_names": list(self.input_names),
                                          "input_dtypes": [a.dtype for a in inputs],
                                          "input_ndims": [a.ndim for a in inputs],
                                          "output_names": list(self.output_names),
                                          "output_dtypes": list(output_dtypes), "template": list(template or [])})
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


def recorded_step(monkeypatch, one_kernel_layers=False, prefill=True, make_caches=None, configure=None, model=None,
                  **config):
    """One fused step of ``make_model(**config)`` (float32: a fast prefill on a CPU) after a 199-token prefill,
    with ``_RecordingKernel`` standing in for ``mx.fast.cuda_kernel``: ``(model, decoder, caches, launches)``.

    ``prefill`` False: the caches (``make_caches()``, default the model's own) hold one position of zeros instead,
    as quick in any dtype (a float16 prefill takes seconds on a CPU); the kernels' sources and the dtypes and ranks
    of their inputs are the same. ``configure``: called with the decoder before the step. ``model``: the model to
    step (already built), instead of ``make_model(**config)``."""
    import pipeline.engine.cuda as fused

    model = model if model is not None else make_model(**{"dtype": mx.float32, **config})
    monkeypatch.setattr(fused.mx.fast, "cuda_kernel", _RecordingKernel)
    _RecordingKernel.launches, _RecordingKernel.sources = [], []
    dec = decoder_for(model)
    dec.one_kernel_layers = one_kernel_layers
    if configure is not None:
        configure(dec)
    if prefill:
        caches, _ = prefilled(model, list(range(1, 200)), make_caches)
    else:
        caches = make_caches() if make_caches else model.make_cache()
        kv = mx.zeros((1, dec.n_kv_heads, 1, dec.head_dim), dec.dtype)
        for c in caches:
            c.update_and_fetch(kv, kv)
    dec.prepare(caches, 210)
    logits = dec.step(mx.array([5], mx.uint32), mx.array([199], mx.int32), 199, caches)
    assert logits.shape == (1, model.args.vocab_size)
    return model, dec, caches, _RecordingKernel.launches


@pytest.mark.parametrize("case", [dict(), dict(model_type="qwen2", tie_word_embeddings=False, bits=8, group_size=32)],
                         ids=["llama", "qwen2-q8"])
def test_launch_plan_covers_every_output(case, monkeypatch):
    """The host side of the fused step (runs anywhere): per token one embedding launch, five per layer,
    one vocab launch; every GEMV grid covers its output rows, the attention grid one block per (chunk, head)
    of the context, and each kernel gets the arrays its source names."""
    import pipeline.engine.cuda as fused

    model, dec, caches, launches = recorded_step(monkeypatch, **case)
    names = [k["name"] for k in launches]
    layers = model.args.num_hidden_layers
    assert names == ["pl_embed"] + ["pl_qkv", "pl_attn", "pl_gemv_residual", "pl_gemv_swiglu",
                                    "pl_gemv_residual"] * layers + ["pl_gemv_norm"]
    H, KVH, D = dec.n_heads, dec.n_kv_heads, dec.head_dim
    for k in launches:
        blocks = k["grid"][0] // k["threadgroup"][0]
        warps = blocks * k["threadgroup"][0] // 32
        if k["name"] == "pl_qkv":
            assert warps >= (H + 2 * KVH) * D // 2  # a warp per rotation pair
            assert k["inputs"]["kc"] == caches[0].keys.shape and caches[0].keys.shape[2] >= 200
        elif k["name"] == "pl_attn":
            ch = dec.attn_chunk  # the BASE model's 4 heads: ATTN_FEW_HEADS_CHUNK keys a block
            assert ch == decoder_module.ATTN_FEW_HEADS_CHUNK and k["threadgroup"] == (ch, 1, 1)
            assert k["grid"] == (-(-200 // ch) * ch, H, 1)  # 200 keys: every chunk, for every head
        elif k["name"] == "pl_gemv_swiglu":
            assert warps * fused.units_per_warp(2 * model.args.intermediate_size, "swiglu") >= \
                model.args.intermediate_size
        elif k["name"].startswith("pl_gemv"):
            rows = model.args.vocab_size if k["name"] == "pl_gemv_norm" else model.args.hidden_size
            assert warps * fused.units_per_warp(rows, k["name"][8:]) >= rows
    assert dec._scratch.size >= H * 2 * (D + 2)


@pytest.mark.parametrize("case", [dict(), dict(model_type="qwen2", tie_word_embeddings=False, bits=8, group_size=32)],
                         ids=["llama", "qwen2-q8"])
def test_one_kernel_layers_launch_plan(case, monkeypatch):
    """The host side of one kernel a layer (runs anywhere): the embedding, ONE launch a layer of one 256-thread
    block an SM, the vocab projection; each layer's kernel gets its own caches, and its source holds the five
    phases between four grid barriers, each body's block index replaced by the phase's virtual one."""
    from pipeline.engine.cuda import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "sm_count", lambda: 132)
    model, dec, caches, launches = recorded_step(monkeypatch, one_kernel_layers=True, **case)
    layers = model.args.num_hidden_layers
    assert [k["name"] for k in launches] == ["pl_embed"] + ["pl_layer"] * layers + ["pl_gemv_norm"]
    for i, k in enumerate(launches[1:-1]):
        assert k["grid"] == (132 * 256, 1, 1) and k["threadgroup"] == (256, 1, 1)
        assert k["inputs"]["kc"] == caches[i].keys.shape
        assert ("bias" in k["inputs"]) == (case.get("model_type") == "qwen2")
    src = next(s for s in _RecordingKernel.sources if "pl_grid_sync" in s)
    assert src.count(decoder_module.LAYER_SYNCS[decoder_module.LAYER_BARRIER] + ";") == 4
    assert "blockIdx.y" not in src and src.count("pl_run(") == 5
    assert dec.layer_blocker() is None


def test_one_kernel_layers_only_for_the_llama_layer(monkeypatch):
    """Gemma 3's and Qwen 3's decoders (their own q/k/v kernels) say why they have no one-kernel layer; so does any
    decoder where the SM count cannot be read."""
    from pipeline.engine.cuda import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "sm_count", lambda: 132)
    assert decoder_for(make_model(**GEMMA)).layer_blocker() == "Gemma3Decoder has no one-kernel layer"
    assert decoder_for(make_model(**QWEN3)).layer_blocker() == "Qwen3Decoder has no one-kernel layer"
    monkeypatch.setattr(decoder_module, "sm_count", lambda: None)
    assert "SM count" in decoder_for(make_model()).layer_blocker()


def test_gemma3_launch_plan(monkeypatch):
    """Gemma 3's host side (runs anywhere): five launches per layer; the first layer's q/k/v kernel starts
    from the embedding, later ones first add the previous layer's post-feedforward residual; each q/k/v
    head's rows over blocks of 16; sliding layers attend over their 64-slot ring, global layers over all
    200 keys, in chunks of ``ATTN_FEW_HEADS_CHUNK`` keys."""
    import pipeline.engine.cuda as fused

    model, dec, caches, launches = recorded_step(monkeypatch, **GEMMA)
    layers = GEMMA["num_hidden_layers"]
    assert [k["name"] for k in launches] == ["pl_embed"] + ["pl_qkv_norm", "pl_attn", "pl_gemv_plain", "pl_gemv_geglu",
                                                            "pl_gemv_plain"] * layers + ["pl_gemv_res_logits"]
    H, KVH, D = GEMMA["num_attention_heads"], GEMMA["num_key_value_heads"], dec.head_dim
    qkv = [k for k in launches if k["name"] == "pl_qkv_norm"]
    attn = [k for k in launches if k["name"] == "pl_attn"]
    for i, (q, a) in enumerate(zip(qkv, attn)):
        assert q["grid"][0] // q["threadgroup"][0] == (H + 2 * KVH) * D // 16  # 16 rows of a head a block
        assert q["inputs"]["qkv_rows"] == ((H + 2 * KVH) * D,) and q["inputs"]["arrivals"][0] >= H + 2 * KVH
        assert ("h" in q["inputs"]) == (i > 0) and ("wpost" in q["inputs"]) == (i > 0)
        sliding = model.args.is_sliding(i)
        assert q["inputs"]["kc"] == caches[i].keys.shape
        assert caches[i].keys.shape[2] == (64 if sliding else 256)
        ch = dec.attn_chunk  # 4 query heads: ATTN_FEW_HEADS_CHUNK keys a block
        assert ch == decoder_module.ATTN_FEW_HEADS_CHUNK and a["threadgroup"] == (ch, 1, 1)
        assert a["grid"] == (-(-(64 if sliding else 200) // ch) * ch, H, 1)
    for k in launches:
        blocks = k["grid"][0] // k["threadgroup"][0]
        warps = blocks * k["threadgroup"][0] // 32
        if k["name"] == "pl_gemv_geglu":
            assert {"gw", "uw", "h", "wpost", "nw"} <= set(k["inputs"])
            assert warps * fused.units_per_warp(2 * GEMMA["intermediate_size"], "swiglu") >= GEMMA["intermediate_size"]
        elif k["name"] == "pl_gemv_res_logits":
            assert warps * fused.units_per_warp(GEMMA["vocab_size"], "plain") >= GEMMA["vocab_size"]
    assert dec.embed_scale == 16.0  # sqrt(256), exact in bfloat16


def test_gemma3_gemvs_on_tensor_cores_launch_plan(monkeypatch):
    """Gemma 3's gate/up and vocabulary projection on tensor cores (GEMV_MMA_MODES "geglu", "res_logits", float16
    4-bit; runs anywhere): one ``pl_gemv_geglu_mma`` launch a layer reading both matrices and the residual step's
    inputs, writing the new residual stream too, 8 gate/up row pairs a block covering every row, its source filled in
    completely; the vocabulary's 16 rows a block covering every row."""
    import pipeline.engine.cuda as fused

    monkeypatch.setattr(decoder_module, "GEMV_MMA_MODES", ("swiglu", "geglu", "res_logits"))
    monkeypatch.setattr(fused.mx.fast, "cuda_kernel", _RecordingKernel)
    _RecordingKernel.launches, _RecordingKernel.sources = [], []
    dec = decoder_for(make_model(**GEMMA))
    for lay in dec.layers:  # the step's call (Gemma3Decoder.step), without a prefill
        v = mx.zeros((dec.hidden,), dec.dtype)
        a, h = dec._gemv(lay["gate"], "geglu", [v, v, lay["post_attn"], lay["pre_ff"], *lay["gate"].arrays,
                                                *lay["up"].arrays], proj2=lay["up"])
        assert a.shape == (GEMMA["intermediate_size"],) and h.shape == (dec.hidden,)
    logits = dec._gemv(dec.head, "res_logits", [v, v, lay["post_ff"], dec.final_norm, *dec.head.arrays])
    assert logits.shape == (GEMMA["vocab_size"],)
    geglu, (head,) = _RecordingKernel.launches[:-1], _RecordingKernel.launches[-1:]
    assert [k["name"] for k in geglu] == ["pl_gemv_geglu_mma"] * GEMMA["num_hidden_layers"]
    assert head["name"] == "pl_gemv_res_logits_mma" and (head["grid"][0] // 256) * 16 >= GEMMA["vocab_size"]
    n = GEMMA["intermediate_size"]
    for k in geglu:
        assert list(k["inputs"])[:4] == ["x", "h", "wpost", "nw"]
        assert {"gw", "gs", "gb", "uw", "us", "ub"} <= set(k["inputs"]) and k["inputs"]["gw"] == k["inputs"]["uw"]
        assert k["threadgroup"] == (256, 1, 1) and (k["grid"][0] // 256) * 8 >= n
    src = next(s for s in _RecordingKernel.sources if "pl_load_x_res<T, K, NT, 8" in s)
    assert "$" not in src and "pl_mma_rows<" in src and "gw, gs, gb, uw, us, ub, r0, r1" in src


@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["qkv-fused", "qkv-separate"])
def test_qwen3_launch_plan(fuse_qkv, monkeypatch):
    """Qwen 3's host side (runs anywhere): Llama's five launches per layer with the per-head-norm q/k/v
    kernel first (each q, k and v head's rows over blocks of 16, the q/k norm weights and the fused matrix
    or the three matrices as its inputs); the kernel sources fill in completely."""
    _, dec, caches, launches = recorded_step(monkeypatch, **QWEN3, fuse_qkv=fuse_qkv)
    assert type(dec) is Qwen3Decoder
    layers = QWEN3["num_hidden_layers"]
    per_layer = ["pl_qkv_norm", "pl_attn", "pl_gemv_residual", "pl_gemv_swiglu", "pl_gemv_residual"]
    assert [k["name"] for k in launches] == ["pl_embed"] + per_layer * layers + ["pl_gemv_norm"]
    H, KVH, D = QWEN3["num_attention_heads"], QWEN3["num_key_value_heads"], QWEN3["head_dim"]
    weights = {"w", "s", "b"} if fuse_qkv else {"qw", "qs", "qb", "kw", "ks", "kb", "vw", "vs", "vb"}
    for i, k in enumerate(k for k in launches if k["name"] == "pl_qkv_norm"):
        assert k["grid"][0] // k["threadgroup"][0] == (H + 2 * KVH) * D // 16  # 16 rows of a head a block
        assert set(k["inputs"]) == {"x", "nw", "qn", "kn", "inv_freq", "pos", "kc", "vc", "qkv_rows",
                                    "arrivals"} | weights
        assert k["inputs"]["qn"] == k["inputs"]["kn"] == (D,)
        assert k["inputs"]["kc"] == caches[i].keys.shape
        rows = (H + 2 * KVH) * D
        assert (k["inputs"]["w"] if fuse_qkv else k["inputs"]["qw"])[0] == (rows if fuse_qkv else H * D)
    assert _RecordingKernel.sources and not any("$" in k for k in _RecordingKernel.sources)  # every field filled
