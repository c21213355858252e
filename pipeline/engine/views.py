"""K/V views: how the compiled and batched decode steps see a layer's cache buffers (one new token per step).

A view holds a layer's buffers for one traced step and writes the new token's key and value at its
position, with everything that changes per step as arrays (``LayerKind`` is what shapes the graph).
``DecodeView`` serves the batch-1 compiled step (``pipeline.engine.compiled``), ``BatchView`` the batched
step (``pipeline.engine.batch``); ``position_bytes`` sizes a layer's batch buffers; ``capacity_bucket`` and
``prefill_pad`` bound the shapes those steps and the prefills meet.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

CAPACITY_STEP = 256
PREFILL_MIN_BUCKET = 16  # shortest padded prefill length (tokens): group prefills, padded batch-1 prefills


def prefill_pad(n: int) -> int:
    """The length a prefill of ``n`` (>= 1) tokens is padded to, before any cap: the next power of two, at least
    ``PREFILL_MIN_BUCKET`` (``BatchEngine.prefill_bucket``, ``Engine.pad_prefill``)."""
    return max(PREFILL_MIN_BUCKET, 1 << (n - 1).bit_length())


def capacity_bucket(n: int) -> int:
    """Cache capacity for ``n`` positions: 256 * 2**k, so a job needs few distinct closures."""
    cap = CAPACITY_STEP
    while cap < n:
        cap *= 2
    return cap


@dataclass(frozen=True)
class LayerKind:
    """What of one layer's cache shapes the traced graph."""

    quantized: bool
    capacity: int
    window: int | None
    bits: int | None
    group_size: int | None


class DecodeView:
    """One layer's cache as seen inside the compiled single-token step.

    Holds the cache buffers ``(1, n_kv_heads, capacity, head_dim)`` (for quantized kinds the
    ``(packed, scales, biases)`` triples), the position ``pos`` (int32 scalar array) of the new token,
    and writes the token's key/value into slot ``pos`` (``pos % window`` for rotating caches) with
    ``mx.slice_update``. Attention sees every slot through a boolean mask of the written ones: for a
    rotating cache whose ring has wrapped those are exactly the ``window`` most recent positions.
    """

    def __init__(self, kind: LayerKind, keys, values, pos: mx.array):
        self.kind, self.keys, self.values, self.offset = kind, keys, values, pos

    def make_mask(self, n: int) -> mx.array:
        return mx.arange(self.kind.capacity) <= self.offset

    def _slot(self) -> mx.array:
        slot = self.offset % self.kind.window if self.kind.window else self.offset
        return slot.reshape(1)

    def _written_only(self, x: mx.array) -> mx.array:
        """``x`` with the slots not written for this request zeroed: whatever an earlier request left
        there can never reach the attention output (0 * inf would be NaN)."""
        return mx.where(self.make_mask(1)[:, None], x, mx.zeros((), x.dtype))

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        slot, kind = self._slot(), self.kind
        if not kind.quantized:
            self.keys = mx.slice_update(self.keys, k, slot, axes=(2,))
            self.values = mx.slice_update(self.values, v, slot, axes=(2,))
            return self._written_only(self.keys), self._written_only(self.values)

        def store(buffers, x):
            parts = mx.quantize(x, group_size=kind.group_size, bits=kind.bits)
            return tuple(mx.slice_update(b, p, slot, axes=(2,)) for b, p in zip(buffers, parts))

        self.keys, self.values = store(self.keys, k), store(self.values, v)
        fetch = lambda b: mx.dequantize(*b, group_size=kind.group_size, bits=kind.bits).astype(k.dtype)  # noqa: E731
        return self._written_only(fetch(self.keys)), self._written_only(fetch(self.values))


def layer_capacity(cache, needed: int) -> int:
    """Slots the compiled step uses for ``needed`` positions: ``capacity_bucket(needed)``, at most the
    cache's window. It depends only on the request, never on buffers grown by earlier prompts, so
    results do not depend on what ran before (attention sums over the same number of slots)."""
    cap = capacity_bucket(needed)
    return min(cap, cache.max_size) if getattr(cache, "max_size", None) else cap


def layer_kind(cache, capacity: int) -> LayerKind:
    return LayerKind(getattr(cache, "bits", None) is not None, capacity, getattr(cache, "max_size", None),
                     getattr(cache, "bits", None), getattr(cache, "group_size", None))


