"""KV caches for one sequence (batch 1), reset and reused between prompts.

Layout follows mlx-lm's ``KVCache`` (mlx_lm/models/cache.py): keys and values are stored as
``(B, n_kv_heads, capacity, head_dim)`` buffers grown in steps of ``step`` positions; ``offset`` is the
number of positions written.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Full (unbounded) KV cache for one attention layer.

    ``update_and_fetch(keys, values)`` appends ``(B, n_kv_heads, L, head_dim)`` arrays and returns the
    keys and values of every position so far. ``reset()`` forgets the contents but keeps the buffers,
    so the next prompt writes into the same memory when it fits.
    """

    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, n_kv_heads, _, k_dim = keys.shape
            v_dim = values.shape[3]
            n_steps = (self.step + n - 1) // self.step
            k_new = mx.zeros((B, n_kv_heads, n_steps * self.step, k_dim), keys.dtype)
            v_new = mx.zeros((B, n_kv_heads, n_steps * self.step, v_dim), values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys[..., :prev, :], k_new], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], v_new], axis=2)
            else:
                self.keys, self.values = k_new, v_new
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(self, n: int):
        """Attention mask for ``n`` new queries over the keys the next ``update_and_fetch`` returns:
        None (one query sees every key) or "causal" (MLX's SDPA aligns it to the last ``n`` keys)."""
        return "causal" if n > 1 else None

    def reset(self) -> None:
        self.offset = 0

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not only the written part)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class RotatingKVCache:
    """Sliding-window KV cache for one attention layer: each query attends to exactly the ``max_size``
    most recent positions, itself included.

    Keys and values live in a ring buffer ``(B, n_kv_heads, capacity, head_dim)`` (capacity grows in
    steps of ``step`` up to ``max_size``); position ``p`` is stored in slot ``p % max_size``, so the
    slots are not in temporal order once the ring has wrapped. That is harmless because keys are stored
    after RoPE and ``make_mask`` marks, for each query, the slots inside its window.

    - One new position: written into its slot, then the filled slots are returned; they are exactly the
      window of the new query, so no mask is needed.
    - ``L > 1`` new positions: the filled slots (earlier positions) followed by the ``L`` new keys are
      returned, with a banded causal mask over them; then the last ``min(L, max_size)`` new keys are
      written into their slots.

    ``reset()`` forgets the contents but keeps the buffers, so the next prompt reuses the same memory.
    """

    step = 256

    def __init__(self, max_size: int):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _n_filled(self) -> int:
        """Slots holding earlier positions (the ring's first slots until it wraps, then all)."""
        return min(self.offset, self.max_size)

    def _slot_positions(self) -> mx.array:
        """Absolute position held by each filled slot ``(n_filled,)``: the latest ``p < offset`` with
        ``p % max_size == slot``."""
        slots = mx.arange(self._n_filled())
        return self.offset - 1 - (self.offset - 1 - slots) % self.max_size

    def make_mask(self, n: int):
        """Mask for ``n`` new queries over the keys the next ``update_and_fetch`` returns: None (one
        query: every returned key is in its window), "causal" (no earlier position has left any
        window yet and the keys are in temporal order), or a boolean array ``(n, n_filled + n)``, True
        where the key is at or before the query and fewer than ``max_size`` positions back."""
        if n == 1:
            return None
        if self.offset + n <= self.max_size:
            return "causal"
        q = mx.arange(self.offset, self.offset + n)[:, None]
        k = mx.concatenate([self._slot_positions(), mx.arange(self.offset, self.offset + n)])[None]
        return (k <= q) & (q - k < self.max_size)

    def _reserve(self, keys: mx.array, values: mx.array, needed: int) -> None:
        """Grow the buffers to hold ``needed`` slots (at most ``max_size``), keeping their contents."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if needed <= capacity:
            return
        B, n_kv_heads, _, k_dim = keys.shape
        size = min(self.max_size, -(-needed // self.step) * self.step) - capacity
        k_new = mx.zeros((B, n_kv_heads, size, k_dim), keys.dtype)
        v_new = mx.zeros((B, n_kv_heads, size, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = k_new, v_new
        else:
            self.keys = mx.concatenate([self.keys, k_new], axis=2)
            self.values = mx.concatenate([self.values, v_new], axis=2)

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """Store the last ``min(L, max_size)`` of ``L`` new positions in their slots (up to two
        contiguous runs when the ring wraps)."""
        L = keys.shape[2]
        m = min(L, self.max_size)
        keys, values = keys[..., L - m :, :], values[..., L - m :, :]
        start = (self.offset + L - m) % self.max_size
        first = min(m, self.max_size - start)
        self.keys[..., start : start + first, :] = keys[..., :first, :]
        self.values[..., start : start + first, :] = values[..., :first, :]
        if first < m:
            self.keys[..., : m - first, :] = keys[..., first:, :]
            self.values[..., : m - first, :] = values[..., first:, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``(B, n_kv_heads, L, head_dim)`` keys and values; returns the keys and values the ``L``
        queries attend over (see the class docstring for their order and ``make_mask`` for the mask)."""
        L = keys.shape[2]
        self._reserve(keys, values, min(self.offset + L, self.max_size))
        if L == 1:
            self._write(keys, values)
            self.offset += 1
            n = self._n_filled()
            return self.keys[..., :n, :], self.values[..., :n, :]
        n = self._n_filled()
        out_k = mx.concatenate([self.keys[..., :n, :], keys], axis=2)
        out_v = mx.concatenate([self.values[..., :n, :], values], axis=2)
        self._write(keys, values)
        self.offset += L
        return out_k, out_v

    def reset(self) -> None:
        self.offset = 0

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not only the written part)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
