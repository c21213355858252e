"""Continuous batching (``pipeline.engine.batch.BatchEngine``) against sequential ``Engine.generate``: greedy
paths through every cache kind (full, rotating with prompts longer than the window, quantized 8/4-bit,
rotating + quantized, Gemma 3's sliding/global mix), rows of very different lengths through reused
slots, stop strings / stop ids / min_tokens / logprobs per row, seeded sampling independent of the
batch's composition, per-request errors, compiled vs eager, and the real default model.

Tiny random-weight models carry the logic; the default model checks fidelity on real weights (kept
short: it decodes ~10 tokens/s per row on a 2-core CPU)."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import numpy as np
import pytest

from mlx_lm_parity import reference_model
from pipeline import load_model
from pipeline.engine.batch import BatchEngine, Request
from pipeline.engine.compiled import cpu_compile_blocker
from pipeline.engine import Engine, GenerateParams, Generation
from pipeline.errors import RowError
from pipeline.jobspec import CacheSpec
from pipeline.models import build_model
from tiny_model import write_tiny_model

LLAMA = {
    "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 96,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "tie_word_embeddings": True,
}
GEMMA3 = {  # layers: sliding (window 16), global, sliding, global
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 96,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 64, "sliding_window": 16, "sliding_window_pattern": 2,
    "max_position_embeddings": 512,
}
VOCAB = 96
NO_EOS = [VOCAB]  # outside the vocabulary: the tiny models never stop early
CONTEXT = 512
PREFILL_STEP = 16  # prompts up to 40 tokens: chunked prefill in the batch-1 engine too
MAX_POSITIONS = 64

# A divergence between batched and sequential greedy tokens is accepted only at a step where the
# sequential top-2 log-probabilities are closer than this (a near tie that last-bit differences of
# the batched matmul shapes may flip). Measured on this machine: the tiny models' batched logprobs
# equal the sequential ones exactly (difference 0.0) for every cache kind, the smallest top-2 gap on
# their paths was 1.9e-3, so no divergence was ever excused.
NEAR_TIE = 1e-4
LOGPROB_ATOL = 1e-4


def prompts_of(lengths, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, VOCAB, n)] for n in lengths]


# 1..40 tokens in no particular order: several longer than the rotating windows (8, 12, 16) used below
LENGTHS = [23, 1, 40, 9, 31, 5, 17, 12]
PROMPTS = prompts_of(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def llama():
    _, weights, config = reference_model(LLAMA, seed=0)
    return build_model(config, weights)


@pytest.fixture(scope="module")
def gemma3():
    _, weights, config = reference_model(GEMMA3, seed=1)
    return build_model(config, weights)


def engine_for(model, spec=None, compile=True, context=CONTEXT, eos=NO_EOS, tokenizer=None) -> Engine:
    return Engine(model, eos, context, prefill_step_size=PREFILL_STEP, cache_spec=spec, compile=compile,
                  tokenizer=tokenizer)


def run_all(be: BatchEngine, requests) -> dict:
    """``tag -> Generation | RowError``; asserts every request came back exactly once."""
    requests = list(requests)
    out = list(be.run(requests))
    tags = [t for t, _ in out]
    assert sorted(map(repr, tags)) == sorted(repr(r.tag) for r in requests)
    assert len(set(map(repr, tags))) == len(tags)
    return dict(out)


def sequential(engine: Engine, requests) -> dict:
    return {r.tag: engine.generate(r.prompt_ids, r.params) for r in requests}


def assert_same_greedy(ref: Generation, got: Generation, where: str = "") -> None:
    """``got``'s tokens equal ``ref``'s (a sequential run with logprobs >= 2) up to the end, or up to a
    step where ``ref``'s top-2 logprobs are a near tie (after a flip there the paths are unrelated)."""
    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        if a != b:
            gap = ref.top_logprobs[i][0] - ref.top_logprobs[i][1]
            assert gap < NEAR_TIE, f"{where} step {i}: batched {b} != sequential {a}, top-2 gap {gap:.3g}"
            return
    assert got.token_ids == ref.token_ids, where
    assert (got.finish_reason, got.stop_token_id, got.stop_reason) == (
        ref.finish_reason, ref.stop_token_id, ref.stop_reason), where