def head(buffer, n: int):
    """The first ``n`` slots of a cache buffer (an array or a quantized triple), a view when smaller."""
    if isinstance(buffer, tuple):
        return tuple(head(b, n) for b in buffer)
    return buffer if buffer.shape[2] == n else buffer[..., :n, :]


def put_head(buffer, new):
    """``buffer`` with its first slots replaced by ``new`` (same kind, fewer or equal slots)."""
    if isinstance(buffer, tuple):
        return tuple(put_head(b, x) for b, x in zip(buffer, new))
    if buffer.shape[2] == new.shape[2]:
        return new
    buffer[..., : new.shape[2], :] = new
    return buffer


class BatchView:
    """One layer's batch buffers as seen by one batched decode step (one new token per slot).

    Holds ``keys``/``values`` ``(B, n_kv_heads, capacity, head_dim)`` (quantized layers: triples) and
    ``offset``, the ``(B,)`` int32 positions of the new tokens. ``update_and_fetch`` writes each slot's
    key and value at its position (``position % window`` for rotating layers) and returns the whole
    buffers; ``make_mask`` marks, per slot, the written slots (for a ring that has wrapped: all of them,
    which are exactly the window).

    A quantized layer with ``start`` > 0 (``quantized_kv_start``) holds 4-tuples ``(dense, packed,
    scales, biases)``: every position is written both ways, and a slot attends over the dense keys while
    its position is below ``start``, over the quantized ones after, as the sequential cache does (it
    switches once ``start`` positions are stored; quantizing is per position, so quantizing at write
    time gives the same values as quantizing at the switch).
    """

    def __init__(self, kind: LayerKind, keys, values, pos: mx.array, start: int = 0, masks: dict | None = None):
        self.kind, self.keys, self.values, self.offset, self.start = kind, keys, values, pos, start
        self._masks = {} if masks is None else masks

    def make_mask(self, n: int) -> mx.array:
        """``(B, 1, 1, capacity)`` bool: True where the slot holds a position at or before the query
        (built once per step for all layers of one capacity: ``masks`` is shared by the step's views)."""
        cap = self.kind.capacity
        if cap not in self._masks:
            self._masks[cap] = (mx.arange(cap)[None, :] <= self.offset[:, None])[:, None, None, :]
        return self._masks[cap]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        kind = self.kind
        slot = self.offset % kind.window if kind.window else self.offset
        idx = slot.reshape(-1, 1, 1, 1)

        def put(buf, x):
            return mx.put_along_axis(buf, mx.broadcast_to(idx, x.shape), x, axis=2)

        if not kind.quantized:
            self.keys, self.values = put(self.keys, k), put(self.values, v)
            return self.keys, self.values

        def store(buffers, x):
            parts = mx.quantize(x, group_size=kind.group_size, bits=kind.bits)
            return tuple(put(b, p) for b, p in zip(buffers, parts))

        fetch = lambda b: mx.dequantize(*b, group_size=kind.group_size, bits=kind.bits).astype(k.dtype)  # noqa: E731
        if not self.start:
            self.keys, self.values = store(self.keys, k), store(self.values, v)
            return fetch(self.keys), fetch(self.values)
        dense = (self.offset < self.start).reshape(-1, 1, 1, 1)
        both = lambda buf, x: (put(buf[0], x), *store(buf[1:], x))  # noqa: E731
        pick = lambda buf: mx.where(dense, buf[0], fetch(buf[1:]))  # noqa: E731
        self.keys, self.values = both(self.keys, k), both(self.values, v)
        return pick(self.keys), pick(self.values)


def stored_slots(cache) -> int:
    """Slots of a batch-1 cache holding positions after prefill (a ring holds at most its window)."""
    return cache.offset if cache.max_size is None else min(cache.offset, cache.max_size)


def position_bytes(cache) -> int:
    """Bytes one position of one slot takes in a layer's batch buffers (keys + values), from the
    geometry of a batch-1 cache that has run at least one token."""
    _, H, k_dim, v_dim, dtype = cache.buffer_geometry()
    dense = H * (k_dim + v_dim) * dtype.size
    if cache.bits is None:
        return dense
    per = lambda d: H * (d * cache.bits // 32 * 4 + 2 * (d // cache.group_size) * dtype.size)  # noqa: E731
    return per(k_dim) + per(v_dim) + (dense if cache.start else 0)  # start > 0: dense copies too
