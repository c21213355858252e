"""The batched sampler (``pipeline.engine.batch_sampler``) against ``sampler.sample_step`` run on each row
alone: tokens, next state and logprobs bitwise equal for mixed rows (greedy, temperature, top_p, top_k,
min_p, penalties, min_tokens suppression, logprobs off / 0 / k) in any slot order, next to any neighbours,
through mid-run admissions; MLX's per-row random ops vectorized exactly; neutral penalty and suppress
values leaving logits bitwise unchanged; and ``BatchEngine`` with mixed sampled requests against
``Engine.generate`` of each request alone."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import numpy as np
import pytest

from pipeline.engine import GenerateParams, Generation
from pipeline.engine.batch import BatchEngine, Request
from pipeline.engine.batch_sampler import BatchKind, SlotSampler, _draw, _row_sums, _split_rows, _uniform_rows
from pipeline.engine.sampler import SamplerKind, sample_step, sampler_consts, sampler_state
from test_batch import MAX_POSITIONS, PROMPTS, VOCAB, assert_same_generation, engine_for, llama, run_all  # noqa: F401

V = 96
STOPS = (3, 17, 40, 41, 42, 60, 71, 88)  # the ids min_tokens suppresses
P = GenerateParams
MIXED = [
    P(),
    P(logprobs=0),
    P(temperature=0.8, seed=1),
    P(temperature=0.8, top_p=0.9, seed=2, logprobs=3),
    P(temperature=1.2, top_k=5, seed=3),
    P(temperature=0.7, min_p=0.1, seed=4, logprobs=5),
    P(repetition_penalty=1.3, logprobs=2),
    P(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, top_p=0.95, seed=5),
    P(temperature=1.0, min_tokens=4, seed=6, logprobs=1),
    P(temperature=1.0, top_k=1, seed=7),  # equals greedy
    P(min_tokens=3, presence_penalty=0.4),  # greedy with suppression and a penalty
]


def step_logits(i: int, t: int, vocab: int) -> np.ndarray:
    """Request ``i``'s logits ``(vocab,)`` at its step ``t``: some rows with -inf entries, some with a 3-way tie."""
    x = np.random.default_rng(1000 * i + t).normal(size=vocab).astype(np.float32) * 3
    if i % 3 == 1:
        x[np.random.default_rng(i).random(vocab) < 0.5] = -np.inf
    if i % 4 == 2:
        x[[11, 5, 77]] = x.max() + 1  # argmax ties break to the lowest id (5)
    return x


class Seat:
    """What ``SlotSampler`` reads of a ``Decoding``: its kind, consts and state."""

    def __init__(self, i: int, params: GenerateParams, vocab: int = V):
        self.i, self.params, self.vocab = i, params, vocab
        self.kind = SamplerKind.of(params, STOPS)
        self.consts = sampler_consts(params, vocab, STOPS)
        self.state = sampler_state(self.kind, params.seed, [i, 2 * i + 1, 50], vocab)


def alone(seat: Seat, steps: int):
    """``sample_step`` of one request: per step ``(token, logprob arrays as numpy)``, and the last state."""
    state, out = seat.state, []
    for t in range(steps):
        tok, state, lp = sample_step(seat.kind, mx.array(step_logits(seat.i, t, seat.vocab))[None], seat.consts, state)
        mx.eval(tok, *state, *lp)
        out.append((tok.item(), tuple(np.array(a) for a in lp)))
    return out, state


def batched(phases, B: int):
    """``SlotSampler`` over ``phases``: ``(steps, seats per slot)``; a seat object staying in its slot
    continues, a new one is admitted. Returns per request ``(token, logprob arrays)`` per step and its
    state row when it last ran."""
    ss, out, last, local = SlotSampler(B), {}, {}, {}
    for steps, seats in phases:
        assert len(seats) == B
        for _ in range(steps):
            vocab = next(s.vocab for s in seats if s)
            rows = [step_logits(s.i, local.get(s.i, 0), vocab) if s else np.zeros(vocab, np.float32) for s in seats]
            logits = mx.array(np.stack(rows))
            tok, lp = ss.step(seats, logits, mx.argmax(logits, axis=-1).astype(mx.uint32))
            mx.eval(tok, *ss.arrays(), *lp.arrays)
            for b, s in enumerate(seats):
                if s is None:
                    continue
                local[s.i] = local.get(s.i, 0) + 1
                out.setdefault(s.i, []).append((tok[b].item(), tuple(np.array(a) for a in lp.get(b))))
                last[s.i] = tuple(np.array(x[b]) for x in ss.state)
    return out, last