def assert_same_generation(ref: Generation, got: Generation, where: str = "") -> None:
    """Everything but timings: ids, text, finish and stop fields, logprobs (close), top alternatives."""
    assert got.token_ids == ref.token_ids, where
    assert got.text == ref.text, where
    assert (got.finish_reason, got.stop_reason, got.stop_token_id, got.prompt_tokens) == (
        ref.finish_reason, ref.stop_reason, ref.stop_token_id, ref.prompt_tokens), where
    if ref.logprobs is None:
        assert got.logprobs is None and got.top_token_ids is None and got.top_logprobs is None, where
        return
    assert len(got.logprobs) == len(ref.logprobs), where
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=LOGPROB_ATOL, rtol=0, err_msg=where)
    assert got.top_token_ids == ref.top_token_ids, where
    if ref.top_logprobs and ref.top_logprobs[0]:
        np.testing.assert_allclose(got.top_logprobs, ref.top_logprobs, atol=LOGPROB_ATOL, rtol=0, err_msg=where)


# ------------------------------------------------------------------------------ 1. every cache kind

CACHE_CASES = {
    "full": ("llama", None),
    "rotating-8": ("llama", CacheSpec(max_kv_size=8)),
    "quantized-8bit": ("llama", CacheSpec(kv_bits=8, kv_group_size=64)),
    "quantized-4bit-g32": ("llama", CacheSpec(kv_bits=4, kv_group_size=32)),
    # the switch to quantized storage happens inside every prompt (all prompts >= 5 tokens)
    "quantized-4bit-start-in-prompt": ("llama", CacheSpec(kv_bits=4, kv_group_size=32, quantized_kv_start=5)),
    "rotating-quantized-8bit": ("llama", CacheSpec(max_kv_size=8, kv_bits=8)),
    "rotating-quantized-4bit": ("llama", CacheSpec(max_kv_size=12, kv_bits=4, kv_group_size=32)),
    "rotating-quantized-4bit-start-in-prompt": ("llama", CacheSpec(max_kv_size=12, kv_bits=4, kv_group_size=32,
                                                                   quantized_kv_start=5)),
    "gemma3": ("gemma3", None),
    "gemma3-quantized-8bit": ("gemma3", CacheSpec(kv_bits=8)),
    "gemma3-rotating-8": ("gemma3", CacheSpec(max_kv_size=8)),
}


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_greedy_batched_equals_sequential_for_each_cache_kind(request, case):
    family, spec = CACHE_CASES[case]
    model = request.getfixturevalue(family)
    engine = engine_for(model, spec)
    start = spec.quantized_kv_start if spec is not None else 0
    prompts = [p for p in PROMPTS if len(p) >= max(start, 1)]
    windows = [w for w in (spec.max_kv_size if spec else None, GEMMA3["sliding_window"] if family == "gemma3" else None)
               if w is not None]
    if windows:  # several slots hold prompts longer than the (smallest) window
        assert sum(len(p) > min(windows) for p in prompts) >= 3
    params = GenerateParams(max_tokens=14)
    reqs = [Request(i, p, params) for i, p in enumerate(prompts)]
    ref = sequential(engine, [Request(r.tag, r.prompt_ids, GenerateParams(max_tokens=14, logprobs=2)) for r in reqs])
    be = BatchEngine(engine, 3, MAX_POSITIONS)  # 3 slots for 7-8 requests: slots are reused
    got = run_all(be, reqs)
    for r in reqs:
        g = got[r.tag]
        assert isinstance(g, Generation) and g.prompt_tokens == len(r.prompt_ids)
        assert len(g.token_ids) == 14 and g.finish_reason == "length"
        assert_same_greedy(ref[r.tag], g, f"{case} request {r.tag} ({len(r.prompt_ids)} prompt tokens)")
    # the paths are not degenerate (otherwise equality would say little)
    assert len({tuple(g.token_ids) for g in got.values()}) == len(reqs)
    # the batch buffers are what kv_bytes() says: B x capacity x bytes per position, summed over layers
    nbytes = sum(sum(x.nbytes for x in b) if isinstance(b, tuple) else b.nbytes for b in be.buffers)
    assert be.kv_bytes() == nbytes


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32)])
def test_quantized_kv_start_beyond_prompt_runs(llama, bits, group):
    spec = CacheSpec(kv_bits=bits, kv_group_size=group, quantized_kv_start=32)
    be = BatchEngine(engine_for(llama, spec), 2, MAX_POSITIONS)
    got = run_all(be, [Request(i, p, GenerateParams(max_tokens=6)) for i, p in enumerate(PROMPTS[:3])])
    assert all(isinstance(g, Generation) and len(g.token_ids) == 6 for g in got.values())


