"""Continuous batching: up to ``batch_size`` requests decode together, one model forward per step.

Prefill. With ``prefill_batch`` (on by default on a GPU, where a short prompt's forward costs its
kernel launches, not its arithmetic), requests admitted together are prefilled together: prompts of
up to ``prefill_step_size`` tokens are padded (after the prompt) to a power-of-two bucket of at least
16 tokens, and each bucket runs as ONE forward of ``group_tokens // bucket`` rows (idle rows are
padding), so a prompt's arithmetic never depends on which prompts share its forward. Longer prompts,
quantized layers, and buckets longer than a rotating layer's window are prefilled alone (batch 1,
through the engine's own caches, chunked exactly as in sequential mode), as every prompt is on the
CPU, where prefill is bound by arithmetic and batching gains nothing. While slots are decoding, at
most one prefill forward runs between two decode steps, so admission stalls them for one chunk at
most, and it waits until enough slots are free to fill it (``admit_at``). Admission never waits for
the device: a new request's first token stays on it, fed to the next step and read back with that
step's tokens, so the host prefills while the device decodes. A prefilled request's keys and values are copied into its *slot*: row ``b`` of per-layer batch
buffers ``(B, n_kv_heads, capacity, head_dim)`` (quantized layers: the ``(packed, scales, biases)``
triples). Each decode step runs the unmodified model on the
``(B, 1)`` tokens of every slot against ``BatchView`` s of those buffers, with each slot's own
position (RoPE offset, write slot and attention mask come from a ``(B,)`` int32 position vector). A
request that ends (EOS, stop token, stop string, ``max_tokens``) leaves its slot at once and the next
request is prefilled into it, overwriting the slot (positions it has not written are zero).

Sampling is one batched call per step for every slot (``batch_sampler.SlotSampler``): each slot's
settings, random key and penalty state are per-row arrays written when a request takes the slot, and
a row's token and logprobs never depend on its neighbours (on the CPU they are bitwise what
``sampler.sample_step`` gives the request alone on that row); a batch of plain greedy requests takes
the step's argmax. The step shape (B slots, ``capacity`` positions) is fixed for a run, so the
arithmetic a request sees does not depend on which requests share the batch or how many of them are
active (idle slots run on zeros, at position 0 of their own buffers: a slot whose request ended keeps no position
that could reach past its buffers); it differs from batch-1 decoding in the last bits because
different matmul shapes run (docs/BENCHMARKS.md measures how often greedy completions differ).

The step is ``mx.compile``d per ``(layer kinds, B)`` (``engine.compile``; "auto" as in sequential
mode) with everything that changes per step passed as arrays.

On MLX's CUDA backend, for the families ``cuda.BatchedDecoder`` runs (Llama, Mistral, Qwen2 with fused
q/k/v projections) over dense layers (full or rotating), the step goes through it instead (``path``
"cuda-batched"): the model's own modules for the norms, projections and MLP, and per layer two custom
kernels, RoPE at each row's position with the new key/value written into the buffers in place, and the
attention over each row's filled slots only. The buffers come back unchanged (the same arrays); the
generic step (``path`` "generic") stays everywhere else, and on CUDA the reason is logged once.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..errors import JobSpecError, RowError
from ..models.base import output_logits
from .batch_sampler import SlotSampler, StepLogprobs
from .cache import KVCache, RotatingKVCache
from .cuda import BatchedDecoder, batched_blocker
from .params import Generation
from .prefix import block_hashes
from .request import Decoding, Request
from .sequential import Engine
from .structured import SlotMasks
from .views import (PREFILL_MIN_BUCKET, BatchView, layer_capacity, layer_kind, position_bytes, prefill_pad,
                    stored_slots)

# Padded tokens per group prefill forward (mlx-lm's default prefill_step_size). On the H200 a forward of
# 4 x 128 tokens (SmolLM2-135M) took 10 ms, of which the GPU was busy 1.9 ms: its cost is the host's
# launches, so more rows per forward admit more requests for the same cost (docs/BENCHMARKS.md).
PREFILL_TOKENS = 2048


class Group(NamedTuple):
    """How a request is prefilled together with others (``BatchEngine._bucket``): its tokens after the
    ``reused`` leading ones padded to ``size``; ``key``: the prefix store's key of its last reused full
    block (b"": none); ``part``: the key of the held block whose first ``reused % block_size`` positions it
    reuses after those (b"": none; ``PrefixStore.partial``). Requests of one forward reuse the same KV."""

    size: int
    reused: int = 0
    key: bytes = b""
    part: bytes = b""


def device_memory() -> int | None:
    """The device's memory in bytes as MLX reports it, or None where it reports none: ``mx.device_info()``'s
    ``memory_size`` (Metal) or ``total_memory`` (CUDA: MLX 0.32.4 gives no ``memory_size`` there)."""
    info = mx.device_info()
    return info.get("memory_size") or info.get("total_memory") or None


def memory_limit() -> tuple[int, str]:
    """``(bytes, what)``: memory a batched job may give its KV buffers: 90% of the device's memory
    (``device_memory()``; physical RAM where MLX reports none) minus what MLX holds now (the loaded
    weights)."""
    total = device_memory()
    what = "the GPU's memory" if total else "the machine's memory"
    total = total or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.9 * total) - int(mx.get_active_memory()), what


def check_kv_memory(engine: BatchEngine, max_kv_memory_gb: float | None) -> int:
    """Refuse a batch whose KV buffers do not fit; returns their size in bytes.

    Raises:
        JobSpecError: ``engine.kv_bytes()`` exceeds ``max_kv_memory_gb`` x 10**9 bytes, or
            ``memory_limit()``; the message gives the size, the per-slot size and the largest
            ``engine.batch_size`` that fits.
    """
    per_slot = engine.slot_bytes()
    need = engine.B * per_slot
    limits = [memory_limit()]
    if max_kv_memory_gb is not None:
        limits.append((int(max_kv_memory_gb * 1e9), f"engine.max_kv_memory_gb ({max_kv_memory_gb:g})"))
    for limit, what in limits:
        if need > limit:
            fits = max(limit // per_slot, 0)
            hint = f"use engine.batch_size <= {fits}" if fits >= 1 else "no batch of this capacity fits"
            raise JobSpecError(
                f"engine.batch_size {engine.B} needs {_size(need)} of KV cache ({engine.B} slots x "
                f"{_size(per_slot)} for up to {engine.max_positions} positions), more than {what} "
                f"({_size(max(limit, 0))}): {hint}, or lower generation.max_tokens / cache.max_kv_size")
    return need


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


class BatchEngine:
    """Continuous batching over an ``Engine`` (its model, tokenizer, EOS ids, cache layout and
    prefill); results are ``Generation`` s as ``Engine.generate`` returns them, plus the slot count.

    Args:
        engine: the sequential engine (its batch-1 caches are used for prefill).
        batch_size: slots B (>= 1).
        max_positions: prompt + generated tokens any request may need; sets the buffers' capacity
            (``views.layer_capacity``: a power-of-two bucket >= 256, at most a layer's window).
        prefill_batch: prefill requests admitted together in one forward per length bucket (module
            docstring); None: on when MLX's default device is a GPU.
        group_tokens: padded tokens of one group prefill forward: ``prefill_rows(size)`` is
            ``group_tokens // size`` rows.

    Attributes:
        prefill_counts: prefill forwards run so far, per padded length (None: a prompt prefilled alone).

    Memory: ``kv_bytes()`` = B x capacity x ``position_bytes`` summed over layers, allocated at the first
    request and kept for the run; a group prefill's caches hold ``group_tokens`` positions per
    bucket.
    """

    # True: a structured step's tokens are read by the masks' worker (``SlotMasks.start`` takes them on the device)
    # while the host launches the next forward; False: the host reads them first (to compare the two orders)
    worker_reads = True

    def __init__(self, engine: Engine, batch_size: int, max_positions: int, prefill_batch: bool | None = None,
                 group_tokens: int = PREFILL_TOKENS):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.engine = engine
        self.B = batch_size
        self.max_positions = max_positions
        self.prefill_batch = mx.default_device().type == mx.gpu if prefill_batch is None else bool(prefill_batch)
        self.group_tokens = group_tokens
        self._groups: dict[tuple[int, int], list] = {}
        self.prefill_counts: dict[int | None, int] = {}  # prefill forwards run, per padded length (None: alone)
        self.kinds = tuple(layer_kind(c, layer_capacity(c, max_positions)) for c in engine.cache)
        self.starts = tuple(getattr(c, "start", 0) if c.bits is not None else 0 for c in engine.cache)
        self.buffers: list | None = None
        self._closures: dict[tuple, object] = {}
        self.trace_count = 0
        self.cuda_step = True  # False: the generic step even where the CUDA one can run (to compare them)
        self._generic_why = batched_blocker(engine.model, self.kinds)
        self.decoder = BatchedDecoder(engine.model, self.kinds) if self._generic_why is None else None

    def slot_bytes(self) -> int:
        """Bytes of one slot's KV buffers (all layers, keys and values, ``capacity`` positions each).
        Runs a one-token forward first if the engine's caches have not run yet (their geometry is
        needed)."""
        if any(c.keys is None for c in self.engine.cache):
            self.engine.forward([0])
        return sum(k.capacity * position_bytes(c) for k, c in zip(self.kinds, self.engine.cache))

    def kv_bytes(self) -> int:
        """Bytes of the batch buffers: ``B x slot_bytes()``."""
        return self.B * self.slot_bytes()

    # -- the batched step ------------------------------------------------------------------------------

    @property
    def closure_count(self) -> int:
        """Compiled batched steps built (one per layer layout and B; 0 when decoding eagerly)."""
        return len(self._closures) if self.compiled else 0

    @property
    def compiled(self) -> bool:
        """Whether the batched step is ``mx.compile``d: the generic step as ``engine.compile`` says (its
        "auto" rule is the sequential one), the CUDA step unless ``engine.compile`` was asked to be False
        (compiled, it ran 20% faster than eager on the H200 with bitwise equal logits)."""
        if self.path == "cuda-batched":
            return self.engine.compile_setting is not False
        return bool(self.engine.compile)

    @property
    def path(self) -> str:
        """The decode step ``run`` uses: "cuda-batched" (``cuda.BatchedDecoder``) or "generic" (the model
        over ``BatchView`` s)."""
        return "cuda-batched" if self.decoder is not None and self.cuda_step else "generic"

    def _step_fn(self):
        if self.path == "cuda-batched":
            return self._cuda_step_fn()
        if mx.cuda.is_available():
            why = self._generic_why or "BatchEngine.cuda_step is off"
            self.engine.note(f"batched decode through the generic step: {why}", kind="batched-step")
        key = (self.kinds, self.starts, self.B, self.compiled)
        if key not in self._closures:
            model, kinds, starts = self.engine.model, self.kinds, self.starts

            def step(tokens, pos, active, *buffers):
                self.trace_count += self.compiled
                pos = pos * active  # an idle slot writes at position 0 of its own buffers
                masks: dict = {}
                views = [BatchView(k, buffers[2 * i], buffers[2 * i + 1], pos, start, masks)
                         for i, (k, start) in enumerate(zip(kinds, starts))]
                logits = model(tokens.reshape(-1, 1), views)[:, -1, :].astype(mx.float32)
                out = [logits, mx.argmax(logits, axis=-1).astype(mx.uint32), pos + active]
                for v in views:
                    out += [v.keys, v.values]
                return tuple(out)

            self._closures[key] = mx.compile(step) if self.compiled else step
        return self._closures[key]

    def _allocate(self, caches) -> None:
        """Zero batch buffers shaped after ``caches`` (the batch-1 or group caches a prefill just used)."""
        bufs = []
        for kind, start, c in zip(self.kinds, self.starts, caches):
            _, H, k_dim, v_dim, dtype = c.buffer_geometry()
            for dim in (k_dim, v_dim):
                shape = (self.B, H, kind.capacity)
                if kind.quantized:
                    n_groups = dim // kind.group_size
                    quant = (mx.zeros((*shape, dim * kind.bits // 32), mx.uint32),
                             mx.zeros((*shape, n_groups), dtype), mx.zeros((*shape, n_groups), dtype))
                    bufs.append(((mx.zeros((*shape, dim), dtype),) if start else ()) + quant)
                else:
                    bufs.append(mx.zeros((*shape, dim), dtype))
        if self.path == "cuda-batched":  # its kernels write into these arrays: materialized, row-contiguous
            mx.eval(bufs)
        self.buffers = bufs

    def _cuda_step_fn(self):
        """``step(tokens, pos, active, *buffers)`` through ``cuda.BatchedDecoder``: returns ``(logits,
        greedy, pos + active, *buffers)`` like the generic step, the buffers the same arrays (written in
        place). The attention grid covers each layer's capacity (no host bound is known per step); a row
        works only on its own filled slots. ``mx.compile``d with ``engine.compile`` (the same arithmetic:
        on the H200 compiled and eager logits were bitwise equal, the step 20% faster because MLX replays
        the traced graph instead of building it in Python)."""
        key = ("cuda-batched", self.kinds, self.B, self.compiled)
        if key not in self._closures:
            dec = self.decoder
            dec.prepare(self.B)  # its scratch arrays exist before a trace captures them

            def step(tokens, pos, active, *buffers):
                self.trace_count += self.compiled
                pos = pos * active  # as in the generic step
                logits = dec.step(tokens, pos, None, buffers).astype(mx.float32)
                return (logits, mx.argmax(logits, axis=-1).astype(mx.uint32), pos + active, *buffers)

            self._closures[key] = mx.compile(step) if self.compiled else step
        return self._closures[key]

    def _load_slot(self, b: int) -> None:
        """Copy the batch-1 caches (just prefilled) into slot ``b``; the rest of the slot becomes zeros."""
        for i, (kind, start, c) in enumerate(zip(self.kinds, self.starts, self.engine.cache)):
            n = stored_slots(c)
            for j, src in enumerate((c.keys, c.values)):
                dst = self.buffers[2 * i + j]
                if not kind.quantized:
                    parts = [src]
                elif c.quantized:  # the prompt reached quantized_kv_start: the dense copies are never read
                    parts = [*src]
                    if start:
                        parts.insert(0, mx.zeros((1, dst[0].shape[1], n, dst[0].shape[3]), dst[0].dtype))
                else:  # still dense after prefill: its quantized copy is what the switch would store
                    parts = [*mx.quantize(src[..., :n, :], group_size=kind.group_size, bits=kind.bits)]
                    if start:
                        parts.insert(0, src)
                dsts = dst if isinstance(dst, tuple) else (dst,)
                new = []
                for d, part in zip(dsts, parts):
                    part = part[..., :n, :]
                    pad = mx.zeros((1, part.shape[1], kind.capacity - n, part.shape[3]), part.dtype)
                    d[b : b + 1] = mx.concatenate([part, pad], axis=2) if kind.capacity > n else part
                    new.append(d)
                self.buffers[2 * i + j] = tuple(new) if isinstance(dst, tuple) else new[0]

    def _load_group(self, slots: list[int], caches, rows: list[int], lengths: list[int]) -> list[mx.array]:
        """Copy rows ``rows`` of group caches (dense, ``size`` slots per row, ``lengths`` real positions
        each) into batch slots ``slots``; a slot's positions after its prompt become zeros. Returns what to
        evaluate for the copy besides ``self.buffers``: on the CUDA step one ``BatchedDecoder.load_slots``
        launch per layer writes the buffers in place (its ``done`` arrays are returned); elsewhere one
        scatter per buffer replaces it (nothing returned)."""
        take = mx.array(rows, dtype=mx.int32)
        at = mx.array(slots, dtype=mx.int32)
        if self.path == "cuda-batched":
            n = mx.array(lengths, dtype=mx.int32)
            return [self.decoder.load_slots(i, c.keys, c.values, take, at, n, self.buffers[2 * i], self.buffers[2 * i + 1])
                    for i, c in enumerate(caches)]
        for i, (kind, c) in enumerate(zip(self.kinds, caches)):
            size = c.keys.shape[2]
            real = (mx.arange(size)[None, :] < mx.array(lengths)[:, None])[:, None, :, None]
            for j, src in enumerate((c.keys, c.values)):
                part = mx.where(real, src[take], mx.zeros((), src.dtype))
                if size > kind.capacity:  # reused + the padded rest past the capacity: only padding (a prompt fits)
                    part = part[:, :, : kind.capacity]
                elif kind.capacity > size:
                    pad = mx.zeros((len(rows), part.shape[1], kind.capacity - size, part.shape[3]), part.dtype)
                    part = mx.concatenate([part, pad], axis=2)
                dst = self.buffers[2 * i + j]
                dst[at] = part
                self.buffers[2 * i + j] = dst
        return []

    # -- requests --------------------------------------------------------------------------------------

    # -- prefill -------------------------------------------------------------------------------------

    def prefill_bucket(self, n: int) -> int | None:
        """The padded length a prompt of ``n`` tokens is prefilled at together with others, or None when
        it is prefilled alone (``prefill_batch`` off, more than ``prefill_step_size`` tokens, a quantized
        layer, or a padded prompt longer than a rotating layer's window)."""
        step = self.engine.prefill_step_size
        if not self.prefill_batch or n > step or any(k.quantized for k in self.kinds):
            return None
        size = min(prefill_pad(n), step)
        return None if any(c.max_size is not None and size > c.max_size for c in self.engine.cache) else size

    def _bucket(self, d: Decoding) -> Group | None:
        """The group prefill a request joins, or None (prefilled alone, ``Engine.prefill_prompt``).

        Without prefix reuse: its prompt padded to ``prefill_bucket``. With it (prefix caching on and not
        ``Engine.exact_prefix``, no rotating layer): the part after what it reuses padded to that part's
        bucket, grouped with requests reusing the same KV (loaded once for the whole forward). It reuses
        its held leading blocks, then the longest run of its next ids that a held block after them begins
        with (``PrefixStore.partial``; never its last token). Where the engine's caches hold this very
        prompt (the previous sample of a row), alone: it reuses all."""
        eng = self.engine
        keys = self._keys(d) if eng.prefix is not None else None
        reused = eng.reusable(d.prompt_ids, keys)
        if reused == d.n_prompt and reused:
            return None
        part = b""
        if eng.prefix is not None and not eng.exact_prefix and eng._window is None and reused < d.n_prompt - 1:
            h = reused // eng.block_size
            part, m = eng.prefix.partial(keys[h - 1] if h else b"", d.prompt_ids[reused : d.n_prompt - 1])
            reused += m
        if not reused:
            size = self.prefill_bucket(d.n_prompt)
            return None if size is None else Group(size)
        if eng.exact_prefix or eng._window is not None:
            return None
        size = self.prefill_bucket(d.n_prompt - reused)
        h = reused // eng.block_size
        return None if size is None else Group(size, reused, keys[h - 1] if h else b"", part)

    def _joins(self, d: Decoding, g: Group) -> bool:
        """Whether request ``d`` can be prefilled in group ``g``'s forward: its own ``_bucket``, or (``g``
        reusing KV) it begins with what ``g`` reuses (the same leading blocks, then as many ids of ``g``'s
        partial block) and the rest fits ``g.size``. A request that could reuse a few more tokens recomputes
        them rather than wait for a forward of its own."""
        mine = self._bucket(d)
        if mine == g:
            return True
        if mine is None or not mine.reused or not g.reused or d.n_prompt <= g.reused:
            return False
        bs = self.engine.block_size
        h, m = divmod(g.reused, bs)
        keys = self._keys(d)
        if h and (len(keys) < h or keys[h - 1] != g.key):
            return False
        if m and self.engine.prefix.common(g.part, d.prompt_ids[h * bs : d.n_prompt - 1]) < m:
            return False
        return self.prefill_bucket(d.n_prompt - g.reused) == g.size

    def _keys(self, d: Decoding) -> list[bytes]:
        """``prefix.block_hashes`` of a request's prompt (computed once per request)."""
        if d.block_keys is None:
            d.block_keys = block_hashes(d.prompt_ids, self.engine.block_size)
        return d.block_keys

    def prefill_rows(self, size: int) -> int:
        """Rows of every group prefill at padded length ``size``: ``group_tokens // size`` (fixed, so a
        prompt's arithmetic never depends on how many others share its forward)."""
        return max(1, self.group_tokens // size)

    def admit_at(self, size: int | None) -> int:
        """Free slots a prefill forward at padded length ``size`` (None: a prompt alone) waits for while
        other slots decode: enough to fill it (``prefill_rows``), at most an eighth of the slots, so on
        average a sixteenth of the slots idles while a forward costs the same host time at any fill."""
        return 1 if size is None else min(self.prefill_rows(size), max(1, self.B // 8))

    def warm_up_lengths(self) -> list[int]:
        """One prompt length per group-prefill shape a job can meet (every bucket up to
        ``prefill_step_size`` that leaves room for a few new tokens in ``max_positions``), for a warm-up
        that compiles them all; ``[8]`` when no prompt is prefilled in a group."""
        step, fits = self.engine.prefill_step_size, self.max_positions - 4
        sizes, n = {step}, PREFILL_MIN_BUCKET
        while n < step:
            sizes.add(n)
            n *= 2
        out = sorted(n for n in sizes if n <= fits and self.prefill_bucket(n) == n)
        return out or [max(1, min(8, fits))]

    def _group_caches(self, rows: int, size: int) -> list:
        """Dense caches of ``size`` slots for ``rows`` rows, for a group prefill (one set per shape, reused)."""
        caches = self._groups.get((rows, size))
        if caches is None:
            caches = [KVCache() if c.max_size is None else RotatingKVCache(c.max_size) for c in self.engine.cache]
            for c in caches:
                c.step = size  # room for exactly the padded prompt
            self._groups[rows, size] = caches
        for c in caches:
            c.reset()
        return caches

    def _load_reused(self, group: list[Decoding], g: Group, n_rows: int) -> list:
        """Group caches of ``g.reused + g.size`` slots per row holding the KV every request of ``group``
        reuses (its blocks taken from the prefix store once, then the first positions of ``g.part``, the same
        in every row); their ``offset`` is ``g.reused``."""
        eng = self.engine
        h, m = divmod(g.reused, eng.block_size)
        caches = self._group_caches(n_rows, g.reused + g.size)
        blocks = eng.prefix.take(self._keys(group[0])[:h]) + ([eng.prefix.take_part(g.part, m)] if m else [])
        for i, c in enumerate(caches):
            k, v = (mx.concatenate([b[i][j] for b in blocks], axis=2) for j in (0, 1))
            c.load_prefix(mx.broadcast_to(k, (n_rows, *k.shape[1:])), mx.broadcast_to(v, (n_rows, *v.shape[1:])))
        return caches

    def _row_key(self, d: Decoding):
        """What a request's row in a group forward is for: with prefix caching on its prompt (the samples of a
        row share one, so it is prefilled once), else the request itself."""
        return tuple(d.prompt_ids) if self.engine.block_size is not None else id(d)

    def _rows_of(self, group: list[Decoding]) -> list[int]:
        """Each request's row in its group forward (rows in order of first use, one per ``_row_key``)."""
        first: dict = {}
        return [first.setdefault(self._row_key(d), len(first)) for d in group]

    def _store_blocks(self, group: list[Decoding], g: Group, caches) -> None:
        """Hold the full blocks each request of ``group`` (one per row of the group caches, in row order)
        completed after its ``g.reused`` reused tokens in the prefix store, with their ids (``partial`` can
        find them): one copy per layer of the group's positions from the block holding the first computed
        one, each block a view of it (``PrefixStore.put_range``)."""
        bs = self.engine.block_size
        A = g.reused // bs * bs  # the first block not reused whole
        ends = [d.n_prompt // bs * bs for d in group]
        span = max(ends) - A
        if span <= 0:
            return
        copies = [(mx.contiguous(c.keys[: len(group), :, A : A + span, :]),
                   mx.contiguous(c.values[: len(group), :, A : A + span, :])) for c in caches]
        for r, (d, end) in enumerate(zip(group, ends)):
            if end > A:
                keys = self._keys(d)
                self.engine.prefix.put_range(keys[A // bs : end // bs], copies, row=r,
                                             parent=keys[A // bs - 1] if A else b"", ids=d.prompt_ids[A:end])
        mx.async_eval(copies)  # now, so the next write into the group caches finds no reader of the old buffer

    def _prefill(self, group: list[Decoding], g: Group | None) -> tuple[list, list, list[int]]:
        """Prefill ``group`` (one request when ``g`` is None, else requests taking up to ``prefill_rows(g.size)``
        rows (``_rows_of``), each row's tokens after its ``g.reused`` reused ones padded to ``g.size``, in ONE
        forward of ``prefill_rows(g.size)`` rows) and sample each request's first token. Returns ``(firsts,
        caches, rows)``: ``(token (1,) uint32, logprob arrays)`` per request, lazy (nothing waits for the
        device), the caches holding their keys and values (the reused positions first), and each request's
        row in them.

        Padding goes after a prompt, so under the causal mask no real position sees it; the keys and values
        it leaves after the prompt are never copied into a slot."""
        eng = self.engine
        t0 = time.perf_counter()
        for d in group:  # ttft_s / total_s of its own: not the time it waited for a slot or for others' prefills
            d.t0 = t0
        if g is None:
            d = group[0]
            logits, d.cached = eng.prefill_prompt(d.prompt_ids)
            caches, rows = eng.cache, [0]
        else:
            size, P = g.size, g.reused
            n_rows = self.prefill_rows(size)
            rows = self._rows_of(group)
            computed: list[Decoding] = []  # the request each row computes, in row order
            tokens = np.zeros((n_rows, size), dtype=np.uint32)
            for d, r in zip(group, rows):
                if r < len(computed):  # another sample of a prompt this forward computes: all of it reused
                    d.cached = d.n_prompt
                    continue
                computed.append(d)
                tokens[r, : d.n_prompt - P] = d.prompt_ids[P:]
                d.cached = P
            caches = self._load_reused(group, g, n_rows) if P else self._group_caches(n_rows, size)
            h = eng.model.model(mx.array(tokens), caches)
            last = mx.array([d.n_prompt - 1 - P for d in computed] + [0] * (n_rows - len(computed)), dtype=mx.int32)
            logits = output_logits(eng.model, mx.take_along_axis(h, last[:, None, None], axis=1), False)[:, 0, :]
            eng.prefill_tokens += sum(d.n_prompt - P for d in computed)
            if eng.prefix is not None and not eng.exact_prefix:  # exact: only one-block chunks are stored
                self._store_blocks(computed, g, caches)
        return [d.begin(logits[r : r + 1]) for d, r in zip(group, rows)], caches, rows

    def _finish(self, d: Decoding, done: tuple) -> Generation:
        return d.finish(done, compiled=self.compiled)

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[object, Generation | RowError]]:
        """Generate every request; yields ``(tag, Generation)`` as each finishes (not in request order),
        or ``(tag, RowError)`` for a request that cannot run (empty prompt, too long, ...).

        Requests are pulled from ``requests`` only when a slot is free, so a caller can stop feeding
        (e.g. on SIGINT) and the requests in flight still finish.

        Raises:
            Exception: whatever a prefill or step raises that is not a request's own problem (a bug, a model
                error); raised by a prefill, it carries ``request_tags``: the tags of the requests being
                prefilled, then of those decoding.
        """
        source = iter(requests)
        slots: list[Decoding | None] = [None] * self.B
        exhausted = False
        mx.reset_peak_memory()

        pending: list[Decoding] = []  # checked requests waiting for their prefill (at most one per free slot)

        def admit(out: list, decoding: bool) -> dict[int, tuple]:
            """Prefill requests into the free slots; returns ``{slot: (first token (1,) uint32, its logprob
            arrays)}`` for the slots that got one, lazy: nothing here waits for the device. While other
            slots are ``decoding``, at most one prefill forward runs (they wait for no more than one chunk),
            and only once ``admit_at`` slots are free (or every request left fits)."""
            nonlocal exhausted
            seated: dict[int, tuple] = {}
            forwards = 0
            while True:
                free = [b for b in range(self.B) if slots[b] is None]
                while len(pending) < len(free) and not exhausted:
                    req = next(source, None)
                    if req is None:
                        exhausted = True
                        break
                    try:
                        pending.append(Decoding(self.engine, req.prompt_ids, req.params, capacity=self.max_positions,
                                                tag=req.tag))
                    except RowError as e:
                        out.append((req.tag, e))
                if not pending or not free or (decoding and forwards):
                    return seated
                g = self._bucket(pending[0])
                size = None if g is None else g.size
                if decoding and len(free) < self.admit_at(size) and not (exhausted and len(pending) <= len(free)):
                    return seated  # wait for slots enough to fill a forward (its cost is per forward)
                group = [pending.pop(0)]
                if g is not None:
                    rows = {self._row_key(group[0])}  # the forward's rows taken (``_rows_of``)
                    for d in list(pending):
                        if len(group) == len(free):
                            break
                        key = self._row_key(d)
                        if (key in rows or len(rows) < self.prefill_rows(size)) and self._joins(d, g):
                            group.append(d)
                            pending.remove(d)
                            rows.add(key)
                try:
                    firsts, caches, rows = self._prefill(group, g)
                except Exception as e:  # a bug or a model error: name the rows it hit first, then those decoding
                    e.request_tags = [d.tag for d in group] + [s.tag for s in slots if s is not None]
                    raise
                forwards += 1
                self.prefill_counts[size] = self.prefill_counts.get(size, 0) + 1
                at = free[: len(group)]
                if self.buffers is None:
                    self._allocate(caches)
                done = []
                if size is None:
                    self._load_slot(at[0])
                else:
                    done = self._load_group(at, caches, rows, [d.n_prompt for d in group])
                for b, d, first in zip(at, group, firsts):
                    slots[b] = d
                    seated[b] = first
                # queued now, before any later step reads the slots; and the first fill's graph stays small
                mx.async_eval(*self.buffers, *done, *[y for y, _ in firsts])

        def entering(seated: dict[int, tuple], ahead):
            """``ahead`` (a launched step's lazy ``(tokens, positions, extras)``, or None) with the slots in
            ``seated`` taking their first token and prompt length instead: what the next read pushes and
            the next step is fed."""
            at = mx.array(list(seated), dtype=mx.int32)
            toks = mx.zeros((self.B,), dtype=mx.uint32)
            toks[at] = mx.concatenate([y.astype(mx.uint32) for y, _ in seated.values()])
            where = np.zeros((self.B,), dtype=np.int32)
            where[list(seated)] = [slots[b].n_prompt for b in seated]
            if ahead is None:
                return toks, mx.array(where), StepLogprobs()
            m = np.zeros((self.B,), dtype=bool)
            m[list(seated)] = True
            m = mx.array(m)
            return mx.where(m, toks, ahead[0]), mx.where(m, mx.array(where), ahead[1]), ahead[2]

        def activity():
            return mx.array([s is not None for s in slots], dtype=mx.int32)

        out: list = []
        firsts = admit(out, decoding=False)  # slot -> its first token's logprob arrays, until pushed
        yield from out
        step = self._step_fn()
        sampling = SlotSampler(self.B)  # every slot's sampling settings and state, for this run
        masks = SlotMasks(self.B)  # the structured-output masks of the constrained slots

        def forward(tokens: mx.array, pos: mx.array, active: mx.array):
            """Queue one decode step's forward for every slot; returns its lazy ``(logits, argmax, positions)``."""
            logits, greedy, pos, *bufs = step(tokens, pos, active, *self.buffers)
            self.buffers = bufs
            return logits, greedy, pos

        def sample(fwd, at=None, allowed=None):
            """Queue the sampling of a forward's logits (one batched call for every slot; ``at``: the slots as
            the step saw them, default ``slots``; ``allowed``: the constrained slots' masks, default computed
            now from their tokens so far); returns the lazy ``(tokens, positions, extras)``."""
            logits, greedy, pos = fwd
            at = slots if at is None else at
            if allowed is None:
                allowed = masks.allowed(at, logits.shape[-1])
            nxt, extras = sampling.step(at, logits, greedy, allowed)
            mx.async_eval(nxt, pos, *self.buffers, *sampling.arrays(), *extras.arrays)
            return nxt, pos, extras

        # ``current``: each live slot's next token to record (a step's output, or a new request's first
        # token) and the position it is fed at; its ids are read only after the next step is queued, so
        # the host records tokens, checks stops and prefills new requests while the device computes.
        active = activity()
        current = entering(firsts, None) if firsts else None
        firsts = {b: extras for b, (_, extras) in firsts.items()}
        try:
            while current is not None:
                # Queue step t + 1 before reading step t's tokens; skipped when every slot ends at step t anyway.
                # With a constrained slot the order differs: step t + 1's sampling needs the masks made from
                # step t's tokens, so those tokens go to llguidance on a worker thread (``SlotMasks.start``: a
                # copy queued for it, read there when the device has it), started once step t + 1's forward is
                # built (the worker's Python would hold up that build), then only the forward is queued: the
                # masks are computed while the host launches it (the launch of a step's kernels is most of its
                # host time, with the GIL released) and records every slot's token; the
                # masked sampling is queued as soon as the masks are in, then the host takes the grammar
                # verdicts (``Decoding.settle``) and admits new requests while the device samples.
                ahead, deferred, toks = None, False, None
                if any(s is not None and len(s.tokens) + 1 < s.max_tokens for s in slots):
                    deferred = any(s is not None and s.constraint is not None for s in slots)
                    if deferred:
                        at = list(slots)  # the slots as step t + 1 sees them
                        if self.worker_reads:  # the worker's own array, queued before the forward
                            given = current[0].astype(mx.int32)
                            mx.async_eval(given)
                        else:
                            given = toks = current[0].tolist()
                    ahead = forward(current[0], current[1], active)
                    if deferred:
                        masks.start(at, given)
                        mx.async_eval(ahead, *self.buffers)
                    else:
                        ahead = sample(ahead)
                if toks is None:
                    toks = current[0].tolist()
                out, later = [], []

                def end(b: int, step) -> None:
                    """Slot ``b``'s verdict on its token (``step()``: its ``push`` or ``settle``): a finished request
                    leaves its slot."""
                    s = slots[b]
                    try:
                        done = step()
                    except RowError as e:  # its grammar rejected the token
                        done = e
                    if done:
                        out.append((s.tag, done if isinstance(done, RowError) else self._finish(s, done)))
                        slots[b] = None

                for b, s in enumerate(slots):
                    if s is None:
                        continue
                    extras = firsts[b] if b in firsts else current[2].get(b, ())
                    if deferred and s.constraint is not None:
                        later.append((b, s.record(toks[b], extras)))
                        continue
                    end(b, functools.partial(s.push, toks[b], extras))
                if deferred:  # step t + 1's sampling, for the slots still held by the requests it computed
                    at = [d if d is not None and slots[b] is d else None for b, d in enumerate(at)]
                    ahead = sample(ahead, at, masks.wait(ahead[0].shape[-1]))
                    for b, recorded in later:
                        if recorded is None and slots[b].constraint.continues(toks[b]):
                            continue  # the grammar accepted the token, the value goes on: nothing to settle
                        end(b, functools.partial(slots[b].settle, toks[b], recorded))
                changed = bool(out)  # a request ended: its slot is free
                seated = {}
                if None in slots and (pending or not exhausted):
                    # a new request's prefill overwrites its slot, step t + 1's write included
                    seated = admit(out, decoding=any(s is not None for s in slots))
                if changed or seated:
                    active = activity()
                current = entering(seated, ahead) if seated else ahead
                firsts = {b: extras for b, (_, extras) in seated.items()}
                yield from out
        finally:  # also when the caller stops early or a step raises: the worker ends, the interval is restored
            masks.close()
