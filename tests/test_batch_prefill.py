"""Group prefill in the batched engine (``BatchEngine(prefill_batch=True)``, the GPU default): requests
admitted together run as one padded forward per length bucket, with the same results as sequential
decoding, results that do not depend on the neighbours of a request, and at most one prefill forward
between two decode steps while slots are decoding."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import pytest

from pipeline.engine import Engine, GenerateParams, Generation
from pipeline.engine.batch import BatchEngine, Request
from pipeline.jobspec import CacheSpec
from test_batch import (CHAT, CONTEXT, MIN_IDENTICAL, NO_EOS, assert_same_greedy, chat_ids, gemma3,  # noqa: F401
                        llama, prompts_of, run_all, sequential)

STEP = 64  # prefill_step_size and group_tokens: buckets 16, 32, 64 of 4, 2 and 1 rows; longer prompts alone
LENGTHS = [23, 1, 40, 9, 31, 5, 17, 12, 70, 16, 33, 2]
PROMPTS = prompts_of(LENGTHS, seed=3)
MAX_POSITIONS = 96


def engine_for(model, spec=None) -> Engine:
    return Engine(model, NO_EOS, CONTEXT, prefill_step_size=STEP, cache_spec=spec)


CASES = {
    "full": ("llama", None, {16: 4, 32: 2, 64: 1}),
    "rotating-32": ("llama", CacheSpec(max_kv_size=32), {16: 4, 32: 2}),  # a 64-token bucket would wrap the ring
    "quantized-8bit": ("llama", CacheSpec(kv_bits=8, kv_group_size=64), {}),  # always alone
    "gemma3": ("gemma3", None, {16: 4}),  # sliding window 16
}


@pytest.mark.parametrize("case", list(CASES))
def test_group_prefill_equals_sequential(request, case):
    family, spec, rows = CASES[case]
    engine = engine_for(request.getfixturevalue(family), spec)
    params = GenerateParams(max_tokens=10)
    reqs = [Request(i, p, params) for i, p in enumerate(PROMPTS)]
    ref = sequential(engine, [Request(r.tag, r.prompt_ids, GenerateParams(max_tokens=10, logprobs=2)) for r in reqs])
    be = BatchEngine(engine, 5, MAX_POSITIONS, prefill_batch=True, group_tokens=STEP)
    assert {n: be.prefill_rows(n) for n in rows} == rows
    got = run_all(be, reqs)
    for r in reqs:
        assert isinstance(got[r.tag], Generation)
        assert_same_greedy(ref[r.tag], got[r.tag], f"{case} request {r.tag} ({len(r.prompt_ids)} prompt tokens)")
    buckets = {be.prefill_bucket(len(p)) for p in PROMPTS}
    assert set(be.prefill_counts) == buckets
    assert None in buckets  # the 70-token prompt (and every prompt of a quantized cache) is prefilled alone
    if rows:  # several prompts shared a forward: fewer forwards than prompts
        assert sum(be.prefill_counts.values()) < len(PROMPTS)


def test_grouped_request_does_not_depend_on_its_neighbours(llama):
    engine = engine_for(llama)
    be = BatchEngine(engine, 4, MAX_POSITIONS, prefill_batch=True, group_tokens=STEP)
    x = Request("x", PROMPTS[3], GenerateParams(max_tokens=12, logprobs=1))  # 9 tokens: bucket 16, 4 rows
    same_bucket = [Request(i, p, GenerateParams(max_tokens=2 + i)) for i, p in enumerate(PROMPTS) if len(p) <= 16]
    runs = []
    for batch in ([x], [same_bucket[0], x], [*same_bucket[:3], x], [same_bucket[2], x, same_bucket[1]]):
        before = be.prefill_counts.get(16, 0)
        runs.append(run_all(be, batch)["x"])
        assert be.prefill_counts[16] == before + 1  # all admitted together: one forward
    for g in runs[1:]:  # bitwise: a prompt's row of the padded forward does not see the other rows
        assert g.token_ids == runs[0].token_ids
        assert g.logprobs == runs[0].logprobs


def test_one_prefill_forward_between_decode_steps(llama):
    """Once slots decode, a step's admissions wait for at most one prefill forward; at the start
    (nothing decoding) every free slot is filled at once."""
    engine = engine_for(llama)
    be = BatchEngine(engine, 4, MAX_POSITIONS, prefill_batch=True, group_tokens=STEP)
    events: list[str] = []
    prefill, step_fn = be._prefill, be._step_fn

    def counting_prefill(group, size):
        events.append("prefill")
        return prefill(group, size)

    def counting_step_fn():
        step = step_fn()

        def counted(*args):
            events.append("step")
            return step(*args)
        return counted

    be._prefill, be._step_fn = counting_prefill, counting_step_fn
    # two long requests decode throughout; the short ones end in pairs and are replaced by requests of
    # different buckets (5, 20, 40 tokens: buckets 16, 32, 64), which cannot share a forward
    lengths = [30, 31, 5, 20, 40, 6, 21, 41, 7, 22]
    reqs = [Request(i, p, GenerateParams(max_tokens=40 if i < 2 else 2))
            for i, p in enumerate(prompts_of(lengths, seed=5))]
    got = run_all(be, reqs)
    assert all(isinstance(g, Generation) and len(g.token_ids) == (40 if t < 2 else 2) for t, g in got.items())
    first_step = events.index("step")
    assert events[:first_step].count("prefill") == 3  # the start: [30, 31] (bucket 32, 2 rows), [5], [20]
    later = "".join("p" if e == "prefill" else "s" for e in events[first_step:])
    assert later.count("p") >= 5 and "pp" not in later


def test_admission_waits_for_slots_enough_to_fill_a_forward(llama):
    """16 slots, bucket-16 forwards of 4 rows: while slots decode, a forward waits for
    ``admit_at(16)`` = min(4, 16 // 8) = 2 free slots, unless every request left fits; rows ending one per
    step are admitted in pairs. The results stay the sequential ones."""
    engine = engine_for(llama)
    be = BatchEngine(engine, 16, MAX_POSITIONS, prefill_batch=True, group_tokens=STEP)
    assert be.admit_at(16) == 2 and be.admit_at(64) == 1 and be.admit_at(None) == 1
    groups: list[tuple[int, bool]] = []  # (requests in the forward, whether slots were decoding)
    prefill, step_fn = be._prefill, be._step_fn
    steps = [0]

    def counting_prefill(group, size):
        groups.append((len(group), steps[0] > 0))
        return prefill(group, size)

    def counting_step_fn():
        step = step_fn()

        def counted(*args):
            steps[0] += 1
            return step(*args)
        return counted

    be._prefill, be._step_fn = counting_prefill, counting_step_fn
    prompts = prompts_of([3 + i % 10 for i in range(23)], seed=9)  # bucket 16 each
    reqs = [Request(i, p, GenerateParams(max_tokens=2 + i)) for i, p in enumerate(prompts)]  # one ends per step
    got = run_all(be, reqs)
    ref = sequential(engine, reqs)
    for r in reqs:
        assert got[r.tag].token_ids == ref[r.tag].token_ids
    later = [n for n, decoding in groups if decoding]
    assert groups[:4] == [(4, False)] * 4  # the start fills every slot at once
    assert later and all(n >= 2 for n in later[:-1]), later  # pairs; the last may be the one request left
    assert sum(n for n, _ in groups) == len(reqs)


def test_default_model_group_prefill_matches_sequential(default_model):
    tok = default_model.tokenizer
    engine = Engine(default_model.model, tok.eos_token_ids, default_model.engine.context_length, tokenizer=tok,
                    prefill_step_size=128)
    params = GenerateParams(max_tokens=16)
    reqs = [Request(i, chat_ids(tok, p), params) for i, p in enumerate(CHAT)]
    ref = sequential(engine, reqs)
    be = BatchEngine(engine, 4, 128, prefill_batch=True, group_tokens=128)
    got = run_all(be, reqs)
    identical = sum(got[r.tag].token_ids == ref[r.tag].token_ids and got[r.tag].text == ref[r.tag].text for r in reqs)
    assert identical >= MIN_IDENTICAL, f"{identical}/{len(reqs)} identical"
    assert None not in be.prefill_counts and sum(be.prefill_counts.values()) < len(reqs)


def test_warm_up_lengths_cover_every_bucket(llama):
    engine = engine_for(llama)
    be = BatchEngine(engine, 4, MAX_POSITIONS, prefill_batch=True, group_tokens=STEP)
    assert be.warm_up_lengths() == [16, 32, 64]
    run_all(be, [Request(n, p, GenerateParams(max_tokens=3))
                 for n, p in zip(be.warm_up_lengths(), prompts_of(be.warm_up_lengths(), seed=7))])
    assert be.prefill_counts == {16: 1, 32: 1, 64: 1}
    assert BatchEngine(engine_for(llama, CacheSpec(max_kv_size=32)), 4, MAX_POSITIONS,
                       prefill_batch=True, group_tokens=STEP).warm_up_lengths() == [16, 32]
    assert BatchEngine(engine, 4, MAX_POSITIONS, prefill_batch=False).warm_up_lengths() == [8]