def test_quantized_kv_start_beyond_prompt_matches_sequential(llama):
    spec = CacheSpec(kv_bits=8, kv_group_size=64, quantized_kv_start=40)
    engine = engine_for(llama, spec)
    params = GenerateParams(max_tokens=10, logprobs=2)
    reqs = [Request(i, p, params) for i, p in enumerate(PROMPTS) if len(p) < 30]
    ref = sequential(engine, reqs)
    got = run_all(BatchEngine(engine, 2, MAX_POSITIONS), reqs)
    for r in reqs:
        assert_same_generation(ref[r.tag], got[r.tag], f"request {r.tag}")


# ------------------------------------------------------------------- 2. rows of very different lengths


def test_rows_of_very_different_lengths_reuse_slots(llama):
    engine = engine_for(llama)
    rng = np.random.default_rng(7)
    max_tokens = [1, 20, 3, 1, 17, 8, 2, 20, 5, 11, 1, 14, 6]
    lengths = [1, 40, 2, 33, 7, 1, 25, 12, 40, 3, 18, 9, 29]
    reqs = [Request(("row", i, "s0"), [int(t) for t in rng.integers(0, VOCAB, n)], GenerateParams(max_tokens=m))
            for i, (n, m) in enumerate(zip(lengths, max_tokens))]
    ref = sequential(engine, reqs)
    for B in (1, 3, 16):  # one slot, fewer slots than requests, more slots than requests
        got = run_all(BatchEngine(engine, B, MAX_POSITIONS), iter(reqs))  # any iterable, pulled lazily
        for r in reqs:
            g = got[r.tag]
            assert len(g.token_ids) == r.params.max_tokens and g.finish_reason == "length"
            assert g.prompt_tokens == len(r.prompt_ids)
            assert g.token_ids == ref[r.tag].token_ids, (B, r.tag)


def test_a_row_ending_at_the_capacity_leaves_its_neighbours_alone(llama):
    """A row whose prompt + max_tokens is exactly the buffers' capacity (256 here) ends while another row
    goes on decoding: the idle slot's later writes stay inside its own buffer. Its position used to stay
    at the capacity, one past the end, so each later step wrote there: into the next slot's first
    position (the neighbour's tokens changed) or past the whole buffer (a crash)."""
    engine = engine_for(llama)
    rng = np.random.default_rng(3)
    full = Request("full", [int(t) for t in rng.integers(0, VOCAB, 250)], GenerateParams(max_tokens=6))
    other = Request("other", [int(t) for t in rng.integers(0, VOCAB, 12)], GenerateParams(max_tokens=24))
    ref = sequential(engine, [full, other])
    for order in ([full, other], [other, full]):  # the full row in the first slot, then in the last
        be = BatchEngine(engine, 2, 256)
        assert {k.capacity for k in be.kinds} == {256}
        got = run_all(be, order)
        assert got["full"].token_ids == ref["full"].token_ids
        assert got["other"].token_ids == ref["other"].token_ids, [r.tag for r in order]


