"""The compiled decode-closure set: same tokens as eager decode for every cache kind, no retraces,
closures reused across prompts, memory flat over many prompts."""

import logging

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_lm_parity import randomize
from pipeline import load_model
from pipeline.engine.compiled import cpu_compile_blocker
from pipeline.engine import Engine, GenerateParams
from pipeline.jobspec import CacheSpec
from pipeline.models import build_model
from pipeline.models.gemma3_text import Model as Gemma3, ModelArgs as Gemma3Args
from test_parity_gemma3 import GEMMA3 as _GEMMA3

# without a compiler MLX hands back every step uncompiled and the engine decodes eagerly (test_cpu_fast_path.py checks that)
pytestmark = pytest.mark.skipif(cpu_compile_blocker() is not None, reason=f"no compiled decode here: {cpu_compile_blocker()}")

GEMMA3 = {**_GEMMA3, "head_dim": 32, "query_pre_attn_scalar": 32}  # quantized caches need groups of >= 32

STEPS = 200
# cache kinds: (id, CacheSpec); the rotating windows are shorter than the prompts used with them
KINDS = [
    ("full", CacheSpec()),
    ("rotating", CacheSpec(max_kv_size=32)),
    # Compiled decode is not bitwise eager decode (MLX's fused CPU kernels round differently: logprobs differ
    # by up to 8e-6 with a float cache; with a quantized cache a flipped quantization level propagates: with
    # 8-bit KV on the default model, median 1e-3, up to 0.05 over 200 steps). So with a quantized cache the
    # tokens must agree up to a near-tie of eager's (``assert_same_up_to_a_near_tie``). With prefix caching
    # on, the prompt below prefills in 32-token chunks and meets a near-tie at token 8; caching off for q8.
    ("q8", CacheSpec(kv_bits=8, kv_group_size=32, prefix_cache_gb=0)),
    ("q4", CacheSpec(kv_bits=4, kv_group_size=32)),
    ("rotating-q8", CacheSpec(max_kv_size=32, kv_bits=8, kv_group_size=32)),
]


def eager_and_compiled(model, eos, context, spec, prompt, steps, **params):
    eager = Engine(model, eos, context, cache_spec=spec, compile=False)
    compiled = Engine(model, eos, context, cache_spec=spec, compile=True)
    p = GenerateParams(max_tokens=steps, ignore_eos=True, **params)
    return eager.generate(prompt, p), compiled.generate(prompt, p), compiled


@pytest.fixture(scope="module")
def gemma3():
    model = Gemma3(Gemma3Args.from_dict(GEMMA3))
    randomize(model, seed=3)
    return build_model(GEMMA3, dict(tree_flatten(model.parameters())))


@pytest.mark.parametrize("kind, spec", KINDS, ids=[k for k, _ in KINDS])
def test_default_model_compiled_equals_eager(default_model_path, llamacpp_cases, kind, spec):
    lm = load_model(path=default_model_path)
    prompt = llamacpp_cases[5]["chat_ids"]  # 60 tokens: longer than the rotating window
    eager, compiled, engine = eager_and_compiled(
        lm.model, lm.tokenizer.eos_token_ids, 8192, spec, prompt, STEPS, logprobs=2)
    assert compiled.compiled and not eager.compiled
    assert len(compiled.token_ids) == STEPS
    if spec.kv_bits:
        assert_same_up_to_a_near_tie(eager, compiled)
    else:
        assert compiled.token_ids == eager.token_ids
    assert engine.trace_count == 1


# Largest logprob difference (nats) between compiled and eager decoding with a quantized KV cache, and the
# top-2 gap of eager's under which their greedy tokens may part: measured on the default model with 8-bit KV
# over 200 steps (mlx 0.32.4, 2-core x86_64, 2026-12-07): median 1e-3, largest 0.05; a decode step that
# computes something else (a wrong position, cache row or layer) differs by far more than this within a few steps.
QUANTIZED_TOLERANCE = 0.1


def assert_same_up_to_a_near_tie(eager, compiled, tol: float = QUANTIZED_TOLERANCE) -> None:
    """Greedy tokens agree until eager's top-2 logprobs are within ``tol`` of each other (there the compiled
    step may take the runner-up); every logprob up to there agrees within ``tol``."""
    part = next((i for i, (a, b) in enumerate(zip(eager.token_ids, compiled.token_ids)) if a != b), None)
    n = len(eager.token_ids) if part is None else part
    worst = max(abs(a - b) for a, b in zip(eager.logprobs[:n], compiled.logprobs[:n]))
    assert worst < tol, (worst, n)
    if part is not None:
        top = eager.top_logprobs[part]
        assert top[0] - top[1] < tol, (part, top[:2])
        assert compiled.token_ids[part] == eager.top_token_ids[part][1], part


@pytest.mark.parametrize("kind, spec", KINDS, ids=[k for k, _ in KINDS])
def test_tiny_gemma3_compiled_equals_eager(gemma3, kind, spec):
    prompt = list(range(3, 43))  # 40 tokens: longer than the 16-position sliding window
    eager, compiled, engine = eager_and_compiled(gemma3, [], 512, spec, prompt, STEPS)
    assert compiled.compiled
    assert compiled.token_ids == eager.token_ids
    assert len(set(compiled.token_ids)) > 5
    assert engine.trace_count == 1


