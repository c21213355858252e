"""The decode-path choice: fused, compiled, eager or batched, with every blocker and "auto" rule in one place.

An engine's path is fixed when it is built (``choose_path``) from the job's ``engine.compile``,
``engine.fused`` and ``engine.batch_size``, the model and its caches, so warm-up runs exactly the path
the job will use. Within that path one request may still fall back to eager decoding
(``request_blocker``: a cache not yet quantized after prefill, a compiled step that failed to trace),
logged once per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache import KVCache
from .compiled import cpu_compile_blocker, decode_blocker
from .cuda import decoder_for, fused_blocker


def compile_by_default(caches) -> bool:
    """The "auto" rule for ``compile``: compiled decode, except on MLX's CUDA backend when every layer
    has a plain full-attention cache.

    Measured (docs/BENCHMARKS.md, 2026-11-29, random 4-bit weights, 256 new tokens): on a 2-core
    x86_64 CPU compiled decode of the default model ran 12.0 vs 10.0 tok/s eager. On an NVIDIA H200
    (mlx 0.32.4) with full caches the compiled step launched 960 kernels per token vs 549 eager
    (whole-buffer copies for the cache writes, the mask, the select) and lost: SmolLM2-135M 139 vs
    214 tok/s, Llama-3.2-1B 234 vs 463, Qwen2.5-7B 117 vs 175 (prompt 64); with Gemma 3's sliding
    layers it won, 131 vs 102 tok/s (prompt 2048). Rotating and quantized caches on CUDA were not
    measured apart from Gemma 3, so they keep the compiled step. Where MLX cannot compile on the CPU
    (no ``g++``: ``compiled.cpu_compile_blocker``) the engine decodes eagerly whatever ``compile`` says.
    """
    if not mx.cuda.is_available():
        return True
    return any(type(c) is not KVCache for c in caches)


@dataclass(frozen=True)
class DecodePath:
    """How an engine decodes.

    Attributes:
        name: "fused" (batch 1 through ``pipeline.engine.cuda``), "compiled" (batch 1 through the
            ``ClosureSet``), "eager" (batch 1, the model called per token) or "batched"
            (``BatchEngine``'s step over ``batch_size`` slots).
        compiled: whether the compiled steps are used: batch 1, the fallback of a fused engine for
            requests it cannot serve; "batched", whether the batched step is ``mx.compile``d.
        decoder: the ``FusedDecoder`` of a "fused" path, else None.
        note: why a path the job asked for explicitly (``fused: true``) is not taken, or None.
    """

    name: str
    compiled: bool
    decoder: object = None
    note: str | None = None


def choose_path(model, caches, *, compile: bool | str = True, fused: bool | str = "auto",
                batch_size: int = 1) -> DecodePath:
    """The engine's decode path.

    Args:
        model: the engine's model.
        caches: its per-layer batch-1 caches (``cache.make_caches``).
        compile: True, False, or "auto" (``compile_by_default``); False wherever MLX cannot compile on
            the CPU (``compiled.cpu_compile_blocker``).
        fused: "auto" or True: the fused CUDA step where ``fused_blocker`` allows it (tried before the
            compiled step; never for batched decoding); False: never.
        batch_size: slots decoded together; > 1 is the batched path (no fused decoder is built).
    """
    compiled = compile_by_default(caches) if compile == "auto" else bool(compile)
    if compiled and cpu_compile_blocker() is not None:
        compiled = False  # mx.compile would hand back the step uncompiled (warn_if_no_cpu_compile says so)
    if batch_size > 1:
        note = "no fused step (batched decoding: engine.batch_size > 1)" if fused is True else None
        return DecodePath("batched", compiled, note=note)
    reason = fused_blocker(model, caches) if fused else "off"
    if reason is None:
        return DecodePath("fused", compiled, decoder_for(model))
    note = f"no fused step ({reason})" if fused is True else None
    return DecodePath("compiled" if compiled else "eager", compiled, note=note)


def request_blocker(caches, broken: dict, key) -> str | None:
    """Why one request of a compiled path decodes eagerly (None if it need not): ``decode_blocker`` of
    the caches after its prefill, or an earlier failure to trace the step of closure ``key``
    (``broken``: ``ClosureSet.broken``)."""
    reason = decode_blocker(caches)
    if reason:
        return reason
    if key in broken:
        return f"compiled step failed ({broken[key]})"
    return None