def test_requests_are_pulled_only_when_a_slot_is_free(llama):
    engine = engine_for(llama)
    pulled = []

    def source():
        for i, p in enumerate(PROMPTS):
            pulled.append(i)
            yield Request(i, p, GenerateParams(max_tokens=3 + 2 * i))  # one request ends per step at most

    B, seen = 3, 0
    for tag, g in BatchEngine(engine, B, MAX_POSITIONS).run(source()):
        seen += 1
        if seen == 1:
            assert tag == 0 and len(pulled) == B + 1  # the first to end was replaced, nothing more
        assert len(pulled) - seen <= B
    assert seen == len(pulled) == len(PROMPTS)


def test_a_rows_ttft_starts_at_its_own_prefill(llama):
    """Slots admitted together are prefilled one per step while the others decode: a row's ttft_s and total_s
    count from its own prefill, not from when it took its slot (the wait for the others' prefills), so neither
    exceeds the time from its prefill's start to the run's end (times read around the call, no timed bound)."""
    import time

    engine = engine_for(llama, context=1024)
    be = BatchEngine(engine, 4, 512)
    starts: dict[int, float] = {}
    prefill = be._prefill

    def spy(group, g):  # calls through: records when each request's prefill began
        now = time.perf_counter()
        for d in group:
            starts[d.tag] = now
        return prefill(group, g)

    be._prefill = spy
    requests = [Request(i, p, GenerateParams(max_tokens=2)) for i, p in enumerate(prompts_of([400] * 4, seed=5))]
    out = run_all(be, requests)
    end = time.perf_counter()
    assert sorted(starts) == [0, 1, 2, 3]
    for tag, g in out.items():
        assert 0 < g.ttft_s <= g.total_s <= end - starts[tag], (tag, g.ttft_s, g.total_s, end - starts[tag])


def test_second_run_and_first_token_finishes(llama):
    engine = engine_for(llama)
    first = engine.generate(PROMPTS[0], GenerateParams(max_tokens=1)).token_ids[0]
    reqs = [
        Request("stop-at-first", PROMPTS[0], GenerateParams(max_tokens=8, stop_token_ids=(first,))),
        Request("one", PROMPTS[1], GenerateParams(max_tokens=1)),
        Request("long", PROMPTS[2], GenerateParams(max_tokens=12)),
        Request("mid", PROMPTS[3], GenerateParams(max_tokens=6)),
    ]
    ref = sequential(engine, reqs)
    be = BatchEngine(engine, 2, MAX_POSITIONS)
    runs = [run_all(be, reqs), run_all(be, reqs[::-1])]  # buffers (and stale slots) reused by the second
    for got in runs:
        g = got["stop-at-first"]
        assert (g.token_ids, g.finish_reason, g.stop_token_id, g.stop_reason) == ([], "stop", first, first)
        assert got["one"].token_ids == ref["one"].token_ids and len(got["one"].token_ids) == 1
        for tag in ("long", "mid"):
            assert got[tag].token_ids == ref[tag].token_ids


# ------------------------------------------------- 3. stop strings, stop ids, min_tokens, logprobs


@pytest.fixture(scope="module")
def tok_lm(tmp_path_factory):
    """The tiny random llama with the default model's real tokenizer (vocab 49152)."""
    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("tiny-batch") / "model")))


def chat_ids(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), parse_special=True)


def straddling_stop(tok, ids: list[int], k: int) -> str:
    """A 4-character stop string spanning the boundary of tokens ``k - 1`` and ``k`` of ``ids``'s text,
    not occurring earlier."""
    full, cut = tok.decode(ids), len(tok.decode(ids[:k]))
    assert len(tok.decode(ids[: k - 1])) <= cut - 2 and len(tok.decode(ids[: k + 1])) >= cut + 2
    stop = full[cut - 2 : cut + 2]
    assert full.find(stop) == cut - 2
    return stop


