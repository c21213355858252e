"""Continuous batching: up to ``batch_size`` requests decode together, one model forward per step.

A request is prefilled alone (batch 1, through the engine's own caches, so every cache kind and
chunked prefill work exactly as in sequential mode), then its keys and values are copied into its
*slot*: row ``b`` of per-layer batch buffers ``(B, n_kv_heads, capacity, head_dim)`` (quantized
layers: the ``(packed, scales, biases)`` triples). Each decode step runs the unmodified model on the
``(B, 1)`` tokens of every slot against ``BatchView`` s of those buffers, with each slot's own
position (RoPE offset, write slot and attention mask come from a ``(B,)`` int32 position vector). A
request that ends (EOS, stop token, stop string, ``max_tokens``) leaves its slot at once and the next
request is prefilled into it, overwriting the slot (positions it has not written are zero).

Sampling is per request: greedy requests without penalties, suppression or logprobs take the
argmax of their row of the batched logits; every other request runs ``sampler.sample_step`` on its
own row with its own constants and random key, so the token a request samples never depends on its
neighbours' random draws. The step shape (B slots, ``capacity`` positions) is fixed for a run, so the
arithmetic a request sees does not depend on which requests share the batch or how many of them are
active (idle slots run on zeros); it differs from batch-1 decoding in the last bits because
different matmul shapes run (docs/BENCHMARKS.md measures how often greedy completions differ).

The step is ``mx.compile``d per ``(layer kinds, B)`` (``engine.compile``; "auto" as in sequential
mode) with everything that changes per step passed as arrays.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import mlx.core as mx

from ..errors import JobSpecError, RowError
from .params import Generation
from .request import Decoding, Request
from .sampler import SamplerKind, sample_step
from .sequential import Engine
from .views import BatchView, stored_slots, layer_capacity, layer_kind, position_bytes


def _is_plain_greedy(kind: SamplerKind) -> bool:
    return kind.greedy and not kind.penalties and not kind.suppress and kind.logprobs is None


def memory_limit() -> tuple[int, str]:
    """``(bytes, what)``: memory a batched job may give its KV buffers: 90% of the device's memory
    (``mx.device_info()["memory_size"]`` on a GPU; physical RAM on the CPU) minus what MLX holds now
    (the loaded weights)."""
    info = mx.device_info()
    total = info.get("memory_size") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = "the GPU's memory" if "memory_size" in info else "the machine's memory"
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

    Memory: ``kv_bytes()`` = B x capacity x ``position_bytes`` summed over layers, allocated at the first
    request and kept for the run.
    """

    def __init__(self, engine: Engine, batch_size: int, max_positions: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.engine = engine
        self.B = batch_size
        self.max_positions = max_positions
        self.kinds = tuple(layer_kind(c, layer_capacity(c, max_positions)) for c in engine.cache)
        self.starts = tuple(getattr(c, "start", 0) if c.bits is not None else 0 for c in engine.cache)
        self.buffers: list | None = None
        self._closures: dict[tuple, object] = {}
        self.trace_count = 0

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
        return bool(self.engine.compile)

    def _step_fn(self):
        key = (self.kinds, self.starts, self.B, self.compiled)
        if key not in self._closures:
            model, kinds, starts = self.engine.model, self.kinds, self.starts

            def step(tokens, pos, active, *buffers):
                self.trace_count += self.compiled
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

    def _allocate(self) -> None:
        """Zero batch buffers shaped after the (already used) batch-1 caches."""
        bufs = []
        for kind, start, c in zip(self.kinds, self.starts, self.engine.cache):
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
        self.buffers = bufs

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

    # -- requests --------------------------------------------------------------------------------------

    def _admit(self, req: Request) -> Decoding | Generation:
        """Prefill ``req`` and sample its first token; a ``Generation`` if it already finished.

        Raises:
            RowError: the request cannot run (``Decoding``'s checks, or more positions than the batch's).
        """
        eng = self.engine
        d = Decoding(eng, req.prompt_ids, req.params, capacity=self.max_positions, tag=req.tag)
        eng.reset()
        y, extras = d.begin(eng.prefill(mx.array(req.prompt_ids, dtype=mx.uint32)))
        mx.eval(y, *extras, *d.state)
        done = d.push(y.item(), extras)
        return self._finish(d, done) if done else d

    def _finish(self, d: Decoding, done: tuple) -> Generation:
        return d.finish(done, compiled=self.compiled)

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[object, Generation | RowError]]:
        """Generate every request; yields ``(tag, Generation)`` as each finishes (not in request order),
        or ``(tag, RowError)`` for a request that cannot run (empty prompt, too long, ...).

        Requests are pulled from ``requests`` only when a slot is free, so a caller can stop feeding
        (e.g. on SIGINT) and the requests in flight still finish.
        """
        source = iter(requests)
        slots: list[Decoding | None] = [None] * self.B
        exhausted = False
        mx.reset_peak_memory()

        def fill(b: int, pending_out: list) -> Decoding | None:
            """Admit requests into slot ``b`` until one needs decoding (or the source runs out)."""
            nonlocal exhausted
            while not exhausted:
                req = next(source, None)
                if req is None:
                    exhausted = True
                    return None
                try:
                    got = self._admit(req)
                except RowError as e:
                    pending_out.append((req.tag, e))
                    continue
                if isinstance(got, Generation):
                    pending_out.append((req.tag, got))
                    continue
                if self.buffers is None:
                    self._allocate()
                self._load_slot(b)
                return got
            return None

        out: list = []
        for b in range(self.B):
            slots[b] = fill(b, out)
        yield from out
        step = self._step_fn()

        def launch(tokens: mx.array, pos: mx.array, active: mx.array):
            """Queue one decode step for every slot; returns its lazy ``(tokens, positions, extras)``."""
            logits, greedy, pos, *bufs = step(tokens, pos, active, *self.buffers)
            self.buffers = bufs
            per_slot, extras = {}, {}
            for b, s in enumerate(slots):
                if s is not None and not _is_plain_greedy(s.kind):
                    per_slot[b], s.state, extras[b] = sample_step(s.kind, logits[b : b + 1], s.consts, s.state)
            nxt = greedy
            if per_slot:
                picked = mx.concatenate([per_slot[b] if b in per_slot else mx.zeros((1,), mx.uint32)
                                         for b in range(self.B)])
                nxt = mx.where(mx.array([b in per_slot for b in range(self.B)]), picked, greedy)
            states = [x for b in per_slot for x in slots[b].state]
            mx.async_eval(nxt, pos, *self.buffers, *states, *(x for e in extras.values() for x in e))
            return nxt, pos, extras

        def host_vectors():
            """Tokens, positions and activity of every slot from the host's view (idle slots: 0)."""
            return (mx.array([s.tokens[-1] if s else 0 for s in slots], dtype=mx.uint32),
                    mx.array([s.n_prompt + len(s.tokens) - 1 if s else 0 for s in slots], dtype=mx.int32),
                    mx.array([s is not None for s in slots], dtype=mx.int32))

        tokens, pos, active = host_vectors()
        current = launch(tokens, pos, active) if any(slots) else None
        skip: set[int] = set()  # slots whose entry in ``current`` is their first token, already recorded
        while current is not None:
            # Queue step t + 1 before reading step t's tokens, so the host works while the device computes;
            # skipped when every slot ends at step t anyway.
            ahead = None
            if any(s is not None and (b in skip or len(s.tokens) + 1 < s.max_tokens) for b, s in enumerate(slots)):
                ahead = launch(current[0], current[1], active)
            toks = current[0].tolist()
            out, fresh = [], set()
            for b, s in enumerate(slots):
                if s is None or b in skip:
                    continue
                done = s.push(toks[b], current[2].get(b, ()))
                if done:
                    out.append((s.tag, self._finish(s, done)))
                    slots[b] = fill(b, out)  # a new request's prefill overwrites the slot, step t + 1's write included
                    fresh.add(b)
            skip = set()
            if fresh:
                host_tokens, host_pos, active = host_vectors()
                if ahead is None:  # every slot ended at step t: start again from the host's view
                    ahead = launch(host_tokens, host_pos, active) if any(slots) else None
                else:  # the slots that changed hands take their first token and position from the host
                    m = mx.array([b in fresh for b in range(self.B)])
                    ahead = (mx.where(m, host_tokens, ahead[0]), mx.where(m, host_pos, ahead[1]), ahead[2])
                    skip = {b for b in fresh if slots[b] is not None}
            current = ahead
            yield from out
