"""KV caches for one sequence (batch 1), reset and reused between prompts.

Layout follows mlx-lm's ``KVCache`` (mlx_lm/models/cache.py): keys and values are stored as
``(B, n_kv_heads, capacity, head_dim)`` buffers grown in steps of ``step`` positions; ``offset`` is the
number of positions written.

Four kinds, one interface (``offset``, ``make_mask(n)`` called before ``update_and_fetch(keys, values)``,
``reset()``, ``reserve(n)``, ``state``, ``nbytes``, ``buffer_geometry()``; the prefix seam ``trim(n)``,
``copy_prefix(src, n)``, ``prefix_blocker(n)``, and for the prefix cache ``stored_copy(a, b)`` and
``load_prefix(keys, values)``), so model code does not know which it has:

- ``KVCache``: every position, dense.
- ``RotatingKVCache(max_size)``: the ``max_size`` most recent positions, dense, in a ring buffer.
- ``QuantizedKVCache(bits, group_size, start)``: every position, stored MLX-affine-quantized.
- ``RotatingQuantizedKVCache(max_size, bits, group_size, start)``: the ring, stored quantized.

``update_and_fetch`` always returns dense keys and values (quantized kinds dequantize what they store),
so they go straight into ``mx.fast.scaled_dot_product_attention``.

Attributes every kind exposes (for code that runs the cache buffers through a compiled step):

- ``keys``, ``values``: the buffers, None until the first update. Dense kinds (and quantized kinds
  while ``quantized`` is False): arrays ``(B, n_kv_heads, capacity, head_dim)`` in the keys' dtype.
  Quantized kinds while ``quantized``: tuples ``(packed, scales, biases)`` as ``mx.quantize(x,
  group_size, bits)`` returns them along head_dim: ``packed`` uint32 ``(B, n_kv_heads, capacity,
  head_dim * bits // 32)``, ``scales`` and ``biases`` ``(B, n_kv_heads, capacity, head_dim //
  group_size)`` in the keys' dtype. Slots ``>= offset`` (unbounded kinds) or not yet written (ring)
  hold zeros or stale data from before ``reset()``. Both are assignable.
- ``offset``: positions written so far (int).
- ``max_size``: the window of rotating kinds; None for unbounded kinds. A rotating cache stores
  position ``p`` in slot ``p % max_size``.
- ``bits``, ``group_size``: the quantization of quantized kinds; None for dense kinds.
- ``quantized``: whether ``keys``/``values`` currently hold quantized triples (always False for dense
  kinds; see ``QuantizedKVCache`` for the switch at ``start``).
"""

from __future__ import annotations

import mlx.core as mx


class CacheConfigError(ValueError):
    """A cache spec the model cannot use (the message names the values at fault)."""


# Storage helpers: a buffer is a dense array or a (packed, scales, biases) triple, slots on axis 2.


def _tmap(f, *bufs):
    """``f`` applied to a dense buffer, or to each component of quantized triples (zipped)."""
    if isinstance(bufs[0], tuple):
        return tuple(f(*parts) for parts in zip(*bufs))
    return f(*bufs)


def _n_slots(buf) -> int:
    """Slots (positions) a buffer holds; 0 for None."""
    if buf is None:
        return 0
    return (buf[0] if isinstance(buf, tuple) else buf).shape[2]


def _take(buf, a: int, b: int):
    """Slots ``a:b`` of a buffer."""
    return _tmap(lambda x: x[..., a:b, :], buf)


def _put(buf, at: int, x) -> None:
    """Write ``x`` (same form as ``buf``) into slots ``at : at + len(x)`` in place."""
    n = _n_slots(x)
    if isinstance(buf, tuple):
        for b, part in zip(buf, x):
            b[..., at : at + n, :] = part
    else:
        buf[..., at : at + n, :] = x


def _buf_nbytes(buf) -> int:
    if buf is None:
        return 0
    return sum(b.nbytes for b in buf) if isinstance(buf, tuple) else buf.nbytes


def _geometry(keys: mx.array, values: mx.array) -> tuple:
    """``(B, n_kv_heads, k_head_dim, v_head_dim, dtype)`` of dense keys and values."""
    return (*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)


