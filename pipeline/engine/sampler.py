"""Token sampling from logits: penalties, temperature, min_p / top_k / top_p, and raw logprobs, with
every per-request value and the random state passed in as ``mx.array`` so one compiled step serves
every request (names and order as vLLM's sampler).

Per-row seeds: ``row_seed(job_seed, row_id, sample_index)`` so a row's samples never depend on row
order, sharding, resume, or what ran before in the process.

Order of operations (vLLM ``v1/sample/sampler.py``): logits are upcast to float32; repetition,
presence and frequency penalties; ``min_tokens`` suppression of stop tokens; the structured-output mask
(``engine.structured``: disallowed tokens get -inf); greedy takes the argmax here. Otherwise the logits are divided by the temperature, then min_p filters on the full
distribution, top_k keeps the k most likely, top_p keeps the smallest set of most likely tokens whose
renormalized probability reaches top_p, and a token is drawn from what is left. Logprobs are of the
raw model distribution (vLLM's default ``raw_logprobs``).

How a token is drawn (``token_mass``, ``keep_mask``, ``draw``), the same for every request and setting,
on one row or many, and as one CUDA kernel (``pipeline/engine/cuda/sample.py``) that gives the same
token as these MLX ops for the same masses:

- A token's probability mass is ``w = exp(x - max(x))`` in fixed point: ``floor(w * 2**40)`` as an int64
  (``MASS_BITS``). Sums of masses are integer sums, exact in any order, so a row's result does not
  depend on how a backend orders a reduction, nor on the other rows of a batch.
- The filters cut the ranking of a stable descending sort (ties in id order, as argmax breaks them):
  min_p keeps ``w >= min_p``; top_k the first k; top_p the first ranks whose preceding kept mass (of
  what min_p and top_k left) is below ``top_p`` of their total (``top_p`` in 2**-24 steps). Rank 0 always
  survives, so top_k=1 or a tiny top_p equals greedy.
- The draw: ``u`` uniform in [0, 1) from the request's key, ``t = floor(Z * floor(u * 2**24) / 2**24)``
  for the kept mass ``Z``, and the token is the first id (in id order) whose inclusive cumulative kept
  mass exceeds ``t``: ``P(id) = mass(id) / Z``. Tokens with ``w < 2**-40`` (``p < 1e-12 * p_max``) get no
  mass and are never drawn.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from .cuda.sample import sample_kernel

NEG_INF = float("-inf")


def row_seed(job_seed: int, row_id, sample_index: int) -> int:
    """A 63-bit seed for one (job seed, row id, sample index): blake2b of their text, so the same
    triple gives the same seed in every process and on every platform."""
    text = f"{job_seed}\x1f{type(row_id).__name__}:{row_id}\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# Temperatures below this are greedy: vLLM's ``_SAMPLING_EPS`` (vllm/sampling_params.py). 1 / t in float32 is
# inf below ~2.9e-39, which turned the logits into NaN and the tokens into noise.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplerKind:
    """What of a request's sampling settings changes the traced graph (part of a closure's key).

    Attributes:
        greedy: temperature below ``SAMPLING_EPS`` (argmax), as vLLM.
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
        greedy = params.temperature < SAMPLING_EPS
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
        f32(1.0 / t if t >= SAMPLING_EPS else 1.0),
        mx.array(min(params.top_k, vocab_size) if params.top_k > 0 else vocab_size, dtype=mx.int32),
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


MASS_BITS = 40  # fixed-point bits of a token's mass w = exp(x - max) in [0, 1]; V * 2**40 < 2**58 for V <= 2**18
FRACTION_BITS = 24  # bits of the fractions top_p and u that scale a total mass (float32 has a 24-bit mantissa)


def token_mass(x: mx.array) -> tuple[mx.array, mx.array]:
    """Each token's mass relative to the row's most likely one, for ``x`` ``(rows, V)`` float32.

    Returns:
        ``(w, mass)``: ``w = exp(x - max)`` ``(rows, V)`` float32 (a row whose max is infinite: 1 where ``x`` is
        the max, else 0), and ``floor(w * 2**MASS_BITS)`` ``(rows, V)`` int64.
    """
    m = mx.max(x, axis=-1, keepdims=True)
    w = mx.where(mx.isinf(m), (x == m).astype(mx.float32), mx.exp(x - m))
    return w, (w * float(1 << MASS_BITS)).astype(mx.int64)


def scale_mass(total: mx.array, fraction: mx.array) -> mx.array:
    """``floor(total * fraction / 2**24)``, exact in int64: ``total`` ``(rows, 1)`` int64 below 2**58,
    ``fraction`` ``(rows, 1)`` int64 at most 2**25 (a probability times 2**24)."""
    hi, lo = mx.right_shift(total, FRACTION_BITS), mx.bitwise_and(total, (1 << FRACTION_BITS) - 1)
    return hi * fraction + mx.right_shift(lo * fraction, FRACTION_BITS)


