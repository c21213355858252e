"""Token sampling from logits: penalties, temperature, min_p / top_k / top_p, and raw logprobs, with
every per-request value and the random state passed in as ``mx.array`` so one compiled step serves
every request (names and order as vLLM's sampler).

Per-row seeds: ``row_seed(job_seed, row_id, sample_index)`` so a row's samples never depend on row
order, sharding, resume, or what ran before in the process.

Order of operations (vLLM ``v1/sample/sampler.py``): logits are upcast to float32; repetition,
presence and frequency penalties; ``min_tokens`` suppression of stop tokens; greedy takes the argmax
here. Otherwise the logits are divided by the temperature, then min_p filters on the full
distribution, top_k keeps the k most likely, top_p keeps the smallest set whose renormalized
probability reaches top_p, and a token is drawn with ``mx.random.categorical``. The most likely token
always survives filtering, so top_k=1 or a tiny top_p equals greedy (ties broken to the lowest id, as
``argmax``). Logprobs are of the raw model distribution (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

NEG_INF = float("-inf")


def row_seed(job_seed: int, row_id, sample_index: int) -> int:
    """A 63-bit seed for one (job seed, row id, sample index): blake2b of their text, so the same
    triple gives the same seed in every process and on every platform."""
    text = f"{job_seed}\x1f{type(row_id).__name__}:{row_id}\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class SamplerKind:
    """What of a request's sampling settings changes the traced graph (part of a closure's key).

    Attributes:
        greedy: temperature 0 (argmax).
        penalties: a repetition, presence or frequency penalty is active.
        filters: min_p, top_k or top_p is active (needs a sort of the vocabulary).
        suppress: stop tokens are masked until ``min_tokens`` tokens are generated.
        logprobs: top alternatives reported per token (0: only the chosen token's); None: off.
    """

    greedy: bool = True
    penalties: bool = False
    filters: bool = False
    suppress: bool = False
    logprobs: int | None = None

    @classmethod
    def of(cls, params, suppress_ids) -> SamplerKind:
        """The kind for ``params`` (an ``engine.GenerateParams``); ``suppress_ids``: the ids masked
        before ``min_tokens``."""
        greedy = params.temperature == 0
        return cls(
            greedy=greedy,
            penalties=(params.repetition_penalty != 1 or params.presence_penalty != 0
                       or params.frequency_penalty != 0),
            filters=not greedy and (params.min_p > 0 or params.top_k > 0 or params.top_p < 1),
            suppress=params.min_tokens > 0 and bool(suppress_ids),
            logprobs=params.logprobs,
        )


class SamplerConsts(NamedTuple):
    """A request's sampling values as arrays, constant through its generation (``sampler_consts``).

    A compiled step takes them flattened, as ``len(SamplerConsts._fields)`` arrays in this order.
    """

    inv_temperature: mx.array  # float32 scalar: 1 / temperature (1 when greedy)
    top_k: mx.array  # int32 scalar: vocab_size when off
    top_p: mx.array  # float32 scalar: 2.0 when off (keeps every token)
    min_p: mx.array  # float32 scalar
    repetition_penalty: mx.array  # float32 scalar
    presence_penalty: mx.array  # float32 scalar
    frequency_penalty: mx.array  # float32 scalar
    min_tokens: mx.array  # int32 scalar
    suppress: mx.array  # (vocab_size,) bool: ids masked out until min_tokens tokens are generated


class SamplerState(NamedTuple):
    """A request's sampling state, new after every step (``sampler_state``, ``sample_step``).

    A compiled step takes and returns it flattened, as ``len(SamplerState._fields)`` arrays in this order.
    """

    key: mx.array  # uint32 (2,): the random key (split once per sampled token)
    seen: mx.array  # (vocab_size,) bool: ids in the prompt or output (repetition penalty); (1,) when off
    counts: mx.array  # (vocab_size,) float32: occurrences in the output (presence / frequency); (1,) when off
    n_out: mx.array  # int32 scalar: tokens generated so far


def sampler_consts(params, vocab_size: int, suppress_ids) -> SamplerConsts:
    """The request's sampling values as arrays (``SamplerConsts``): inverse temperature, top_k, top_p,
    min_p (float32 / int32 scalars), repetition, presence and frequency penalties (float32 scalars),
    min_tokens (int32 scalar), and the ``(vocab_size,)`` bool mask of ids suppressed before
    ``min_tokens``. Disabled filters get values that keep every token."""
    t = params.temperature
    suppress = mx.zeros((vocab_size,), dtype=mx.bool_)
    ids = [i for i in suppress_ids if 0 <= i < vocab_size]
    if ids:
        suppress[mx.array(ids)] = True
    f32 = lambda v: mx.array(v, dtype=mx.float32)  # noqa: E731
    return SamplerConsts(
        f32(1.0 / t if t > 0 else 1.0),
        mx.array(params.top_k if params.top_k > 0 else vocab_size, dtype=mx.int32),
        f32(params.top_p if params.top_p < 1 else 2.0),
        f32(params.min_p),
        f32(params.repetition_penalty),
        f32(params.presence_penalty),
        f32(params.frequency_penalty),
        mx.array(params.min_tokens, dtype=mx.int32),
        suppress,
    )


def sampler_state(kind: SamplerKind, seed: int, prompt_ids, vocab_size: int) -> SamplerState:
    """The initial per-request ``SamplerState`` ``(key, seen, counts, n_out)``: the ``mx.random.key(seed)``
    (uint32 ``(2,)``), a ``(vocab_size,)`` bool mask of ids in the prompt (repetition penalty),
    ``(vocab_size,)`` float32 counts of generated ids (presence / frequency penalties), and the int32
    count of generated tokens. The masks are size-1 placeholders when no penalty is active."""
    size = vocab_size if kind.penalties else 1
    seen = mx.zeros((size,), dtype=mx.bool_)
    if kind.penalties:
        ids = [i for i in prompt_ids if 0 <= i < vocab_size]
        if ids:
            seen[mx.array(ids)] = True
    return SamplerState(mx.random.key(seed), seen, mx.zeros((size,), dtype=mx.float32), mx.array(0, dtype=mx.int32))


def filter_ranked(logits: mx.array, top_k, top_p, min_p) -> tuple[mx.array, mx.array, mx.array]:
    """min_p, then top_k, then top_p over ``logits`` ``(1, V)`` float32 (already temperature-scaled).

    Returns:
        ``(order, ranked, keep)``: ids in descending logit order ``(1, V)`` (ties in id order), the
        logits in that order, and the bool mask of ranks kept (always a prefix, never empty).
    """
    order = mx.argsort(-logits, axis=-1)  # stable: ties stay in id order, as argmax breaks them
    ranked = mx.take_along_axis(logits, order, axis=-1)
    rank = mx.arange(ranked.shape[-1])
    probs = mx.softmax(ranked, axis=-1)
    keep = (probs >= min_p * probs[:, :1]) & (rank < top_k)
    kept = mx.softmax(mx.where(keep, ranked, NEG_INF), axis=-1)
    keep = keep & ((mx.cumsum(kept, axis=-1) - kept) < top_p)
    return order, ranked, keep | (rank == 0)


def _filtered_sample(logits: mx.array, top_k, top_p, min_p, key) -> mx.array:
    """Draw from ``logits`` after ``filter_ranked``; rank 0 maps to ``argmax`` so a sort that broke
    ties differently could never make top_k=1 differ from greedy."""
    order, ranked, keep = filter_ranked(logits, top_k, top_p, min_p)
    pick = mx.random.categorical(mx.where(keep, ranked, NEG_INF), key=key)
    token = mx.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return mx.where(pick == 0, mx.argmax(logits, axis=-1), token)


def adjusted_logits(kind, raw: mx.array, consts, state) -> mx.array:
    """``raw`` float32 logits ``(rows, vocab)`` after the repetition, presence and frequency penalties and
    the ``min_tokens`` suppression of stop ids, where ``kind`` (a ``SamplerKind``, or anything with its
    ``penalties`` and ``suppress`` flags) turns them on; ``raw`` itself when neither is. ``consts`` and
    ``state``: ``SamplerConsts`` / ``SamplerState`` of one request, or per-row ``(rows, ...)`` arrays that
    broadcast against ``raw``."""
    rep, presence, frequency, min_tokens, suppress = consts[4:]
    _, seen, counts, n_out = state
    x = raw
    if kind.penalties:
        x = mx.where(seen, mx.where(x > 0, x / rep, x * rep), x)
        x = x - presence * (counts > 0) - frequency * counts
    if kind.suppress:
        x = mx.where(suppress & (n_out < min_tokens), NEG_INF, x)
    return x


def sample_step(kind: SamplerKind, logits: mx.array, consts, state):
    """Pick the next token.

    Args:
        kind: the request's ``SamplerKind``.
        logits: ``(1, vocab)`` model logits (any float dtype; upcast to float32).
        consts: ``SamplerConsts`` (or its arrays in field order) from ``sampler_consts``.
        state: ``SamplerState`` (or its arrays in field order) from ``sampler_state`` or the previous step.

    Returns:
        ``(token, state, logprobs)``: ``token`` ``(1,)`` uint32; the next ``SamplerState``; ``logprobs`` is ()
        when off, else ``(chosen (1,) float32, top_ids (1, k) uint32, top_logprobs (1, k) float32)``
        of the raw distribution, alternatives in descending order.
    """
    inv_t, top_k, top_p, min_p = consts[:4]
    key, seen, counts, n_out = state
    raw = logits.astype(mx.float32)
    x = adjusted_logits(kind, raw, consts, state)
    if kind.greedy:
        token = mx.argmax(x, axis=-1)
    else:
        key, sub = mx.random.split(key)
        x = x * inv_t
        if kind.filters:
            token = _filtered_sample(x, top_k, top_p, min_p, sub)
        else:
            token = mx.random.categorical(x, key=sub)
    token = token.astype(mx.uint32)
    if kind.penalties:
        at = token.astype(mx.int32)
        seen = mx.slice_update(seen, mx.array([True]), at, axes=(0,))
        counts = mx.slice_update(counts, mx.take(counts, at) + 1, at, axes=(0,))
    extras = ()
    if kind.logprobs is not None:
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, token[:, None].astype(mx.int32), axis=-1)[:, 0]
        k = kind.logprobs
        if k > 0:
            top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(lp, top, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            extras = (chosen, mx.take_along_axis(top, order, axis=-1).astype(mx.uint32),
                      mx.take_along_axis(vals, order, axis=-1))
        else:
            extras = (chosen, mx.zeros((1, 0), dtype=mx.uint32), mx.zeros((1, 0), dtype=mx.float32))
    return token, SamplerState(key, seen, counts, n_out + 1), extras
