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
