"""Loglikelihood scoring (lm-evaluation-harness's ``loglikelihood`` requests): the log-probability of each
continuation (choice) after one context, the context prefilled once and the choices run as one batch.

Definitions follow lm-evaluation-harness (``lm_eval/api/model.py``, ``lm_eval/models/huggingface.py``): a
continuation of tokens ``c_0 .. c_{n-1}`` after context tokens ``x`` has ``logprob_sum = sum_i log
p(c_i | x, c_<i)`` (natural log, the raw model distribution in float32: ``log_softmax`` of the logits) and
``is_greedy`` = every ``c_i`` is the argmax of its position's distribution.

The shared path (``score_shared``): the context ``x`` is prefilled once into the engine's caches
(``Engine.prefill_prompt``: with prefix caching on, the blocks it shares with earlier rows' contexts, a
few-shot head say, are reused, and a context equal to the previous row's is not prefilled again); the
distribution of ``c_0`` is the context's last position; then each layer's cache is copied into ``C`` rows
(one per continuation) and the continuations' tokens ``c_0 .. c_{n-2}``, right-padded to the longest, run as
one forward ``(C, L_max - 1)`` from that KV. Causal attention keeps a row's real positions blind to the
padding after them; the logits of padded positions are not read.

The separate path (``score_separately``): each continuation gets its own full prefill of ``x + c`` from
reset caches, reading the logits of the continuation's positions: what the shared path saves, and the
baseline of ``docs/BENCHMARKS.md``.

``score`` takes the shared path unless ``shared_blocker`` names a reason, then the separate path:
- quantized KV caches (``cache.kv_bits``): their stored form depends on when a position was written
  (``quantized_kv_start``), which the row copies would have to reproduce; not worth it for scoring.
- a rotating cache (sliding window, ``cache.max_kv_size``, Gemma 3's sliding layers) whose window is
  shorter than ``context + longest continuation - 1``: once the ring wraps, slots of the context are
  overwritten and ``copy_prefix`` refuses (the prefix seam); a full prefill of ``x + c`` through the same
  rotating cache attends exactly over each position's window, as generation's prefill does.
Both paths give the same numbers up to float32 rounding (``tests/test_score.py`` says how close).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import mlx.core as mx

from ..errors import RowError


@dataclass
class Loglikelihood:
    """One continuation's score.

    Attributes:
        logprob_sum: sum of the continuation tokens' log-probabilities (natural log, float64 sum of the
            float32 values in ``token_logprobs``).
        num_tokens: continuation tokens (``len(token_logprobs)``).
        is_greedy: every continuation token is the argmax of its position's distribution (ties: the lowest
            id is the argmax, as ``mx.argmax``).
        token_logprobs: each continuation token's log-probability (float32 values), in order.
    """

    logprob_sum: float
    num_tokens: int
    is_greedy: bool
    token_logprobs: list[float]


def _check(engine, context: list[int], continuations: list[list[int]]) -> None:
    if not context:
        raise RowError("the context encodes to no tokens")
    if not continuations:
        raise RowError("no continuation to score")
    for i, c in enumerate(continuations):
        if not c:
            raise RowError(f"continuation {i} encodes to no tokens")
    tokens = len(context) + max(map(len, continuations))
    if tokens - 1 > engine.context_length:  # the last token is a target, never an input (lm-eval's max_length + 1)
        raise RowError(f"context + continuation have {tokens} tokens, {tokens - 1} positions to run; the model's "
                       f"context is {engine.context_length}")


def shared_blocker(caches: list, n_context: int, longest: int) -> str | None:
    """Why the choices of a row cannot run as one batch from the context's KV, or None.

    Args:
        caches: the engine's per-layer caches.
        n_context: context tokens.
        longest: tokens of the longest continuation.
    """
    for c in caches:
        if c.bits is not None:
            return "quantized KV caches (cache.kv_bits)"
        if c.max_size is not None and n_context + longest - 1 > c.max_size:
            return (f"context + continuation ({n_context} + {longest} tokens) exceed a rotating cache's window of "
                    f"{c.max_size} positions")
    return None


def _gather(logprobs: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """Per position: the target's log-probability and whether it is the argmax. ``logprobs`` ``(..., V)``
    float32, ``targets`` ``(...)`` int32 -> ``(...)`` float32 and ``(...)`` bool."""
    picked = mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    return picked, mx.argmax(logprobs, axis=-1) == targets


def _log_softmax(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _result(lps: list[float], greedy: list[bool]) -> Loglikelihood:
    return Loglikelihood(logprob_sum=float(sum(float(v) for v in lps)), num_tokens=len(lps),
                         is_greedy=all(greedy), token_logprobs=[float(v) for v in lps])


def _rows_of(cache, C: int):
    """A cache holding ``C`` copies of ``cache``'s positions (a batch-1 cache, dense, its ring not wrapped):
    buffers ``(C, n_kv_heads, offset, head_dim)``, same class and window."""
    rows = copy.copy(cache)
    n = cache.offset
    rows.keys = mx.repeat(cache.keys[..., :n, :], C, axis=0)
    rows.values = mx.repeat(cache.values[..., :n, :], C, axis=0)
    return rows


def score_shared(engine, context: list[int], continuations: list[list[int]],
                 times: dict | None = None) -> list[Loglikelihood]:
    """Score ``continuations`` after ``context``: one prefill of the context, then every continuation in one
    right-padded forward from copies of its KV (the module docstring says how).

    Args:
        engine: a ``pipeline.engine.Engine`` (its model and caches; its caches hold the context afterwards).
        context: context token ids (BOS included when the model wants it).
        continuations: ``C`` lists of token ids, each non-empty.
        times: if given, ``times["prefill_s"]`` is set to the seconds of the context's prefill.

    Returns:
        One ``Loglikelihood`` per continuation, in order.

    Raises:
        RowError: an empty context or continuation, context + continuation longer than the model's context.
        ValueError: ``shared_blocker`` names a reason (``score`` then takes the separate path).
    """
    _check(engine, context, continuations)
    longest = max(map(len, continuations))
    why = shared_blocker(engine.cache, len(context), longest)
    if why:
        raise ValueError(f"cannot score the choices from a shared context: {why}")
    t0 = time.perf_counter()
    first = _log_softmax(engine.prefill_prompt(context)[0])[0]  # (V,) float32; a few-shot head reused
    if times is not None:
        mx.eval(first)
        times["prefill_s"] = time.perf_counter() - t0
    C = len(continuations)
    heads = mx.array([c[0] for c in continuations], dtype=mx.int32)
    lp0, greedy0 = _gather(mx.broadcast_to(first, (C, first.shape[0])), heads)
    if longest == 1:
        mx.eval(lp0, greedy0)
        return [_result([a], [g]) for a, g in zip(lp0.tolist(), greedy0.tolist())]
    pad = lambda c, n: c + [0] * (n - len(c))  # noqa: E731  the logits of pad positions are never read
    inputs = mx.array([pad(c[:-1], longest - 1) for c in continuations], dtype=mx.int32)  # (C, L_max - 1)
    targets = mx.array([pad(c[1:], longest - 1) for c in continuations], dtype=mx.int32)
    rows = [_rows_of(c, C) for c in engine.cache]
    lp, greedy = _gather(_log_softmax(engine.model(inputs, rows)), targets)  # (C, L_max - 1) each
    mx.eval(lp0, greedy0, lp, greedy)
    lp0, greedy0, lp, greedy = lp0.tolist(), greedy0.tolist(), lp.tolist(), greedy.tolist()
    return [_result([lp0[i], *lp[i][: len(c) - 1]], [greedy0[i], *greedy[i][: len(c) - 1]])
            for i, c in enumerate(continuations)]


def _score_one(engine, context: list[int], cont: list[int]) -> Loglikelihood:
    """``cont`` after ``context`` by one full prefill of both (in ``prefill_step_size`` chunks) from reset caches."""
    engine.reset()
    ids = context + cont
    n_ctx, step = len(context), engine.prefill_step_size
    parts, start = [], 0
    while start < len(ids) - 1:  # the last token's logits predict nothing
        end = min(start + step, len(ids) - 1)
        logits = engine.model(mx.array([ids[start:end]], dtype=mx.int32), engine.cache)
        if end >= n_ctx:  # positions n_ctx - 1 .. predict the continuation
            parts.append(logits[0, max(n_ctx - 1 - start, 0):])
        else:
            mx.eval([c.state for c in engine.cache])
        start = end
    lp, greedy = _gather(_log_softmax(mx.concatenate(parts, axis=0)), mx.array(cont, dtype=mx.int32))
    mx.eval(lp, greedy)
    return _result(lp.tolist(), greedy.tolist())


def score_separately(engine, context: list[int], continuations: list[list[int]]) -> list[Loglikelihood]:
    """Score ``continuations`` after ``context`` with one full prefill of ``context + continuation`` each
    (no shared KV): C prefills of ``len(context) + len(c) - 1`` positions. Arguments, result and errors
    as ``score_shared`` (no ``ValueError``: every cache kind works)."""
    _check(engine, context, continuations)
    return [_score_one(engine, context, c) for c in continuations]


def score(engine, context: list[int], continuations: list[list[int]],
          times: dict | None = None) -> tuple[list[Loglikelihood], str | None]:
    """Score ``continuations`` after ``context``: ``score_shared``, or ``score_separately`` where
    ``shared_blocker`` names a reason (``times`` as ``score_shared``, set on the shared path only).

    Returns:
        (one ``Loglikelihood`` per continuation in order, the blocker's reason or None when shared).

    Raises:
        RowError: as ``score_shared``.
    """
    _check(engine, context, continuations)
    why = shared_blocker(engine.cache, len(context), max(map(len, continuations)))
    if why:
        return score_separately(engine, context, continuations), why
    return score_shared(engine, context, continuations, times), None