def test_stops_min_tokens_and_logprobs_per_row(tok_lm):
    tok = tok_lm.tokenizer
    engine = Engine(tok_lm.model, tok.eos_token_ids, tok_lm.engine.context_length, prefill_step_size=PREFILL_STEP,
                    tokenizer=tok)
    texts = ["Write a poem about the sea.", "What is 2+2?", "Name three colours.", "Hello there",
             "Tell me a joke.", "Why is the sky blue?", "Summarize the news."]
    ids = [chat_ids(tok, t) for t in texts]
    paths = [engine.generate(p, GenerateParams(max_tokens=20)).token_ids for p in ids]
    s0, s4 = straddling_stop(tok, paths[0], 5), straddling_stop(tok, paths[4], 3)
    s5 = straddling_stop(tok, paths[5], 2)
    P = GenerateParams
    reqs = [
        Request("stop-string+logprobs", ids[0], P(max_tokens=20, stop=(s0, "no such text"), logprobs=3)),
        Request("plain", ids[1], P(max_tokens=20)),
        Request("stop-id+logprobs0", ids[2], P(max_tokens=20, stop_token_ids=(paths[2][6],), logprobs=0)),
        Request("stop-id-after-min", ids[3], P(max_tokens=20, stop_token_ids=(paths[3][2],), min_tokens=6)),
        Request("stop-string-before-min", ids[4], P(max_tokens=12, stop=(s4,), min_tokens=8, logprobs=2)),
        Request("include-stop", ids[5], P(max_tokens=20, stop=(s5,), include_stop_str_in_output=True)),
        Request("stop-id-logprobs", ids[6], P(max_tokens=20, stop_token_ids=(paths[6][9],), logprobs=1)),
    ]
    ref = sequential(engine, reqs)
    # the scenarios happen: string stops mid-run (others continue), an id stop, min_tokens overriding one
    assert (ref["stop-string+logprobs"].finish_reason, ref["stop-string+logprobs"].stop_reason) == ("stop", s0)
    assert ref["plain"].finish_reason == "length" and len(ref["plain"].token_ids) == 20
    assert ref["stop-id+logprobs0"].stop_token_id == paths[2][6]
    assert len(ref["stop-id-after-min"].token_ids) >= 6 and paths[3][2] not in ref["stop-id-after-min"].token_ids[:6]
    assert ref["stop-string-before-min"].token_ids[:4] == paths[4][:4]
    assert ref["include-stop"].text.endswith(s5)
    got = run_all(BatchEngine(engine, 3, 96), reqs)
    for r in reqs:
        assert_same_generation(ref[r.tag], got[r.tag], r.tag)


# ------------------------------------------------------------------------------------ 4. sampling

SAMPLED = [
    GenerateParams(max_tokens=16, temperature=0.8, seed=11),
    GenerateParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=12),
    GenerateParams(max_tokens=16, temperature=0.8, top_k=5, min_p=0.05, seed=13, logprobs=2),
    GenerateParams(max_tokens=16, repetition_penalty=1.3),  # greedy with a penalty
    GenerateParams(max_tokens=16, temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5,
                   frequency_penalty=0.3, seed=14),
    GenerateParams(max_tokens=16),  # plain greedy neighbour
]


def test_sampling_is_reproducible_and_independent_of_the_batch(llama):
    engine = engine_for(llama)
    reqs = [Request(i, PROMPTS[i], p) for i, p in enumerate(SAMPLED)]
    ref = sequential(engine, reqs)
    # seeded sampling really samples: another seed gives other tokens
    other = engine.generate(PROMPTS[0], GenerateParams(max_tokens=16, temperature=0.8, seed=99)).token_ids
    assert other != ref[0].token_ids
    be4 = BatchEngine(engine, 4, MAX_POSITIONS)
    a, b = run_all(be4, reqs), run_all(be4, reqs)
    c = run_all(BatchEngine(engine, 2, MAX_POSITIONS), reqs)
    for r in reqs:
        assert a[r.tag].token_ids == b[r.tag].token_ids == c[r.tag].token_ids, r.tag
        assert_same_generation(ref[r.tag], a[r.tag], f"sampled request {r.tag}")
    # the same sampled request next to other neighbours (and in another slot) draws the same tokens
    x = Request("x", PROMPTS[1], SAMPLED[1])
    fillers = [Request(f"n{i}", PROMPTS[4 + i], GenerateParams(max_tokens=3 + i, temperature=1.0, seed=i))
               for i in range(3)]
    for batch in ([x], [fillers[0], x], [fillers[2], fillers[1], fillers[0], x]):
        assert run_all(be4, batch)["x"].token_ids == ref[1].token_ids