def test_sampling_compiled_equals_eager(gemma3):
    prompt = list(range(3, 43))
    eager, compiled, _ = eager_and_compiled(gemma3, [], 512, None, prompt, 64, temperature=0.8, seed=11)
    assert compiled.compiled and compiled.token_ids == eager.token_ids


SAMPLERS = [
    ("penalties-greedy", dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)),
    ("top-k-top-p-min-p", dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=5)),
    ("all", dict(temperature=0.7, top_k=40, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3,
                 min_tokens=10, seed=7, logprobs=3)),
    ("min-tokens-logprobs-greedy", dict(min_tokens=20, logprobs=0)),
]


@pytest.mark.parametrize("name, params", SAMPLERS, ids=[n for n, _ in SAMPLERS])
def test_sampler_kinds_compiled_equal_eager(gemma3, name, params):
    """Every sampler variant runs inside the compiled step and gives eager's tokens and logprobs."""
    prompt = list(range(3, 43))
    eager = Engine(gemma3, [], 512, compile=False)
    compiled = Engine(gemma3, [], 512, compile=True)
    p = GenerateParams(max_tokens=48, **params)
    a, b = eager.generate(prompt, p), compiled.generate(prompt, p)
    assert b.compiled and b.token_ids == a.token_ids
    assert len(set(b.token_ids)) > 5
    if p.logprobs is not None:
        assert len(b.logprobs) == len(b.token_ids) == len(b.top_token_ids)
        assert all(len(t) == p.logprobs for t in b.top_token_ids)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert b.top_token_ids == a.top_token_ids
    assert compiled.trace_count == 1


def test_no_retrace_and_closures_reused_across_prompts(gemma3):
    engine = Engine(gemma3, [], 512)
    engine.generate(list(range(3, 20)), GenerateParams(max_tokens=30, ignore_eos=True))
    assert (engine.trace_count, engine.closure_count) == (1, 1)
    for n in (5, 40, 12, 70):  # same capacity bucket: same closure, no new trace
        g = engine.generate(list(range(3, 3 + n)), GenerateParams(max_tokens=30, ignore_eos=True))
        assert g.compiled
    assert (engine.trace_count, engine.closure_count) == (1, 1)
    engine.generate(list(range(3, 300)), GenerateParams(max_tokens=30, ignore_eos=True))  # next bucket
    assert (engine.trace_count, engine.closure_count) == (2, 2)


def test_reused_engine_equals_fresh_engine(gemma3):
    """Results do not depend on what ran before: a bigger earlier prompt leaves larger buffers."""
    engine = Engine(gemma3, [], 512)
    engine.generate(list(range(3, 300)), GenerateParams(max_tokens=20, ignore_eos=True))
    prompt, params = list(range(7, 30)), GenerateParams(max_tokens=40, ignore_eos=True)
    assert engine.generate(prompt, params).token_ids == Engine(gemma3, [], 512).generate(prompt, params).token_ids


def test_memory_flat_over_many_prompts(gemma3):
    engine = Engine(gemma3, [], 512, cache_spec=CacheSpec(max_kv_size=32, kv_bits=8, kv_group_size=32))
    active = []
    for i in range(200):
        prompt = [(i * 7 + j) % 120 + 3 for j in range(10 + i % 30)]
        g = engine.generate(prompt, GenerateParams(max_tokens=8, ignore_eos=True))
        assert g.compiled
        active.append(mx.get_active_memory())
    tail = active[10:]
    assert max(tail) - min(tail) <= 64 * 1024, (min(tail), max(tail))
    assert engine.closure_count == 1 and engine.trace_count == 1


def test_quantized_start_inside_generation_falls_back_once(gemma3, caplog):
    engine = Engine(gemma3, [], 512, cache_spec=CacheSpec(kv_bits=8, kv_group_size=32, quantized_kv_start=50,
                                                             prefix_cache_gb=0))  # no prefix-cache note
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        for _ in range(3):
            g = engine.generate(list(range(3, 20)), GenerateParams(max_tokens=40, ignore_eos=True))
            assert not g.compiled
    assert len([r for r in caplog.records if "quantized_kv_start" in r.getMessage()]) == 1
    # once the cache is quantized before decode starts, the compiled step runs
    assert engine.generate(list(range(3, 60)), GenerateParams(max_tokens=10, ignore_eos=True)).compiled


def test_compile_off(gemma3):
    g = Engine(gemma3, [], 512, compile=False).generate([3, 4, 5], GenerateParams(max_tokens=5))
    assert not g.compiled


def test_one_token_reports_the_engines_decode_path(gemma3):
    """max_tokens 1 runs no decode step: the row reports the path a decode would have taken, the engine's
    compile setting (it said eager on a compiled engine, which README reserves for fallbacks and compile off)."""
    p = GenerateParams(max_tokens=1)
    assert Engine(gemma3, [], 512, compile=True).generate([3, 4, 5], p).compiled
    assert not Engine(gemma3, [], 512, compile=False).generate([3, 4, 5], p).compiled
