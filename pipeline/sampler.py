"""Token sampling from logits, with the random state passed in explicitly.

Per-row seeds: ``row_seed(job_seed, row_id, sample_index)`` so a row's samples never depend on row
order, sharding, resume, or what ran before in the process.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx


def row_seed(job_seed: int, row_id, sample_index: int) -> int:
    """A 63-bit seed for one (job seed, row id, sample index): blake2b of their text, so the same
    triple gives the same seed in every process and on every platform."""
    text = f"{job_seed}\x1f{type(row_id).__name__}:{row_id}\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def categorical(logits: mx.array, inv_temperature: mx.array, key: mx.array) -> mx.array:
    """Sample ``(B,)`` uint32 ids from ``softmax(logits * inv_temperature)`` (``inv_temperature`` an
    ``mx.array`` so the compiled step does not bake it in)."""
    return mx.random.categorical(logits * inv_temperature, key=key).astype(mx.uint32)


def sample(logits: mx.array, temperature: float, key: mx.array | None) -> mx.array:
    """Pick the next token.

    Args:
        logits: ``(B, vocab)`` float logits.
        temperature: 0 for greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
        key: an ``mx.random.key`` (required when temperature > 0).

    Returns:
        ``(B,)`` uint32 token ids.
    """
    if temperature == 0:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    return categorical(logits, mx.array(1.0 / temperature, dtype=mx.float32), key)
