"""RotatingKVCache: exact sliding-window attention, checked against full keys with an explicit banded
causal mask; reuse after reset(); the Engine with a tiny Gemma 3 model against full recomputation."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_parity import reference_model
from pipeline.engine.cache import RotatingKVCache
from pipeline.engine import Engine, GenerateParams
from pipeline.models import build_model

N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 8


def qkv(n: int, seed: int):
    """Random queries ``(1, N_HEADS, n, HEAD_DIM)`` and keys, values ``(1, N_KV_HEADS, n, HEAD_DIM)``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, N_HEADS, n, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((1, N_KV_HEADS, n, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((1, N_KV_HEADS, n, HEAD_DIM)).astype(np.float32)
    return mx.array(q), mx.array(k), mx.array(v)


def reference_attention(q, k, v, window: int) -> mx.array:
    """Every position over all keys, masked to the ``window`` most recent positions (itself included)."""
    n = q.shape[2]
    pos_q, pos_k = np.arange(n)[:, None], np.arange(n)[None, :]
    band = (pos_k <= pos_q) & (pos_q - pos_k < window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, mask=mx.array(band))


def cached_attention(cache: RotatingKVCache, q, k, v, chunks: list[int]) -> mx.array:
    """Feed the sequence through ``cache`` in chunks of the given sizes (mask taken before the update,
    as the models do); returns the outputs of every position, ``(1, N_HEADS, n, HEAD_DIM)``."""
    assert sum(chunks) == q.shape[2]
    outs, start = [], 0
    for n in chunks:
        sl = slice(start, start + n)
        mask = cache.make_mask(n)
        keys, values = cache.update_and_fetch(k[:, :, sl], v[:, :, sl])
        assert keys.shape[2] == values.shape[2] <= cache.max_size + (n if n > 1 else 0)
        if isinstance(mask, mx.array):
            assert mask.shape == (n, keys.shape[2]) and mask.dtype == mx.bool_
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, sl], keys, values, scale=HEAD_DIM**-0.5,
                                                         mask=mask))
        start += n
    assert cache.offset == q.shape[2]
    return mx.concatenate(outs, axis=2)


def assert_close(a: mx.array, b: mx.array, atol: float = 1e-5):
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=atol)


@pytest.mark.parametrize("chunks", [[8], [3, 3, 2], [1] * 8, [2] + [1] * 6],
                         ids=["one-chunk", "3+3+2", "single-steps", "2-prefill-then-steps"])
def test_window_4_over_8_tokens(chunks):
    q, k, v = qkv(8, seed=0)
    assert_close(cached_attention(RotatingKVCache(4), q, k, v, chunks), reference_attention(q, k, v, 4))


@pytest.mark.parametrize("window", [1, 4, 5])
@pytest.mark.parametrize("chunks", [[5, 1, 1, 6, 3], [1, 1, 1, 1, 1, 11], [4, 4, 1, 7], [2, 9, 1, 1, 3]])
def test_mixed_chunks_after_wrap(window, chunks):
    # Multi-token chunks after single steps and after wrapping, some longer than the window.
    q, k, v = qkv(16, seed=1)
    assert_close(cached_attention(RotatingKVCache(window), q, k, v, chunks), reference_attention(q, k, v, window))


def test_small_step_growth():
    # Capacity grows in steps up to the window; contents survive the growth.
    cache = RotatingKVCache(10)
    cache.step = 3
    q, k, v = qkv(24, seed=2)
    out = cached_attention(cache, q, k, v, [2, 1, 1, 4, 1, 1, 1, 13])
    assert_close(out, reference_attention(q, k, v, 10))
    assert cache.keys.shape[2] == 10


def test_reset_reuses_buffers():
    window = 32
    cache = RotatingKVCache(window)
    q, k, v = qkv(40, seed=3)
    first = cached_attention(cache, q, k, v, [8] + [1] * 32)
    assert_close(first, reference_attention(q, k, v, window))
    keys, values, nbytes = cache.keys, cache.values, cache.nbytes

    cache.reset()
    assert cache.offset == 0
    q2, k2, v2 = qkv(30, seed=4)
    chunks = [12] + [1] * 18
    reused = cached_attention(cache, q2, k2, v2, chunks)
    fresh = cached_attention(RotatingKVCache(window), q2, k2, v2, chunks)
    assert np.array_equal(np.array(reused), np.array(fresh))
    assert_close(reused, reference_attention(q2, k2, v2, window))
    assert cache.keys is keys and cache.values is values and cache.nbytes == nbytes


GEMMA3 = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 2,
    "max_position_embeddings": 512,
}
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, GEMMA3["vocab_size"], 40)]
SHORT_PROMPT = [7, 99, 3, 54, 21]


@pytest.fixture(scope="module")
def gemma3():
    _, weights, config = reference_model(GEMMA3, seed=1)
    return build_model(config, weights)


def recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens, each from the whole sequence so far run through fresh caches in one chunk."""
    tokens = list(prompt)
    for _ in range(n):
        logits = model(mx.array([tokens]), model.make_cache())[0, -1]
        tokens.append(int(mx.argmax(logits).item()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("prefill_step_size", [5, 24, 512])
def test_engine_matches_full_recomputation(gemma3, prefill_step_size):
    params = GenerateParams(max_tokens=30, ignore_eos=True)
    expected = recompute_greedy(gemma3, PROMPT, 30)
    assert len(set(expected)) > 1
    engine = Engine(gemma3, eos_token_ids=[], context_length=512, prefill_step_size=prefill_step_size)
    assert engine.generate(PROMPT, params).token_ids == expected

    logits = engine.forward(PROMPT + expected)
    reference = gemma3(mx.array([PROMPT + expected]), gemma3.make_cache())[0, -1]
    assert_close(logits, reference, atol=1e-4 * float(mx.abs(reference).max()))


def test_engine_reuse_equals_fresh_engine(gemma3):
    params = GenerateParams(max_tokens=25, ignore_eos=True)
    engine = Engine(gemma3, eos_token_ids=[], context_length=512, prefill_step_size=7)
    engine.generate(PROMPT, params)
    nbytes = [c.nbytes for c in engine.cache]
    # A prompt shorter than the window after a longer one: stale ring slots must stay unseen.
    reused = engine.generate(SHORT_PROMPT, params).token_ids
    assert [c.nbytes for c in engine.cache] == nbytes
    fresh = Engine(gemma3, eos_token_ids=[], context_length=512, prefill_step_size=7)
    assert reused == fresh.generate(SHORT_PROMPT, params).token_ids
    assert reused == recompute_greedy(gemma3, SHORT_PROMPT, 25)