class _CacheBase:
    """Buffer management shared by all kinds; the dense storage hooks (quantized kinds override them)."""

    step = 256
    max_size: int | None = None
    bits: int | None = None
    group_size: int | None = None
    quantized = False

    # -- storage hooks: dense ------------------------------------------------------------------------

    def _encode(self, x: mx.array):
        """Dense ``(B, H, L, D)`` -> the form stored in the buffers (dense: unchanged)."""
        return x

    def _decode(self, stored, dtype: mx.Dtype) -> mx.array:
        """Stored form -> dense ``(B, H, L, D)`` of ``dtype`` (dense: unchanged)."""
        return stored

    def _zeros(self, B: int, H: int, n: int, dim: int, dtype: mx.Dtype):
        """Zero storage for ``n`` slots."""
        return mx.zeros((B, H, n, dim), dtype)

    def buffer_geometry(self) -> tuple | None:
        """``(B, n_kv_heads, k_head_dim, v_head_dim, dtype)`` of the buffers, None before the first update."""
        return None if self.keys is None else _geometry(self.keys, self.values)

    def _after_update(self) -> None:
        """Called at the end of every ``update_and_fetch`` (quantized kinds may switch mode here)."""

    # -- shared --------------------------------------------------------------------------------------

    def _capacity_for(self, n: int) -> int:
        """Capacity for ``n`` slots: ``n`` rounded up to a multiple of ``step``, at most ``max_size``."""
        cap = -(-n // self.step) * self.step
        return cap if self.max_size is None else min(self.max_size, cap)

    def _resize(self, capacity: int, keep: int, geometry: tuple) -> None:
        """Make the buffers ``capacity`` slots long: their first ``keep`` slots followed by zeros."""
        B, H, k_dim, v_dim, dtype = geometry
        k_new = self._zeros(B, H, capacity - keep, k_dim, dtype)
        v_new = self._zeros(B, H, capacity - keep, v_dim, dtype)
        if self.keys is None:
            self.keys, self.values = k_new, v_new
        else:
            cat = lambda old, new: mx.concatenate([old[..., :keep, :], new], axis=2)  # noqa: E731
            self.keys, self.values = _tmap(cat, self.keys, k_new), _tmap(cat, self.values, v_new)

    def _grow(self, n: int, geometry: tuple) -> None:
        """Grow the current buffers (keeping every slot) to at least ``n`` slots."""
        capacity = _n_slots(self.keys)
        if n > capacity:
            self._resize(self._capacity_for(n), capacity, geometry)

    def reserve(self, n: int) -> None:
        """Grow the buffers, keeping their contents, so that at least ``min(n, max_size or n)`` slots
        exist and the next updates up to that many positions allocate nothing. Needs the buffers'
        shape: call it after the first ``update_and_fetch`` (before it, it does nothing)."""
        geometry = self.buffer_geometry()
        if geometry is not None:
            self._grow(n if self.max_size is None else min(n, self.max_size), geometry)

    def reset(self) -> None:
        """Forget the contents; the buffers are kept for the next prompt."""
        self.offset = 0

    # -- the prefix seam -----------------------------------------------------------------------------

    def prefix_blocker(self, n: int) -> str | None:
        """Why the first ``n`` positions cannot be kept as a prefix (``trim``, ``copy_prefix``), or None:
        they must all be stored (``n <= offset``), none overwritten by a ring that wrapped, and in the
        storage mode a fresh prefill of ``n`` positions would use (quantized after ``start`` only)."""
        if not 0 <= n <= self.offset:
            return f"{n} positions asked, {self.offset} stored"
        if self.max_size is not None and self.offset > self.max_size:
            return f"the ring of {self.max_size} slots has wrapped (offset {self.offset})"
        if self.quantized and 0 < n < getattr(self, "start", 0):
            return f"stored quantized, but {n} positions < quantized_kv_start {self.start} are dense"
        return None

    def trim(self, n: int) -> None:
        """Keep only the first ``n`` positions (the next update writes position ``n``).

        Raises:
            ValueError: ``prefix_blocker(n)`` (the result would differ from a prefill of those ``n``).
        """
        why = self.prefix_blocker(n)
        if why:
            raise ValueError(f"cannot trim to {n} positions: {why}")
        if n == 0:
            self.reset()  # the initial storage mode too
        self.offset = n

    def copy_prefix(self, src, n: int) -> None:
        """Hold a copy of the first ``n`` positions of ``src`` (a cache of the same class and settings)
        and nothing else; this cache's buffers are reused when large enough.

        Raises:
            ValueError: another cache class or settings, or ``src.prefix_blocker(n)``.
        """
        settings = lambda c: (type(c), c.max_size, c.bits, c.group_size, getattr(c, "start", 0))  # noqa: E731
        if settings(src) != settings(self):
            raise ValueError(f"cannot copy a prefix of a {type(src).__name__} into a {type(self).__name__} "
                             "of other settings")
        why = src.prefix_blocker(n)
        if why:
            raise ValueError(f"cannot copy a prefix of {n} positions: {why}")
        self.reset()
        if n:
            self.quantized = src.quantized
        geometry = src.buffer_geometry()
        if n and geometry is not None:
            if _n_slots(self.keys) < n:
                self._resize(self._capacity_for(n), 0, geometry)
            _put(self.keys, 0, _take(src.keys, 0, n))
            _put(self.values, 0, _take(src.values, 0, n))
        self.offset = n

    def stored_copy(self, a: int, b: int) -> tuple:
        """``(keys, values)``: copies of positions ``a:b`` in stored form (arrays ``(B, n_kv_heads, b - a,
        head_dim)``, or quantized triples), for a ``PrefixStore`` block.

        Raises:
            ValueError: positions not stored, or not in slots ``a:b`` (a ring past ``b > max_size``, or one that
                has written position ``a + max_size`` over slot ``a``).
        """
        if not 0 <= a <= b <= self.offset or (self.max_size is not None and (b > self.max_size
                                                                              or self.offset > a + self.max_size)):
            raise ValueError(f"positions {a}:{b} are not in slots {a}:{b} (offset {self.offset}, "
                             f"window {self.max_size})")
        copy = lambda x: mx.contiguous(x[..., a:b, :])  # noqa: E731  a copy, not a view of the whole buffer
        return _tmap(copy, self.keys), _tmap(copy, self.values)

    def load_prefix(self, keys, values) -> None:
        """Hold exactly the positions ``0 : n`` given as ``keys``, ``values`` in stored form (``stored_copy``
        of the same class and settings, concatenated along axis 2); this cache's buffers are reused when
        large enough. A cache loaded so continues exactly as one that was fed those ``n`` positions, where
        ``prefix_blocker(n)`` of that one is None and its storage mode after them is the stored form's (an
        ``Engine`` with a prefix store keeps ``quantized_kv_start`` 0 and windows >= n)."""
        self.reset()
        n = _n_slots(keys)
        if not n:
            return
        self.quantized = isinstance(keys, tuple)
        if self.quantized:
            (kp, ks, _), (vp, _, _) = keys, values
            geometry = (*kp.shape[:2], kp.shape[3] * 32 // self.bits, vp.shape[3] * 32 // self.bits, ks.dtype)
        else:
            geometry = _geometry(keys, values)
        if _n_slots(self.keys) < n:
            self._resize(self._capacity_for(n), 0, geometry)
        _put(self.keys, 0, keys)
        _put(self.values, 0, values)
        self.offset = n

    @property
    def state(self) -> list[mx.array]:
        """The arrays of the current buffers (to ``mx.eval``)."""
        out = []
        for buf in (self.keys, self.values):
            if buf is not None:
                out.extend(buf if isinstance(buf, tuple) else [buf])
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not only the written part)."""
        return _buf_nbytes(self.keys) + _buf_nbytes(self.values)


class KVCache(_CacheBase):
    """Full (unbounded) KV cache for one attention layer.

    ``update_and_fetch(keys, values)`` appends ``(B, n_kv_heads, L, head_dim)`` arrays and returns the
    keys and values of every position so far. ``reset()`` forgets the contents but keeps the buffers,
    so the next prompt writes into the same memory when it fits. Buffers grow by ``L`` rounded up to
    a multiple of ``step`` (256) positions when full, as mlx-lm's ``KVCache``.
    """

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def _n_stored(self) -> int:
        return self.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self.offset
        n = keys.shape[2]
        if prev + n > _n_slots(self.keys):
            n_steps = (self.step + n - 1) // self.step
            self._resize(prev + n_steps * self.step, prev, _geometry(keys, values))
        self.offset += n
        _put(self.keys, prev, self._encode(keys))
        _put(self.values, prev, self._encode(values))
        out = (self._decode(_take(self.keys, 0, self.offset), keys.dtype),
               self._decode(_take(self.values, 0, self.offset), values.dtype))
        self._after_update()
        return out

    def make_mask(self, n: int):
        """Attention mask for ``n`` new queries over the keys the next ``update_and_fetch`` returns:
        None (one query sees every key) or "causal" (MLX's SDPA aligns it to the last ``n`` keys)."""
        return "causal" if n > 1 else None


class RotatingKVCache(_CacheBase):
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

    def __init__(self, max_size: int):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self.keys = None
        self.values = None
        self.offset = 0

    def _n_filled(self) -> int:
        """Slots holding earlier positions (the ring's first slots until it wraps, then all)."""
        return min(self.offset, self.max_size)

    _n_stored = _n_filled

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

    def _write(self, keys, values) -> None:
        """Store the last ``min(L, max_size)`` of ``L`` new positions (in stored form) in their slots
        (up to two contiguous runs when the ring wraps)."""
        L = _n_slots(keys)
        m = min(L, self.max_size)
        keys, values = _take(keys, L - m, L), _take(values, L - m, L)
        start = (self.offset + L - m) % self.max_size
        first = min(m, self.max_size - start)
        _put(self.keys, start, _take(keys, 0, first))
        _put(self.values, start, _take(values, 0, first))
        if first < m:
            _put(self.keys, 0, _take(keys, first, m))
            _put(self.values, 0, _take(values, first, m))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``(B, n_kv_heads, L, head_dim)`` keys and values; returns the keys and values the ``L``
        queries attend over (see the class docstring for their order and ``make_mask`` for the mask)."""
        L = keys.shape[2]
        self._grow(min(self.offset + L, self.max_size), _geometry(keys, values))
        k_stored, v_stored = self._encode(keys), self._encode(values)
        if L == 1:
            self._write(k_stored, v_stored)
            self.offset += 1
            n = self._n_filled()
            out = (self._decode(_take(self.keys, 0, n), keys.dtype),
                   self._decode(_take(self.values, 0, n), values.dtype))
        else:
            n = self._n_filled()
            k_parts = [self._decode(k_stored, keys.dtype)]
            v_parts = [self._decode(v_stored, values.dtype)]
            if n > 0:
                k_parts.insert(0, self._decode(_take(self.keys, 0, n), keys.dtype))
                v_parts.insert(0, self._decode(_take(self.values, 0, n), values.dtype))
            out = (mx.concatenate(k_parts, axis=2), mx.concatenate(v_parts, axis=2))
            self._write(k_stored, v_stored)
            self.offset += L
        self._after_update()
        return out


class _QuantizedStorage:
    """Quantized storage for ``KVCache``/``RotatingKVCache`` (mixed in before them): dense buffers
    while fewer than ``start`` positions are stored, quantized buffers after. Both pairs are kept across
    ``reset()``; ``keys``/``values`` are the pair of the current mode."""

    def _setup(self, bits: int, group_size: int, start: int) -> None:
        if bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"bits must be 2, 3, 4, 5, 6 or 8, got {bits}")
        if group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.bits, self.group_size, self.start = bits, group_size, start
        self._dense: list = [None, None]
        self._quant: list = [None, None]
        self.quantized = start == 0

    def _pair(self) -> list:
        return self._quant if self.quantized else self._dense

    @property
    def keys(self):
        return self._pair()[0]

    @keys.setter
    def keys(self, value):
        self._pair()[0] = tuple(value) if isinstance(value, list) else value

    @property
    def values(self):
        return self._pair()[1]

    @values.setter
    def values(self, value):
        self._pair()[1] = tuple(value) if isinstance(value, list) else value

    def _encode(self, x: mx.array):
        if not self.quantized:
            return x
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _decode(self, stored, dtype: mx.Dtype) -> mx.array:
        if not self.quantized:
            return stored
        out = mx.dequantize(*stored, group_size=self.group_size, bits=self.bits)
        return out if out.dtype == dtype else out.astype(dtype)

    def _zeros(self, B: int, H: int, n: int, dim: int, dtype: mx.Dtype):
        if not self.quantized:
            return mx.zeros((B, H, n, dim), dtype)
        return (mx.zeros((B, H, n, dim * self.bits // 32), mx.uint32),
                mx.zeros((B, H, n, dim // self.group_size), dtype),
                mx.zeros((B, H, n, dim // self.group_size), dtype))

    def buffer_geometry(self) -> tuple | None:
        if self._dense[0] is not None:
            return _geometry(*self._dense)
        if self._quant[0] is not None:
            (kp, ks, _), (vp, _, _) = self._quant
            return (*kp.shape[:2], kp.shape[3] * 32 // self.bits, vp.shape[3] * 32 // self.bits, ks.dtype)
        return None

    def _after_update(self) -> None:
        """Switch to quantized storage once ``offset >= start``: what is stored so far is quantized
        into the quantized buffers (same slots), later positions are stored quantized."""
        if self.quantized or self.offset < self.start:
            return
        n = self._n_stored()
        geometry = self.buffer_geometry()
        dense_k, dense_v = self._dense
        self.quantized = True
        if _n_slots(self.keys) < n:
            self._resize(_n_slots(dense_k), 0, geometry)
        _put(self.keys, 0, self._encode(_take(dense_k, 0, n)))
        _put(self.values, 0, self._encode(_take(dense_v, 0, n)))

    def reserve(self, n: int) -> None:
        """As ``KVCache.reserve``; before the switch to quantized storage the quantized buffers are
        grown too (and the dense ones to at most ``start`` slots, all that decoding can write into them)."""
        geometry = self.buffer_geometry()
        if geometry is None:
            return
        n = n if self.max_size is None else min(n, self.max_size)
        mode = self.quantized
        try:
            if not mode:
                self._grow(min(n, self.start), geometry)
                self.quantized = True
            self._grow(n, geometry)
        finally:
            self.quantized = mode

    def reset(self) -> None:
        """Forget the contents and return to the initial mode (dense if ``start > 0``); every buffer is
        kept for the next prompt."""
        self.offset = 0
        self.quantized = self.start == 0

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers, dense and quantized (capacity, not only the written part)."""
        return sum(_buf_nbytes(b) for b in (*self._dense, *self._quant))


class QuantizedKVCache(_QuantizedStorage, KVCache):
    """Full (unbounded) KV cache stored MLX-affine-quantized, as mlx-lm's ``QuantizedKVCache``
    (mlx_lm/models/cache.py) but returning dense keys and values, so model code is unchanged.

    Args:
        bits: bits per element (4 or 8 in job files; anything ``mx.quantize`` takes).
        group_size: elements sharing one scale and bias along head_dim (32, 64 or 128; must divide
            head_dim).
        start: positions stored dense before switching to quantized storage (mlx-lm's
            ``quantized_kv_start``). 0: quantized from the first position.

    ``update_and_fetch(keys, values)`` takes ``(B, n_kv_heads, L, head_dim)`` arrays, stores them as
    ``mx.quantize(x, group_size, bits)`` gives (uint32 ``packed`` with ``head_dim * bits / 32`` words
    per position, ``scales`` and ``biases`` with ``head_dim / group_size`` entries in the keys' dtype)
    and returns ``mx.dequantize`` of every stored position, ``(B, n_kv_heads, offset, head_dim)`` in the
    dtype of the incoming keys. A key therefore looks the same to the chunk that wrote it and to every
    later query (as in mlx-lm, whose attention runs on the stored triples).

    The switch at ``start`` follows mlx-lm's ``maybe_quantize_kv_cache`` (mlx_lm/generate.py), which runs
    after every model call and replaces a ``KVCache`` by its quantized copy once ``offset >=
    quantized_kv_start``: here the check runs at the end of each ``update_and_fetch`` (the layer's last
    cache operation of the model call) and quantizes the dense positions into the quantized buffers.
    A model call therefore runs dense throughout if it starts with ``offset < start``. The one
    difference: with ``start == 0`` mlx-lm still runs the first model call on a dense cache (there is no
    check before it); here storage is quantized from the first position.
    """

    def __init__(self, bits: int, group_size: int, start: int = 0):
        self._setup(bits, group_size, start)
        KVCache.__init__(self)


class RotatingQuantizedKVCache(_QuantizedStorage, RotatingKVCache):
    """``RotatingKVCache`` (exact ``max_size`` window, same ring layout, slots and masks) with storage
    quantized as in ``QuantizedKVCache`` (same ``bits``, ``group_size`` and ``start`` semantics; mlx-lm
    has no such cache).

    ``update_and_fetch`` returns dense keys and values in the incoming keys' dtype: the dequantized
    filled slots, and for ``L > 1`` new positions those followed by the quantize-dequantize round trip of
    the new keys (each position is quantized once, so it looks the same to every query).
    """

    def __init__(self, max_size: int, bits: int, group_size: int, start: int = 0):
        self._setup(bits, group_size, start)
        RotatingKVCache.__init__(self, max_size)


KV_BITS = (4, 8)


def _head_dim(model) -> int:
    """The model's attention head_dim: ``model.args.head_dim`` (every family has it; Qwen2 as a
    property), else ``hidden_size // num_attention_heads``."""
    args = model.args
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None:
        head_dim = args.hidden_size // args.num_attention_heads
    return int(head_dim)


def make_caches(model, spec=None) -> list:
    """One cache per layer: the model's own layout (``model.make_cache()``) adjusted by a cache spec.

    Args:
        model: a model from ``pipeline.models.build_model``.
        spec: a ``pipeline.jobspec.CacheSpec`` (``max_kv_size``, ``kv_bits``, ``kv_group_size``,
            ``quantized_kv_start``), or None for the model's layout unchanged.

    Rules:
        - ``max_kv_size``: full layers become ``RotatingKVCache(max_kv_size)``; sliding layers keep
          ``min(their window, max_kv_size)`` (a smaller window of the model's own is kept, as it is part
          of the architecture; a larger one is cut, as ``max_kv_size`` bounds every layer's memory).
          mlx-lm 0.32's ``make_prompt_cache(max_kv_size=...)`` instead makes every layer (of a model without
          its own ``make_cache``) ``RotatingKVCache(max_kv_size, keep=4)``: it also keeps the first 4 positions
          for good, where these windows are exactly the most recent positions.
        - ``kv_bits``: each layer becomes the quantized variant of its kind (``QuantizedKVCache`` /
          ``RotatingQuantizedKVCache``) with ``kv_group_size`` and ``start=quantized_kv_start``.

    Raises:
        CacheConfigError: ``kv_bits`` not 4 or 8, ``max_kv_size < 1``, or ``kv_group_size`` not dividing
            the model's head_dim (the message names both numbers).
    """
    caches = model.make_cache()
    if spec is None:
        return caches
    max_kv_size, bits = spec.max_kv_size, spec.kv_bits
    group_size, start = spec.kv_group_size, spec.quantized_kv_start
    if max_kv_size is not None and max_kv_size < 1:
        raise CacheConfigError(f"max_kv_size must be >= 1, got {max_kv_size}")
    if bits is not None:
        if bits not in KV_BITS:
            raise CacheConfigError(f"kv_bits must be 4 or 8, got {bits}")
        head_dim = _head_dim(model)
        if group_size not in (32, 64, 128) or head_dim % group_size != 0:
            raise CacheConfigError(
                f"cache.kv_group_size {group_size} does not divide the model's head_dim {head_dim} "
                f"(kv_group_size must be 32, 64 or 128 and divide head_dim)")
    out = []
    for c in caches:
        window = c.max_size
        if max_kv_size is not None:
            window = max_kv_size if window is None else min(window, max_kv_size)
        if bits is None:
            out.append(c if window == c.max_size else RotatingKVCache(window))
        elif window is None:
            out.append(QuantizedKVCache(bits, group_size, start))
        else:
            out.append(RotatingQuantizedKVCache(window, bits, group_size, start))
    return out