def fraction_bits(p: mx.array) -> mx.array:
    """``floor(p * 2**24)`` as int64 (``p`` float32 in [0, 2]); at least 1, so a tiny top_p keeps the top."""
    return mx.maximum((p * float(1 << FRACTION_BITS)).astype(mx.int64), 1)


def keep_mask(x: mx.array, w: mx.array, mass: mx.array, top_k, top_p, min_p) -> mx.array:
    """min_p, then top_k, then top_p over ``x`` ``(rows, V)`` float32 (temperature-scaled), in the ranking of a
    stable descending sort (ties by lower id; module docstring); ``w``, ``mass``: ``token_mass(x)``; ``top_k``
    int32, ``top_p`` and ``min_p`` float32, scalars or ``(rows, 1)`` (off: the vocabulary size, 2.0, 0).
    Returns the kept tokens, ``(rows, V)`` bool, in id order (rank 0 always among them)."""
    order = mx.argsort(-x, axis=-1)  # stable: ties stay in id order, as argmax breaks them
    rank = mx.arange(x.shape[-1])
    first = (mx.take_along_axis(w, order, axis=-1) >= min_p) & (rank < top_k)
    ranked = mx.where(first, mx.take_along_axis(mass, order, axis=-1), 0)
    above = mx.cumsum(ranked, axis=-1, inclusive=False)  # the kept mass of the ranks before each rank
    total = mx.sum(ranked, axis=-1, keepdims=True)
    kept = (first & (above < scale_mass(total, fraction_bits(top_p)))) | (rank == 0)
    return mx.put_along_axis(mx.zeros(x.shape, mx.bool_), order, kept, axis=-1)


def draw(mass: mx.array, keep: mx.array | None, u: mx.array) -> mx.array:
    """The drawn id of each row, ``(rows,)`` uint32: the first whose inclusive cumulative kept ``mass``
    (``(rows, V)`` int64) exceeds ``floor(Z * floor(u * 2**24) / 2**24)``; ``keep`` ``(rows, V)`` bool or None
    (all), ``u`` ``(rows, 1)`` float32 uniform in [0, 1)."""
    if keep is not None:
        mass = mx.where(keep, mass, 0)
    cdf = mx.cumsum(mass, axis=-1)
    t = scale_mass(cdf[..., -1:], (u * float(1 << FRACTION_BITS)).astype(mx.int64))
    return mx.sum(cdf <= t, axis=-1).astype(mx.uint32)


def sample_tokens(x: mx.array, top_k, top_p, min_p, u: mx.array, filters: bool) -> mx.array:
    """A token per row of ``x`` ``(rows, V)`` float32 (penalized, temperature-scaled logits) for uniforms
    ``u`` ``(rows, 1)`` float32: ``keep_mask`` (when ``filters``) and ``draw``, as MLX ops, or as the CUDA
    sampling kernel where it runs (same tokens for the same masses). Returns ``(rows,)`` uint32."""
    kernel = sample_kernel(x)
    if kernel is not None:
        return kernel(x, top_k, top_p, min_p, u, filters)
    w, mass = token_mass(x)
    return draw(mass, keep_mask(x, w, mass, top_k, top_p, min_p) if filters else None, u)


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


def sample_step(kind: SamplerKind, logits: mx.array, consts, state, allowed=None):
    """Pick the next token.

    Args:
        kind: the request's ``SamplerKind``.
        logits: ``(1, vocab)`` model logits (any float dtype; upcast to float32).
        consts: ``SamplerConsts`` (or its arrays in field order) from ``sampler_consts``.
        state: ``SamplerState`` (or its arrays in field order) from ``sampler_state`` or the previous step.
        allowed: the tokens a structured-output grammar allows, a ``structured.TokenMask`` of one row
            (``structured.allowed_tokens``): the others get -inf after the penalties, before greedy or the
            temperature and filters; None: every token.

    Returns:
        ``(token, state, logprobs)``: ``token`` ``(1,)`` uint32; the next ``SamplerState``; ``logprobs`` is ()
        when off, else ``(chosen (1,) float32, top_ids (1, k) uint32, top_logprobs (1, k) float32)``
        of the raw distribution, alternatives in descending order.
    """
    inv_t, top_k, top_p, min_p = consts[:4]
    key, seen, counts, n_out = state
    raw = logits.astype(mx.float32)
    x = adjusted_logits(kind, raw, consts, state)
    if allowed is not None:
        x = allowed.apply(x)
    if kind.greedy:
        token = mx.argmax(x, axis=-1)
    else:
        key, sub = mx.random.split(key)
        u = mx.random.uniform(shape=(1,), key=sub)[None]  # (1, 1): as the batched per-row call
        token = sample_tokens(x * inv_t, top_k, top_p, min_p, u, kind.filters)
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
