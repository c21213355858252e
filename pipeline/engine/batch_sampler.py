"""Sampling for every slot of a ``BatchEngine`` in one batched call per step.

``sample_batch`` is ``sampler.sample_step`` over ``(B, vocab)`` logits with every setting and every
piece of state held per row; ``SlotSampler`` keeps those per-slot arrays for a run, writes row ``b``
when a request takes slot ``b``, and hands each row its logprobs, sliced on the host.

Exactness: a row's token, next state and logprobs are bitwise what ``sample_step`` gives that request
alone on the same logits row, whatever its neighbours are:

- every op is row-wise: elementwise with the row's own ``(B, 1)`` settings, or a reduction, scan or
  sort along the vocabulary. A part only some rows need runs on the others with neutral values
  (repetition 1, presence and frequency 0, nothing seen or suppressed; top_k the vocabulary, top_p 2,
  min_p 0), which leave their logits bitwise unchanged and keep every token, and which pick a row
  takes (argmax or draw) is a ``where``.
- a sampling row splits its own key (``mx.vmap`` of ``mx.random.split``, bitwise the per-row call);
  greedy rows keep theirs, as in ``sample_step``; its uniform is the vmapped per-row
  ``mx.random.uniform``.
- the draw (``sampler.sample_tokens``) sums token masses as int64 fixed point, exact in any order, so
  no backend's reduction order can change a row's token; on CUDA one kernel does the filters and the
  draw for every row (``pipeline/engine/cuda/sample.py``), batch-1 sampling there too.
  ``tests/test_batch_sampling.py`` checks this against ``sample_step`` row by row.

The top-k logprob alternatives are computed once per distinct k of the batch (usually one: a job
sets one ``logprobs``), not once at the largest k and cut, because ``argpartition`` orders exactly
equal logprobs by its k: cut from a larger k, tied ids could come in another order than
``sample_step`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .sampler import SamplerConsts, SamplerKind, SamplerState, adjusted_logits, sample_tokens

_split_rows = mx.vmap(mx.random.split)  # (B, 2) keys -> (B, 2, 2): each row's (next key, subkey)
_uniform_rows = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))  # (B, 2) keys -> (B, 1)


@dataclass(frozen=True)
class BatchKind:
    """What the batched graph must build: the union of the active rows' ``SamplerKind`` s.

    Attributes:
        greedy: some row takes the argmax.
        sampled: some row draws (temperature > 0).
        filters: some drawing row has one (``sampler.keep_mask``, or the CUDA kernel's cuts).
        penalties: some row has a repetition, presence or frequency penalty.
        suppress: some row masks stop ids until ``min_tokens``.
        logprobs: the distinct top-k of the rows that report logprobs, ascending (0: the chosen token's
            only); None: no row does.
    """

    greedy: bool = True
    sampled: bool = False
    filters: bool = False
    penalties: bool = False
    suppress: bool = False
    logprobs: tuple[int, ...] | None = None

    @classmethod
    def of(cls, kinds) -> BatchKind:
        kinds = list(kinds)
        ks = tuple(sorted({k.logprobs for k in kinds if k.logprobs is not None}))
        return cls(greedy=any(k.greedy for k in kinds), sampled=any(not k.greedy for k in kinds),
                   filters=any(k.filters for k in kinds), penalties=any(k.penalties for k in kinds),
                   suppress=any(k.suppress for k in kinds), logprobs=ks or None)

    @property
    def plain(self) -> bool:
        """Every row is plain greedy: the step's own argmax is the answer."""
        return not (self.sampled or self.penalties or self.suppress) and self.logprobs is None


class RowFlags(NamedTuple):
    """Which pick each row takes, ``(B,)`` bool each (set on admission, like the consts)."""

    greedy: mx.array  # argmax (idle slots too: their keys are left alone)
    penalized: mx.array  # seen / counts are updated with the row's token


def sample_batch(kind: BatchKind, logits: mx.array, consts: SamplerConsts, state: SamplerState, flags: RowFlags,
                 argmax: mx.array | None = None, allowed=None):
    """Pick the next token of every row: ``sample_step`` row by row, as one graph.

    Args:
        kind: the ``BatchKind`` of the rows (parts no row needs are not built).
        logits: ``(B, vocab)`` float32.
        consts: ``SamplerConsts`` with a leading ``B`` axis: ``(B, 1)`` scalars, ``suppress`` ``(B, vocab)``
            bool (``(B, 1)`` when ``kind.suppress`` is off).
        state: ``SamplerState`` per row: ``key`` ``(B, 2)`` uint32, ``seen`` ``(B, vocab)`` bool and
            ``counts`` ``(B, vocab)`` float32 (``(B, 1)`` when ``kind.penalties`` is off), ``n_out`` ``(B, 1)`` int32.
        flags: the rows' ``RowFlags``.
        argmax: ``(B,)`` uint32 argmax of ``logits`` if already computed (used when nothing changes them).
        allowed: the tokens each row's structured-output grammar allows, a ``structured.TokenMask`` of ``B``
            rows (every token on a row without one; ``structured.SlotMasks``), applied as in ``sample_step``;
            None: every token.

    Returns:
        ``(tokens (B,) uint32, state, logprobs)``: the next ``SamplerState`` (the parts ``kind`` does not
        touch are passed through); ``logprobs`` is () when no row reports them, else ``(chosen (B,) float32,
        top_ids_k (B, k) uint32, top_logprobs_k (B, k) float32, ...)``, one pair for each k > 0 of
        ``kind.logprobs`` in its order, alternatives in descending order, for every row (``StepLogprobs``
        gives each row its own k's pair).
    """
    inv_t, top_k, top_p, min_p = consts[:4]
    key, seen, counts, n_out = state
    raw = logits.astype(mx.float32)
    x = adjusted_logits(kind, raw, consts, state)
    if allowed is not None:
        x = allowed.apply(x)
    if kind.greedy:
        best = argmax if argmax is not None and x is raw else mx.argmax(x, axis=-1)
    if kind.sampled:
        split = _split_rows(key)
        key, sub = mx.where(flags.greedy[:, None], key, split[:, 0]), split[:, 1]
        token = sample_tokens(x * inv_t, top_k, top_p, min_p, _uniform_rows(sub), kind.filters)
        if kind.greedy:
            token = mx.where(flags.greedy, best, token)
    else:
        token = best
    token = token.astype(mx.uint32)
    at = token[:, None].astype(mx.int32)
    if kind.penalties:
        hit = flags.penalized[:, None]
        seen = mx.put_along_axis(seen, at, mx.take_along_axis(seen, at, axis=-1) | hit, axis=-1)
        counts = mx.put_along_axis(counts, at, mx.take_along_axis(counts, at, axis=-1) + hit, axis=-1)
    if kind.suppress:
        n_out = n_out + 1
    extras = ()
    if kind.logprobs is not None:
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        extras = (mx.take_along_axis(lp, at, axis=-1)[:, 0],)
        for k in kind.logprobs:
            if k > 0:
                top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
                vals = mx.take_along_axis(lp, top, axis=-1)
                order = mx.argsort(-vals, axis=-1)
                extras += (mx.take_along_axis(top, order, axis=-1).astype(mx.uint32),
                           mx.take_along_axis(vals, order, axis=-1))
    return token, SamplerState(key, seen, counts, n_out), extras


class StepLogprobs:
    """One step's logprob arrays of every slot; ``get(b)`` gives slot ``b`` its own, as ``sample_step``
    shapes them (``chosen (1,)``, ``top_ids (1, k)``, ``top_logprobs (1, k)``), read back to the host
    once (after the step's tokens were read).

    Args:
        arrays: ``sample_batch``'s logprobs, or ().
        ks: per slot, its ``logprobs`` k at the step's launch, or None.
        distinct: the ``BatchKind.logprobs`` the arrays were computed for.
    """

    def __init__(self, arrays: tuple = (), ks: tuple = (), distinct: tuple = ()):
        self.arrays, self.ks = arrays, ks
        self._pair = {k: 1 + 2 * i for i, k in enumerate(k for k in distinct if k > 0)}
        self._host: list | None = None

    def get(self, b: int, default=()):
        k = self.ks[b] if self.arrays else None
        if k is None:
            return default
        if self._host is None:
            self._host = [np.array(a) for a in self.arrays]
        chosen = mx.array(self._host[0][b : b + 1])
        if k == 0:
            return chosen, mx.zeros((1, 0), dtype=mx.uint32), mx.zeros((1, 0), dtype=mx.float32)
        ids, vals = self._host[self._pair[k]], self._host[self._pair[k] + 1]
        return chosen, mx.array(ids[b : b + 1]), mx.array(vals[b : b + 1])


_NEUTRAL = {"inv_temperature": 1.0, "top_p": 2.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}  # top_k: the vocabulary size
_SCALARS = SamplerConsts._fields[:-1]
_INTS = ("top_k", "min_tokens")


class SlotSampler:
    """Per-slot sampling settings and state for one ``BatchEngine.run``, sampled by ``step`` once per step.

    A slot's row is written when its occupant changes (``step`` compares ``slots`` with the occupants it
    saw last): a new request's ``Decoding.consts`` and its state after the first token
    (``Decoding.state``); from then on the state lives here. A slot that empties gets neutral settings
    and the greedy flag, so it drops out of the ``BatchKind``. The ``(B, vocab)`` arrays (seen, counts,
    suppress) are allocated only once a request needs them, and ``BatchKind`` and the settings' arrays are
    rebuilt only when occupants change.

    Args:
        B: slots.
    """

    def __init__(self, B: int):
        self.B = B
        self.owners: list = [None] * B
        self.kinds: list[SamplerKind | None] = [None] * B
        self.kind = BatchKind()
        self.state: SamplerState | None = None
        self.consts: SamplerConsts | None = None
        self.flags: RowFlags | None = None
        self._host: dict | None = None
        self._suppress: mx.array | None = None
        self._vocab = 0

    def step(self, slots, logits: mx.array, argmax: mx.array, allowed=None) -> tuple[mx.array, StepLogprobs]:
        """The next token of every slot from the step's ``logits`` ``(B, vocab)`` float32 and their
        ``argmax`` ``(B,)`` uint32; returns ``(tokens (B,) uint32, StepLogprobs)``, lazy (``arrays``: what
        to evaluate with the tokens). ``slots``: each slot's ``Decoding`` or None; ``allowed``: the slots'
        structured-output masks (``sample_batch``) or None."""
        self._sync(slots)
        if self.kind.plain:  # every row greedy, nothing else asked: the argmax, of the masked logits if masked
            if allowed is not None:
                argmax = mx.argmax(allowed.apply(logits), axis=-1).astype(mx.uint32)
            return argmax, StepLogprobs()
        tokens, self.state, lp = sample_batch(self.kind, logits, self.consts, self.state, self.flags, argmax,
                                              allowed)
        ks = tuple(k.logprobs if k is not None else None for k in self.kinds)
        return tokens, StepLogprobs(lp, ks, self.kind.logprobs or ())

    def arrays(self) -> list[mx.array]:
        """The state arrays, to evaluate with each step (a graph that is never evaluated keeps growing)."""
        return list(self.state) if self.state is not None else []

    def _sync(self, slots) -> None:
        changed = [b for b, d in enumerate(slots) if d is not self.owners[b]]
        if not changed:
            return
        for b in changed:
            d = self.owners[b] = slots[b]
            if d is None:
                self.kinds[b] = None
                if self._host is not None:
                    for name, v in _NEUTRAL.items():
                        self._host[name][b] = v
                    self._host["top_k"][b] = self._vocab
            else:
                self._enter(b, d)
        live = [k for k in self.kinds if k is not None]
        self.kind = BatchKind.of(live) if live else BatchKind()
        if self._host is None:
            return
        col = lambda name: mx.array(self._host[name][:, None])  # noqa: E731
        self.consts = SamplerConsts(*(col(name) for name in _SCALARS),
                                    self._suppress if self._suppress is not None else mx.zeros((self.B, 1), mx.bool_))
        k = self.kinds
        self.flags = RowFlags(mx.array([x is None or x.greedy for x in k]),
                              mx.array([x is not None and x.penalties for x in k]))

    def _allocate(self, vocab: int) -> None:
        B = self.B
        self._vocab = vocab
        self._host = {name: np.full((B,), _NEUTRAL.get(name, vocab), dtype=np.int32 if name in _INTS else np.float32)
                      for name in _SCALARS}
        self.state = SamplerState(mx.zeros((B, 2), mx.uint32), mx.zeros((B, 1), mx.bool_), mx.zeros((B, 1), mx.float32),
                                  mx.zeros((B, 1), mx.int32))

    def _enter(self, b: int, d) -> None:
        """Row ``b`` from request ``d`` (a ``Decoding`` after ``begin``)."""
        kind, consts, first = d.kind, d.consts, d.state
        vocab = consts.suppress.shape[-1]
        if self._host is None:
            self._allocate(vocab)
        self.kinds[b] = kind
        for name in _SCALARS:
            self._host[name][b] = getattr(consts, name).item()
        key, seen, counts, n_out = self.state
        key[b] = first.key
        n_out[b] = first.n_out
        if kind.penalties and seen.shape[-1] != vocab:
            seen, counts = mx.zeros((self.B, vocab), mx.bool_), mx.zeros((self.B, vocab), mx.float32)
        if seen.shape[-1] == vocab:
            seen[b] = first.seen if kind.penalties else mx.zeros((vocab,), mx.bool_)
            counts[b] = first.counts if kind.penalties else mx.zeros((vocab,), mx.float32)
        if kind.suppress and self._suppress is None:
            self._suppress = mx.zeros((self.B, vocab), mx.bool_)
        if self._suppress is not None:
            self._suppress[b] = consts.suppress if kind.suppress else mx.zeros((vocab,), mx.bool_)
        self.state = SamplerState(key, seen, counts, n_out)