def assert_rows_equal(seats, out, last, where):
    for s in seats:
        ref, state = alone(s, len(out[s.i]))
        for t, ((tok, lp), (rtok, rlp)) in enumerate(zip(out[s.i], ref)):
            assert tok == rtok, f"{where}: request {s.i} step {t}"
            assert len(lp) == len(rlp) and all(np.array_equal(a, r) and a.dtype == r.dtype for a, r in zip(lp, rlp)), (
                f"{where}: request {s.i} step {t} logprobs")
        key, seen, counts, n_out = last[s.i]
        assert np.array_equal(key, np.array(state.key)), f"{where}: request {s.i} key"
        if s.kind.penalties:
            assert np.array_equal(seen, np.array(state.seen)) and np.array_equal(counts, np.array(state.counts)), where
        if s.kind.suppress:
            assert int(n_out[0]) == state.n_out.item(), where


def test_mlx_random_per_row_ops_vectorize_exactly():
    """What ``_draw`` relies on: vmapped split / uniform are the per-row calls, and the inverse-CDF draw
    is ``mx.random.categorical`` on each row alone (masked rows, an all -inf row, a large vocabulary)."""
    for vocab in (V, 49152, 151936):
        B = 6
        keys = mx.stack([mx.random.key(s) for s in range(B)])
        x = mx.array(np.random.default_rng(vocab).normal(size=(B, vocab)).astype(np.float32) * 4)
        x = mx.where(mx.array(np.random.default_rng(1).random((B, vocab)) < 0.6) & (mx.arange(B)[:, None] % 2 == 1),
                     -mx.inf, x)
        x[4] = -mx.inf
        split, uniform, drawn = _split_rows(keys), _uniform_rows(keys), _draw(x, keys)
        w = mx.exp(x - mx.max(x, axis=-1, keepdims=True))
        sums = _row_sums(w)  # bitwise the whole-array sum of each row on the CPU (not so for MLX's CUDA reduction)
        exact = mx.default_device() == mx.cpu
        for b in range(B):
            if exact:
                assert mx.array_equal(sums[b, 0], mx.sum(w[b]), equal_nan=True).item()  # row 4 (all -inf): NaN
                assert drawn[b].item() == mx.random.categorical(x[b : b + 1], key=keys[b]).item(), (vocab, b)
            assert mx.array_equal(split[b], mx.random.split(keys[b])).item()
            assert mx.array_equal(uniform[b], mx.random.uniform(shape=(1,), key=keys[b])).item()


def test_neutral_penalties_and_suppress_leave_logits_bitwise_unchanged():
    x = np.random.default_rng(0).normal(size=(4, 512)).astype(np.float32) * 50
    x[:, :6] = [0.0, -0.0, -np.inf, np.inf, 1e-38, -3e38]
    x = mx.array(x)
    seen = mx.array(np.random.default_rng(1).random((4, 512)) < 0.5)
    counts = mx.array(np.random.default_rng(2).integers(0, 5, (4, 512)).astype(np.float32))
    rep, zero = mx.ones((4, 1)), mx.zeros((4, 1))
    y = mx.where(seen, mx.where(x > 0, x / rep, x * rep), x)  # sample_batch's penalty arithmetic
    y = y - zero * (counts > 0) - zero * counts
    y = mx.where(mx.zeros((4, 512), mx.bool_) & (mx.zeros((4, 1), mx.int32) < mx.full((4, 1), 5, mx.int32)), -mx.inf, y)
    assert np.array_equal(np.array(y).view(np.uint32), np.array(x).view(np.uint32))


@pytest.mark.parametrize("vocab", [V, 49152])
def test_batched_rows_equal_each_request_alone_in_any_composition(vocab):
    seats = [Seat(i, p, vocab) for i, p in enumerate(MIXED)]
    compositions = {
        "in order": [(6, seats)],
        "reversed, idle slots between": [(6, [s for s in seats[::-1] for s in (s, None)])],
        "two slots, swapped in": [(6, seats[:2]), (6, seats[2:4]), (6, seats[4:6]), (6, seats[6:8]), (6, seats[8:10]),
                                  (6, [seats[10], None])],
    }
    for where, phases in compositions.items():
        B = len(phases[0][1])
        out, last = batched(phases, B)
        assert_rows_equal([s for _, ss in phases for s in ss if s is not None], out, last, where)
    # each alone in one slot; then a mid-run admission next to rows that continue (the slot keeps a
    # stale state from its last occupant, overwritten on admission)
    for s in seats:
        out, last = batched([(5, [s])], 1)
        assert_rows_equal([s], out, last, f"alone {s.i}")
    fresh = [Seat(i, p, vocab) for i, p in enumerate(MIXED)]  # the same requests, admitted again from the start
    out, last = batched([(4, [seats[3], seats[7], seats[8]]), (5, [fresh[0], seats[7], fresh[5]])], 3)
    assert len(out[7]) == 9 and len(out[0]) == 5
    ref, _ = alone(fresh[5], 5)
    assert [t for t, _ in out[5]] == [t for t, _ in ref]
    assert_rows_equal([seats[7], fresh[0]], out, last, "mid-run admission")


