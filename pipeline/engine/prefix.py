"""Prefix caching: the KV of fixed-size prompt blocks kept across rows, so a prompt that starts like an earlier
one reuses its keys and values instead of recomputing them (vLLM's automatic prefix caching).

A prompt's ids are cut into blocks of ``block_size`` tokens; block ``k`` is keyed by a chained hash, sha256 of
block ``k - 1``'s key and block ``k``'s ids, so a key stands for everything before the block's end (vLLM's
``hash_block_tokens``). The store maps a key to a copy of every layer's keys and values of that block, in
the form the layer's cache stores them (dense arrays, or ``(packed, scales, biases)`` triples), and holds at
most ``capacity_bytes`` of them, evicting the least recently used block first; a hit touches its blocks last
to first, so a chain's tail is evicted before its head (a head evicted first would orphan its tail).

Exactness: a cached block is bitwise what a prefill would compute only if that prefill runs the same chunks.
With prefix caching on, ``Engine.prefill_prompt`` therefore prefills in chunks of exactly one block at
absolute block boundaries, cached or not (the last chunk is the prompt's tail), and always computes the
block holding the prompt's last token (its logits start the generation), so a row that reuses ``h`` blocks
runs exactly the chunks after ``h`` that the same row without reuse runs. That is the rule on the CPU
(``Engine.exact_prefix``); on a GPU, where a forward per block costs more than the prefill it saves, what is
not reused runs in ``prefill_step_size`` chunks, so a reused block differs from a recomputed one by float
rounding only (the same greedy tokens in tests/test_prefix_cache.py, not the same bits).

Partial blocks (the GPU rule only, batched group prefill): a block stored with its ids and its parent's key
(``put(..., parent=, ids=)``) can also be reused in part: a prompt whose next block is not held reuses the
first ``m`` positions of a held block of the same parent that begins with the same ``m`` ids (``partial``;
a key or value at a position depends only on the ids up to it), as SGLang's radix tree reuses a prefix to
the token. Few-shot prompts share a prefix that rarely ends on a block edge: without this, up to
``block_size - 1`` shared tokens of every row are recomputed.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict

import numpy as np

from .cache import _tmap

# Blocks of one parent that ``PrefixStore.partial`` compares a prompt with (the first ones stored): it runs for
# every waiting request at each admission, so its cost stays bounded when thousands of rows branch at one block.
PARTIAL_CANDIDATES = 16


def block_hashes(ids: list[int], block_size: int) -> list[bytes]:
    """The chained key (32-byte sha256 digest) of each full block of ``ids``: ``len(ids) // block_size`` keys."""
    out, h = [], b""
    arr = np.asarray(ids, dtype=np.uint32)
    for k in range(len(ids) // block_size):
        h = hashlib.sha256(h + arr[k * block_size : (k + 1) * block_size].tobytes()).digest()
        out.append(h)
    return out


def _views(layers: list, row: int, a: int, n: int) -> list:
    """Views of row ``row``, positions ``a : a + n`` (axis 2) of each layer's ``(keys, values)``."""
    view = lambda x: x[row : row + 1, :, a : a + n, :]  # noqa: E731
    return [(_tmap(view, k), _tmap(view, v)) for k, v in layers]


def _nbytes(layers: list) -> int:
    total = 0
    for k, v in layers:
        for buf in (k, v):
            total += sum(b.nbytes for b in buf) if isinstance(buf, tuple) else buf.nbytes
    return total


class PrefixStore:
    """Blocks of KV by chained hash, within ``capacity_bytes``, least recently used evicted first.

    Args:
        capacity_bytes: most bytes of keys and values held (``cache.prefix_cache_gb`` x 10**9).
        block_size: tokens per block.

    Attributes:
        nbytes: bytes held now.
        evictions: blocks evicted so far.
    """

    def __init__(self, capacity_bytes: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.capacity_bytes, self.block_size = int(capacity_bytes), block_size
        self.blocks: OrderedDict[bytes, tuple[list, int]] = OrderedDict()
        self.children: dict[bytes, list[bytes]] = {}  # parent key -> keys of the held blocks stored with ids
        self.ids: dict[bytes, tuple[bytes, np.ndarray]] = {}  # key -> (parent key, the block's ids)
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def hits(self, keys: list[bytes]) -> int:
        """Leading ``keys`` held (the blocks a prompt with these keys can reuse); touches nothing."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def take(self, keys: list[bytes]) -> list[list]:
        """The blocks of the leading ``keys`` held, each a per-layer list of ``(keys, values)`` in stored form
        ``(1, n_kv_heads, block_size, ...)``; touched last to first (most recently used: the chain's head)."""
        n = self.hits(keys)
        for key in reversed(keys[:n]):
            self.blocks.move_to_end(key)
        out = []
        for key in keys[:n]:
            layers, size = self.blocks[key]
            if callable(layers):  # held by put_range: its views are cut the first time the block is taken
                layers = layers()
                self.blocks[key] = (layers, size)
            out.append(layers)
        return out

    def partial(self, parent: bytes, ids) -> tuple[bytes, int]:
        """The held block (stored with ids) after ``parent`` (the key of the block before it; b"" for a prompt's
        first block) that begins with the longest run of ``ids`` (the oldest of those that tie), and that
        run's length: ``(key, m)``, or ``(b"", 0)`` when no such block shares a first id. Touches nothing."""
        keys = self.children.get(parent)
        want = np.asarray(ids[: self.block_size], dtype=np.uint32)
        if not keys or not len(want):
            return b"", 0
        same = np.stack([self.ids[k][1][: len(want)] for k in keys]) == want  # (children, len(want))
        run = np.where(same.all(axis=1), len(want), same.argmin(axis=1))  # leading equal ids of each
        i = int(run.argmax())  # the first (oldest) of the longest
        return (keys[i], int(run[i])) if run[i] else (b"", 0)

    def common(self, key: bytes, ids) -> int:
        """How many leading ``ids`` the held block ``key`` (stored with ids) begins with (0 if it is not held)."""
        if key not in self.ids:
            return 0
        have = self.ids[key][1]
        want = np.asarray(ids[: len(have)], dtype=np.uint32)
        diff = np.flatnonzero(have[: len(want)] != want)
        return int(diff[0]) if diff.size else len(want)

    def take_part(self, key: bytes, m: int) -> list:
        """The first ``m`` positions of held block ``key``, as ``take`` gives a block (views of it); touches it."""
        block = self.take([key])[0]
        view = lambda x: x[:, :, :m, :]  # noqa: E731
        return [(_tmap(view, k), _tmap(view, v)) for k, v in block]

    def put(self, key: bytes, layers, size: int | None = None, parent: bytes | None = None, ids=None) -> None:
        """Hold ``layers`` (a per-layer list of ``(keys, values)`` copies of one block, or a function that
        returns one, with its ``size`` in bytes) as ``key``, evicting least recently used blocks until it
        fits; a block larger than the whole store is not held. With ``parent`` (the previous block's key, b""
        for a first block) and ``ids`` (the block's ``block_size`` ids), ``partial`` can find it."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return
        size = _nbytes(layers) if size is None else size
        if size > self.capacity_bytes:
            return
        while self.nbytes + size > self.capacity_bytes:
            old, (_, freed) = self.blocks.popitem(last=False)
            self.nbytes -= freed
            self.evictions += 1
            if old in self.ids:
                up = self.ids.pop(old)[0]
                self.children[up].remove(old)
                if not self.children[up]:
                    del self.children[up]
        self.blocks[key] = (layers, size)
        self.nbytes += size
        if parent is not None and ids is not None and len(self.children.get(parent, ())) < PARTIAL_CANDIDATES:
            self.ids[key] = (parent, np.asarray(ids, dtype=np.uint32))
            self.children.setdefault(parent, []).append(key)

    def put_range(self, keys: list[bytes], layers: list, row: int = 0, parent: bytes | None = None,
                  ids=None) -> None:
        """Hold ``len(keys)`` consecutive blocks given as one per-layer list of ``(keys, values)`` copies
        spanning them all (positions along axis 2, ``len(keys) * block_size`` of them, from position 0 of the
        copies; several rows along axis 0, of which row ``row`` is this prompt's): block ``i`` is held as
        views of row ``row``, positions ``i * block_size : (i + 1) * block_size`` of those copies (no copy per
        block, and no view is cut until the block is taken; the copies' memory is freed once every block
        cut from them is evicted). ``parent`` and ``ids`` (the ``len(keys) * block_size`` ids of the range), as
        ``put`` takes them for one block."""
        B = self.block_size
        size = B * sum(part.nbytes // (part.shape[0] * part.shape[2]) for kv in layers for buf in kv
                       for part in (buf if isinstance(buf, tuple) else (buf,)))
        for i, key in enumerate(keys):
            up = None if parent is None else (keys[i - 1] if i else parent)
            self.put(key, functools.partial(_views, layers, row, i * B, B), size, up,
                     None if ids is None else ids[i * B : (i + 1) * B])

    def clear(self) -> None:
        self.blocks.clear()
        self.children.clear()
        self.ids.clear()
        self.nbytes = 0
