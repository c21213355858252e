"""The compiled decode-closure set: one ``mx.compile``d single-token step per graph shape, reused for
every prompt of a job.

The step runs the unmodified model forward against *views* of the real caches (``DecodeView``), so the
compiled graph is the production op sequence by construction. Everything that changes per step enters
as an ``mx.array`` (the position, the sampler's random key and penalty state, the cache buffers), never as a Python int, so a
closure is traced once and replayed (MLX bakes Python scalars into the trace; mlx issue 3964). What
changes the traced graph — each layer's cache kind, capacity, window and quantization, and the
``SamplerKind`` — is the closure's key.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .sampler import SamplerKind, sample_step

log = logging.getLogger("pipeline")

CAPACITY_STEP = 256
_warned_cpu_compile = False


@functools.cache
def cpu_compile_blocker() -> str | None:
    """Why ``mx.compile`` cannot compile on the CPU in this process (None if it can, or if MLX's default
    device is not the CPU).

    MLX builds its fused CPU kernels by running ``g++`` from ``PATH``; where there is none (a fresh
    Debian/Ubuntu or slim container image has no C++ compiler), ``mx.compile`` hands back the function
    itself, which then re-runs its Python body on every call. Probed by counting the traces of a
    one-op function called twice (one op: nothing to fuse, so the probe itself never runs ``g++``).
    """
    if mx.default_device() != mx.cpu:
        return None
    traces = []

    def probe(x):
        traces.append(1)
        return x + 1

    step = mx.compile(probe)
    x = mx.zeros((2,), dtype=mx.float32)
    mx.eval(step(x), step(x))
    if len(traces) == 1:
        return None
    if shutil.which("g++") is None:
        return "MLX compiles its CPU kernels with g++ and there is none on PATH"
    return "mx.compile does not compile on the CPU in this process"


def warn_if_no_cpu_compile() -> None:
    """Log one warning per process when compiled decode cannot run on the CPU here: why, what it costs,
    the fix."""
    global _warned_cpu_compile
    reason = cpu_compile_blocker()
    if reason is None or _warned_cpu_compile:
        return
    _warned_cpu_compile = True
    log.warning("%s: decode runs eagerly (on a 2-core x86_64 CPU compiled decode ran 12.0 vs 10.0 tok/s "
                "eager, docs/BENCHMARKS.md); fix: install a C++ compiler (Debian/Ubuntu: apt-get install g++)",
                reason)


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


def decode_blocker(caches) -> str | None:
    """Why the compiled step cannot run from the caches' current state (None if it can)."""
    for i, c in enumerate(caches):
        if c.bits is not None and not c.quantized:
            return f"layer {i}: the KV cache is not yet quantized when decoding starts (quantized_kv_start)"
        if not hasattr(c, "reserve"):
            return f"layer {i}: cache {type(c).__name__} has no fixed-capacity layout"
    return None


class ClosureSet:
    """Compiled decode steps keyed by graph shape, shared by every generation of one engine.

    A step is ``step(token, pos, *consts, *state, *buffers)`` -> ``(next_token, pos + 1, *state,
    *logprobs, *buffers)`` with ``consts``, ``state`` and ``logprobs`` as in
    ``pipeline.sampler.sample_step``. ``trace_count`` counts traces (it grows only when a new key is
    met); ``broken`` holds keys whose compilation failed, with the reason, so they are not retried.
    """

    N_CONSTS, N_STATE = 9, 4

    def __init__(self, model):
        self.model = model
        self.closures: dict[tuple, Callable] = {}
        self.broken: dict[tuple, str] = {}
        self.trace_count = 0

    def get(self, kinds: tuple[LayerKind, ...], sampler: SamplerKind) -> Callable:
        key = (kinds, sampler)
        if key not in self.closures:
            self.closures[key] = mx.compile(self._make_step(kinds, sampler))
        return self.closures[key]

    def _make_step(self, kinds: tuple[LayerKind, ...], sampler: SamplerKind):
        model, nc, ns = self.model, self.N_CONSTS, self.N_STATE

        def step(token, pos, *args):
            self.trace_count += 1  # Python runs only while tracing
            consts, state, buffers = args[:nc], args[nc : nc + ns], args[nc + ns :]
            views = [DecodeView(kind, buffers[2 * i], buffers[2 * i + 1], pos) for i, kind in enumerate(kinds)]
            logits = model(token.reshape(1, 1), views)[:, -1, :]
            next_token, state, extras = sample_step(sampler, logits, consts, state)
            out = [next_token, pos + 1, *state, *extras]
            for view in views:
                out += [view.keys, view.values]
            return tuple(out)

        return step
