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

import mlx.core as mx

from .sampler import SamplerConsts, SamplerKind, SamplerState, sample_step
from .views import DecodeView, LayerKind

log = logging.getLogger("pipeline")

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
    *logprobs, *buffers)`` with ``consts`` a ``SamplerConsts``, ``state`` a ``SamplerState`` (each
    flattened in field order) and ``logprobs`` as in ``pipeline.engine.sampler.sample_step``; with
    sampler None (a structured-output request, whose mask is known only after the previous token is read)
    it is the forward alone: ``step(token, pos, *buffers)`` -> ``(logits (1, vocab), pos + 1, *buffers)``. ``trace_count`` counts traces (it grows only when a new key is
    met); ``broken`` holds keys whose compilation failed, with the reason, so they are not retried.
    """

    def __init__(self, model):
        self.model = model
        self.closures: dict[tuple, Callable] = {}
        self.broken: dict[tuple, str] = {}
        self.trace_count = 0

    def get(self, kinds: tuple[LayerKind, ...], sampler: SamplerKind | None) -> Callable:
        key = (kinds, sampler)
        if key not in self.closures:
            self.closures[key] = mx.compile(self._make_step(kinds, sampler))
        return self.closures[key]

    def _make_step(self, kinds: tuple[LayerKind, ...], sampler: SamplerKind | None):
        model = self.model
        nc, ns = (0, 0) if sampler is None else (len(SamplerConsts._fields), len(SamplerState._fields))

        def step(token, pos, *args):
            self.trace_count += 1  # Python runs only while tracing
            consts, state, buffers = args[:nc], args[nc : nc + ns], args[nc + ns :]
            views = [DecodeView(kind, buffers[2 * i], buffers[2 * i + 1], pos) for i, kind in enumerate(kinds)]
            logits = model(token.reshape(1, 1), views)[:, -1, :]
            if sampler is None:
                out = [logits, pos + 1]
            else:
                next_token, state, extras = sample_step(sampler, logits, consts, state)
                out = [next_token, pos + 1, *state, *extras]
            for view in views:
                out += [view.keys, view.values]
            return tuple(out)

        return step