# ---------------------------------------------------------------------- 5. composition independence


def test_greedy_request_does_not_depend_on_its_neighbours(llama, gemma3):
    for model in (llama, gemma3):
        engine = engine_for(model)
        be = BatchEngine(engine, 4, MAX_POSITIONS)
        x = Request("x", PROMPTS[4], GenerateParams(max_tokens=16, logprobs=1))
        others = [Request(i, p, GenerateParams(max_tokens=2 + 3 * i)) for i, p in enumerate(PROMPTS[5:])]
        runs = [run_all(be, batch)["x"] for batch in
                ([x], [others[0], x], [*others, x], [others[2], x, others[1], others[0]])]
        for g in runs[1:]:  # bitwise: the arithmetic of a row does not depend on the other rows
            assert g.token_ids == runs[0].token_ids
            assert g.logprobs == runs[0].logprobs


# -------------------------------------------------------------------------------------- 7. errors


def test_bad_requests_fail_alone(llama):
    engine = engine_for(llama, context=64)
    good = [Request(f"ok{i}", p, GenerateParams(max_tokens=5 + i)) for i, p in enumerate(PROMPTS[:4])]
    bad = {
        "empty": (Request("empty", [], GenerateParams(max_tokens=4)), "no tokens"),
        "fills-context": (Request("fills-context", list(range(64)), GenerateParams(max_tokens=4)), "context"),
        "longer-than-context": (Request("longer-than-context", list(range(70)), GenerateParams()), "context"),
        "max-tokens-0": (Request("max-tokens-0", [1, 2], GenerateParams(max_tokens=0)), "max_tokens"),
        "over-capacity": (Request("over-capacity", list(range(30)), GenerateParams(max_tokens=20)), "capacity"),
    }
    reqs = [good[0], bad["empty"][0], good[1], bad["fills-context"][0], bad["longer-than-context"][0],
            good[2], bad["max-tokens-0"][0], bad["over-capacity"][0], good[3]]
    ref = sequential(engine, good)
    got = run_all(BatchEngine(engine, 2, 48), reqs)
    for tag, (_, match) in bad.items():
        assert isinstance(got[tag], RowError), tag
        assert match in str(got[tag]), (tag, str(got[tag]))
    for r in good:
        assert got[r.tag].token_ids == ref[r.tag].token_ids
    # a batch of nothing but bad requests ends cleanly
    only_bad = run_all(BatchEngine(engine, 2, 48), [b for b, _ in bad.values()])
    assert all(isinstance(v, RowError) for v in only_bad.values())


def test_max_positions_rejects_only_requests_that_need_more(llama):
    engine = engine_for(llama, context=64)
    reqs = [Request("fits", list(range(1, 31)), GenerateParams(max_tokens=18)),      # 48 positions
            Request("one-more", list(range(1, 31)), GenerateParams(max_tokens=19)),  # 49
            Request("context-capped", list(range(1, 61)), GenerateParams(max_tokens=100))]  # 60 + 4
    got = run_all(BatchEngine(engine, 2, 48), reqs)
    assert len(got["fits"].token_ids) == 18
    assert isinstance(got["one-more"], RowError) and "48" in str(got["one-more"])
    assert isinstance(got["context-capped"], RowError)
    got = run_all(BatchEngine(engine, 2, 64), reqs)
    g = got["context-capped"]  # max_tokens is capped by the context first, as in sequential mode
    assert len(g.token_ids) == 4 and g.finish_reason == "length"
    assert g.token_ids == engine.generate(reqs[2].prompt_ids, reqs[2].params).token_ids