def test_batch_kind_is_the_union_and_plain_greedy_builds_nothing():
    kinds = [Seat(i, p).kind for i, p in enumerate(MIXED)]
    union = BatchKind.of(kinds)
    assert union == BatchKind(greedy=True, sampled=True, unfiltered=True, filters=True, penalties=True, suppress=True,
                              logprobs=(0, 1, 2, 3, 5))
    assert BatchKind.of(kinds[:1]).plain and not BatchKind.of(kinds[:2]).plain
    assert BatchKind.of([kinds[4]]) == BatchKind(greedy=False, sampled=True, filters=True)
    ss = SlotSampler(3)
    seats = [Seat(0, P()), None, Seat(9, P(max_tokens=5))]
    logits = mx.array(np.stack([step_logits(0, 0, V)] * 3))
    argmax = mx.argmax(logits, axis=-1).astype(mx.uint32)
    tok, lp = ss.step(seats, logits, argmax)
    assert tok is argmax and lp.arrays == () and lp.get(0) == ()  # the step's own argmax, nothing else
    assert ss.state.seen.shape == (3, 1) and ss.consts.suppress.shape == (3, 1)  # no (B, vocab) state
    seats[1] = Seat(2, MIXED[2])  # a sampled request takes the idle slot; a penalty one replaces slot 0
    tok, _ = ss.step(seats, logits, argmax)
    assert tok is not argmax and ss.kind == BatchKind(greedy=True, sampled=True, unfiltered=True)
    seats[0] = Seat(6, MIXED[6])
    ss.step(seats, logits, argmax)
    assert ss.kind.penalties and ss.state.seen.shape == (3, V)
    seats[0] = seats[1] = None  # they leave: back to the plain argmax
    assert ss.step(seats, logits, argmax)[0] is argmax


# ---------------------------------------------------------------- BatchEngine against Engine.generate

ENGINE_MIXED = [
    P(max_tokens=12),
    P(max_tokens=12, temperature=0.8, seed=21),
    P(max_tokens=12, temperature=0.8, top_p=0.9, seed=22, logprobs=3),
    P(max_tokens=12, temperature=1.1, top_k=6, seed=23, logprobs=0),
    P(max_tokens=12, temperature=0.9, min_p=0.08, seed=24),
    P(max_tokens=12, repetition_penalty=1.4, logprobs=1),
    P(max_tokens=12, temperature=0.8, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.2,
      top_p=0.95, seed=25),
    # stop ids that come quickly at temperature 1.5, held back until min_tokens
    P(max_tokens=12, temperature=1.5, min_tokens=5, stop_token_ids=tuple(range(0, VOCAB, 4)), seed=26, logprobs=2),
    P(max_tokens=12, temperature=1.5, stop_token_ids=tuple(range(0, VOCAB, 4)), seed=27),
    P(max_tokens=7, logprobs=4),
]


def test_batch_engine_mixed_sampling_equals_sequential(llama):
    engine = engine_for(llama)
    reqs = [Request(i, PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(ENGINE_MIXED)]
    ref = {r.tag: engine.generate(r.prompt_ids, r.params) for r in reqs}
    # the scenarios happen: min_tokens holds stop ids back, the same stops without it end early
    assert ref[7].finish_reason == "stop" and len(ref[7].token_ids) >= 5
    assert ref[8].finish_reason == "stop" and len(ref[8].token_ids) < 5
    assert len({tuple(g.token_ids) for g in ref.values()}) == len(reqs)
    for B, order in ((4, reqs), (3, reqs[::-1]), (16, reqs[3:] + reqs[:3])):  # slots reused / all at once
        got = run_all(BatchEngine(engine, B, MAX_POSITIONS), order)
        for r in reqs:
            assert isinstance(got[r.tag], Generation)
            assert_same_generation(ref[r.tag], got[r.tag], f"B={B} request {r.tag}")


@pytest.mark.parametrize("B", [2, 5])
def test_batch_engine_sampled_request_independent_of_neighbours(llama, B):
    engine = engine_for(llama)
    x = Request("x", PROMPTS[2], ENGINE_MIXED[2])
    others = [Request(i, PROMPTS[4 + i % 4], ENGINE_MIXED[(3 * i) % len(ENGINE_MIXED)]) for i in range(6)]
    runs = [run_all(BatchEngine(engine, B, MAX_POSITIONS), batch)["x"]
            for batch in ([x], [*others[:3], x], [others[5], x, *others[1:5]])]
    for g in runs[1:]:
        assert g.token_ids == runs[0].token_ids and g.logprobs == runs[0].logprobs
        assert g.top_token_ids == runs[0].top_token_ids and g.top_logprobs == runs[0].top_logprobs
