"""The caches' prefix seam (``trim``, ``copy_prefix``, ``prefix_blocker``): a cache cut or copied to its first
``n`` positions continues exactly as a cache that was only ever fed those ``n`` (bitwise: a cache stores what it
is given, per position), for every kind where that holds; where it cannot hold (a wrapped ring, quantized
storage below ``quantized_kv_start``) the seam refuses."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import numpy as np
import pytest

from pipeline.engine.cache import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache

KINDS = {
    "full": lambda: KVCache(),
    "rotating": lambda: RotatingKVCache(32),
    "quantized": lambda: QuantizedKVCache(4, 64),
    "quantized-start-8": lambda: QuantizedKVCache(8, 64, start=8),
    "rotating-quantized": lambda: RotatingQuantizedKVCache(32, 4, 64),
}


def qkv(n: int, seed: int):
    """Random queries ``(1, 4, n, 64)`` and keys, values ``(1, 2, n, 64)``, float32 N(0, 1)."""
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((1, h, n, 64)).astype(np.float32)) for h in (4, 2, 2))


def feed(cache, q, k, v, a: int, b: int, chunks: list[int]) -> mx.array:
    """Positions ``a:b`` through ``cache`` in ``chunks`` (the attention outputs of those positions)."""
    outs, start = [], a
    for n in chunks:
        sl = slice(start, start + n)
        mask = cache.make_mask(n)
        keys, values = cache.update_and_fetch(k[:, :, sl], v[:, :, sl])
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, sl], keys, values, scale=64**-0.5, mask=mask))
        start += n
    assert start == b
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1, 12, 20])
def test_trimmed_and_copied_caches_continue_as_a_fresh_one(kind, n):
    q, k, v = qkv(28, seed=3)
    fed = KINDS[kind]()
    feed(fed, q, k, v, 0, 20, [20])
    if kind == "quantized-start-8" and 0 < n < 8:  # stored quantized; a fresh prefill of n would be dense
        with pytest.raises(ValueError, match="quantized_kv_start"):
            fed.trim(n)
        return
    assert fed.prefix_blocker(n) is None
    copy = KINDS[kind]()
    feed(copy, q, k + 1, v - 1, 0, 5, [5])  # stale contents to overwrite
    copy.copy_prefix(fed, n)
    fed.trim(n)
    fresh = KINDS[kind]()
    if n:
        feed(fresh, q, k, v, 0, n, [n])
    outs = [feed(c, q, k, v, n, 28, [28 - n - 1, 1] if 28 - n > 1 else [1]) for c in (fed, copy, fresh)]
    for c in (fed, copy):
        assert c.offset == fresh.offset == 28
        assert c.quantized == fresh.quantized
    np.testing.assert_array_equal(np.array(outs[0]), np.array(outs[2]))
    np.testing.assert_array_equal(np.array(outs[1]), np.array(outs[2]))


def test_a_wrapped_ring_refuses():
    q, k, v = qkv(20, seed=4)
    ring = RotatingKVCache(16)
    feed(ring, q, k, v, 0, 20, [20])
    assert "wrapped" in ring.prefix_blocker(8)
    with pytest.raises(ValueError, match="wrapped"):
        ring.trim(8)
    with pytest.raises(ValueError, match="wrapped"):
        RotatingKVCache(16).copy_prefix(ring, 8)
    assert ring.offset == 20  # refused: nothing changed


def test_quantized_storage_below_start_refuses():
    q, k, v = qkv(12, seed=5)
    cache = QuantizedKVCache(8, 64, start=8)
    feed(cache, q, k, v, 0, 12, [12])
    assert cache.quantized
    assert cache.prefix_blocker(8) is None
    with pytest.raises(ValueError, match="quantized_kv_start"):
        cache.trim(5)  # a fresh prefill of 5 positions would hold them dense


def test_prefix_beyond_the_stored_positions_or_of_other_settings_refuses():
    q, k, v = qkv(6, seed=6)
    cache = KVCache()
    feed(cache, q, k, v, 0, 6, [6])
    with pytest.raises(ValueError, match="7 positions asked, 6 stored"):
        cache.trim(7)
    with pytest.raises(ValueError, match="other settings"):
        RotatingKVCache(32).copy_prefix(cache, 3)
    with pytest.raises(ValueError, match="other settings"):
        QuantizedKVCache(8, 64).copy_prefix(QuantizedKVCache(4, 64), 0)