def test_empty_stop_string_is_a_request_error(tok_lm):
    tok = tok_lm.tokenizer
    engine = Engine(tok_lm.model, tok.eos_token_ids, 512, tokenizer=tok)
    ids = chat_ids(tok, "Hi")
    got = run_all(BatchEngine(engine, 2, 64), [Request("bad", ids, GenerateParams(max_tokens=3, stop=("",))),
                                               Request("ok", ids, GenerateParams(max_tokens=3))])
    assert isinstance(got["bad"], RowError) and len(got["ok"].token_ids) == 3
    with pytest.raises(RowError):  # the same request fails in sequential mode too
        engine.generate(ids, GenerateParams(max_tokens=3, stop=("",)))


# ------------------------------------------------------------------------------ 8. compiled vs eager


@pytest.mark.skipif(cpu_compile_blocker() is not None, reason=f"no compiled decode here: {cpu_compile_blocker()}")
def test_compiled_equals_eager_and_traces_once(llama):
    params = [GenerateParams(max_tokens=4 + (i * 5) % 13) for i in range(6)] + SAMPLED[:3]
    reqs = [Request(i, PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
    compiled, eager = (BatchEngine(engine_for(llama, compile=c), 3, MAX_POSITIONS) for c in (True, False))
    a, b = run_all(compiled, reqs), run_all(eager, reqs)
    assert compiled.compiled and not eager.compiled
    for r in reqs:
        assert a[r.tag].compiled and not b[r.tag].compiled
        assert a[r.tag].token_ids == b[r.tag].token_ids, r.tag
    assert compiled.trace_count == 1  # 9 requests through 3 slots, greedy and sampled rows: one trace
    run_all(compiled, reqs[::-1])
    assert compiled.trace_count == 1 and eager.trace_count == 0


# ----------------------------------------------------------------------------- 6. the default model

CHAT = ["What is the capital of France?", "Give me three tips for staying healthy.", "Write a haiku about autumn.",
        "Explain photosynthesis in one sentence.", "What is 12 times 7?", "Name a famous painter.",
        "Translate 'good morning' into Spanish.", "Why is the sky blue?"]
# Measured on the 2-core CPU (B=4, max_tokens 24): 8/8 completions identical to sequential decoding
# (max |logprob difference| 1.1e-5 along the paths, smallest top-2 gap 7e-3). One is allowed to differ.
MIN_IDENTICAL = 7


def test_default_model_batched_matches_sequential(default_model):
    tok = default_model.tokenizer
    engine = Engine(default_model.model, tok.eos_token_ids, default_model.engine.context_length, tokenizer=tok)
    params = GenerateParams(max_tokens=24)
    reqs = [Request(i, chat_ids(tok, p), params) for i, p in enumerate(CHAT)]
    ref = sequential(engine, reqs)
    be = BatchEngine(engine, 4, 128)
    got = run_all(be, reqs)
    identical = sum(got[r.tag].token_ids == ref[r.tag].token_ids and got[r.tag].text == ref[r.tag].text
                    and got[r.tag].finish_reason == ref[r.tag].finish_reason for r in reqs)
    assert identical >= MIN_IDENTICAL, f"{identical}/{len(reqs)} identical"
    assert any(g.finish_reason == "stop" for g in got.values())  # some rows end early and free their slot
    assert be.compiled == (cpu_compile_blocker() is None)  # eager where MLX cannot compile on the CPU
    assert be.trace_count == int(be.compiled)
    # real weights: a row alone in the batch gets bit-identical logprobs to the row among neighbours
    short = min(reqs, key=lambda r: len(got[r.tag].token_ids))
    x = Request("x", short.prompt_ids, GenerateParams(max_tokens=24, logprobs=1))
    alone = run_all(be, [x])["x"]
    crowded = run_all(be, [Request(i, reqs[i].prompt_ids, GenerateParams(max_tokens=4)) for i in (1, 3)] + [x])["x"]
    assert alone.token_ids == crowded.token_ids == got[short.tag].token_ids
    assert alone.logprobs == crowded.logprobs
