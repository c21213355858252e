"""The sampler on hand-made logits vectors: the edge cases vLLM's SamplingParams users rely on, and
each filter and penalty against mlx-lm's own implementation (``mlx_lm.sample_utils``)."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import sample_utils

from pipeline.engine import GenerateParams
from pipeline.engine.sampler import (SamplerKind, adjusted_logits, draw, keep_mask, sample_step, sampler_consts,
                                     sampler_state, token_mass)

V = 64


def _logits(seed=0, dtype=mx.float32, scale=3.0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(1, V)) * scale).astype(dtype)


def _draw(logits, seed=0, prompt=(), suppress=(), n_out=0, **params):
    """One token (int) for ``logits`` with GenerateParams ``params`` and the request seed ``seed``."""
    p = GenerateParams(**params, seed=seed)
    kind = SamplerKind.of(p, suppress)
    consts = sampler_consts(p, logits.shape[-1], suppress)
    key, seen, counts, _ = sampler_state(kind, seed, list(prompt), logits.shape[-1])
    token, _, _ = sample_step(kind, logits, consts, (key, seen, counts, mx.array(n_out, dtype=mx.int32)))
    return token.item()


def _greedy(logits):
    return int(np.argmax(np.array(logits.astype(mx.float32))[0]))


def _kept(logits, top_k=0, top_p=1.0, min_p=0.0):
    p = GenerateParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    _, top_k_a, top_p_a, min_p_a, *_ = sampler_consts(p, logits.shape[-1], ())
    x = logits.astype(mx.float32)
    keep = keep_mask(x, *token_mass(x), top_k_a, top_p_a, min_p_a)
    return set(np.flatnonzero(np.array(keep)[0]).tolist())


def _finite(x):
    return set(np.flatnonzero(np.isfinite(np.array(x)[0])).tolist())


# --- edge cases from the field ------------------------------------------------------------------

EQUALS_GREEDY = [
    ("temperature 0 (no division by zero)", mx.float32, dict(temperature=0.0)),
    ("temperature 0 ignores filters", mx.float32, dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)),
    ("top_k=1, top_p=0.8 at temperature 0.01", mx.float32, dict(temperature=0.01, top_k=1, top_p=0.8)),
    ("top_k=1 at temperature 5", mx.float32, dict(temperature=5.0, top_k=1)),
    ("tiny top_p 1e-3", mx.float32, dict(temperature=1.0, top_p=1e-3)),
    ("tiny top_p 1e-3 with bfloat16 logits", mx.bfloat16, dict(temperature=1.0, top_p=1e-3)),
    ("min_p=1 keeps only the top", mx.float32, dict(temperature=1.0, min_p=1.0)),
    ("temperature 1e-45, whose 1 / t is inf in float32 (vLLM: below 1e-5 is greedy)", mx.float32,
     dict(temperature=1e-45)),
    ("temperature 9e-6 (vLLM: below 1e-5 is greedy)", mx.float32, dict(temperature=9e-6)),
]


@pytest.mark.parametrize("name, dtype, params", EQUALS_GREEDY, ids=[c[0] for c in EQUALS_GREEDY])
def test_equals_greedy(name, dtype, params):
    for s in range(8):
        logits = _logits(s, dtype)
        for seed in range(5):
            assert _draw(logits, seed=seed, **params) == _greedy(logits)


def test_bfloat16_tie_at_the_top_breaks_like_argmax():
    """bfloat16 logits often tie; greedy takes the lowest id, and so must top_k=1 / a tiny top_p."""
    x = np.full((1, V), -4.0, np.float32)
    x[0, [41, 7, 23]] = 2.5  # three-way tie at the max; argmax picks 7
    logits = mx.array(x).astype(mx.bfloat16)
    assert _greedy(logits) == 7
    for seed in range(20):
        assert _draw(logits, seed=seed, temperature=1.0, top_p=1e-3) == 7
        assert _draw(logits, seed=seed, temperature=0.7, top_k=1) == 7


def test_min_p_with_all_equal_logits_keeps_every_token():
    logits = mx.zeros((1, 8))
    assert _kept(logits, min_p=0.5) == set(range(8))
    assert _kept(logits, min_p=1.0) == set(range(8))
    drawn = {_draw(logits, seed=s, temperature=1.0, min_p=0.9) for s in range(200)}
    assert drawn == set(range(8))


def test_repetition_penalty_with_empty_context_is_a_noop():
    logits = _logits(3)
    for seed in range(10):
        for t in (0.0, 0.8):
            plain = _draw(logits, seed=seed, temperature=t)
            assert _draw(logits, seed=seed, temperature=t, repetition_penalty=1.8) == plain
            assert _draw(logits, seed=seed, temperature=t, presence_penalty=1.5, frequency_penalty=1.5) == plain


# --- each filter against mlx-lm's --------------------------------------------------------------

FILTERS = [
    ("top_k 1", dict(top_k=1), lambda lp: sample_utils.apply_top_k(lp, 1)),
    ("top_k 5", dict(top_k=5), lambda lp: sample_utils.apply_top_k(lp, 5)),
    ("top_k 63", dict(top_k=63), lambda lp: sample_utils.apply_top_k(lp, 63)),
    ("top_p 0.5", dict(top_p=0.5), lambda lp: sample_utils.apply_top_p(lp, 0.5)),
    ("top_p 0.9", dict(top_p=0.9), lambda lp: sample_utils.apply_top_p(lp, 0.9)),
    ("top_p 0.99", dict(top_p=0.99), lambda lp: sample_utils.apply_top_p(lp, 0.99)),
    ("min_p 0.05", dict(min_p=0.05), lambda lp: sample_utils.apply_min_p(lp, 0.05)),
    ("min_p 0.3", dict(min_p=0.3), lambda lp: sample_utils.apply_min_p(lp, 0.3)),
]


@pytest.mark.parametrize("name, params, reference", FILTERS, ids=[c[0] for c in FILTERS])
def test_filter_keeps_the_same_tokens_as_mlx_lm(name, params, reference):
    for s in range(6):
        logits = _logits(s, scale=1.0 + s)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        assert _kept(logits, **params) == _finite(reference(logprobs))


def test_top_k_then_top_p_renormalizes_like_vllm():
    """vLLM applies top_p to the distribution left after top_k (renormalized)."""
    x = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    assert _kept(mx.array(x), top_k=2, top_p=0.6) == {0, 1}  # 0.4/0.7 = 0.57 < 0.6: a second token is needed
    assert _kept(mx.array(x), top_k=2, top_p=0.5) == {0}
    assert _kept(mx.array(x), top_p=0.6) == {0, 1}  # without top_k: 0.4 < 0.6 too
    assert _kept(mx.array(x), top_p=0.75) == {0, 1, 2}


def test_sampled_tokens_stay_inside_the_filter():
    logits = _logits(5)
    allowed = _kept(logits, top_k=6, top_p=0.8)
    drawn = {_draw(logits, seed=s, temperature=1.0, top_k=6, top_p=0.8) for s in range(300)}
    assert drawn <= allowed and len(drawn) > 1


def test_temperature_sampling_follows_softmax():
    x = np.log(np.array([[0.5, 0.25, 0.15, 0.1]], np.float32))
    logits = mx.array(x * 2.0)  # at temperature 2 the distribution is softmax(x)
    counts = Counter(_draw(logits, seed=s, temperature=2.0) for s in range(2000))
    for tok, p in enumerate([0.5, 0.25, 0.15, 0.1]):
        assert abs(counts[tok] / 2000 - p) < 4 * math.sqrt(p * (1 - p) / 2000)


# --- penalties against mlx-lm's and by definition ------------------------------------------------

def test_repetition_penalty_matches_mlx_lm():
    logits = _logits(7)
    top = int(np.argmax(np.array(logits)))
    # the raw argmax is in the context, so the penalty must move the greedy pick off it
    context = [3, 9, 9, top, 40, 63, 0]
    ours_kind = SamplerKind(penalties=True)
    p = GenerateParams(repetition_penalty=1.7)
    consts = sampler_consts(p, V, ())
    state = sampler_state(ours_kind, 0, context, V)
    ours = adjusted_logits(ours_kind, logits, consts, state)
    reference = sample_utils.make_repetition_penalty(1.7, context_size=len(context))(mx.array(context), logits * 1)
    assert np.allclose(np.array(ours), np.array(reference))
    # and the greedy pick through sample_step is the reference's argmax, not the raw one
    token, _, _ = sample_step(ours_kind, logits, consts, state)
    assert token.item() == int(np.argmax(np.array(reference))) != top


def test_presence_and_frequency_penalties_by_definition():
    """OpenAI's definition: logit - presence * (count > 0) - frequency * count over generated ids."""
    x = np.zeros((1, 6), np.float32)
    x[0] = [3.0, 2.9, 2.5, 0.0, 0.0, 0.0]
    logits = mx.array(x)
    p = GenerateParams(presence_penalty=0.2, frequency_penalty=0.1)
    kind = SamplerKind.of(p, ())
    consts = sampler_consts(p, 6, ())
    state = sampler_state(kind, 0, [], 6)
    picks = []
    for _ in range(6):
        tok, state, _ = sample_step(kind, logits, consts, state)
        picks.append(tok.item())
    # 0 (3.0) -> 0 again at 2.7 < 2.9 -> 1 at 2.9 -> 0 at 2.8 vs 1 at 2.6 vs 2 at 2.5 -> ...
    expected, counts = [], Counter()
    for _ in range(6):
        adjusted = [x[0, i] - 0.2 * (counts[i] > 0) - 0.1 * counts[i] for i in range(6)]
        t = int(np.argmax(adjusted))
        expected.append(t)
        counts[t] += 1
    assert picks == expected and len(set(picks)) > 1


def test_min_tokens_masks_stop_ids_until_reached():
    x = np.zeros((1, 8), np.float32)
    x[0, 2] = 10.0  # id 2 (the "EOS") dominates
    logits = mx.array(x)
    for n_out, expect_eos in [(0, False), (2, False), (3, True), (7, True)]:
        tok = _draw(logits, suppress=(2, 5), n_out=n_out, min_tokens=3)
        assert (tok == 2) == expect_eos
        assert tok != 5


def test_logprobs_are_the_raw_distribution():
    logits = _logits(11, scale=2.0)
    p = GenerateParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4, seed=1)
    kind = SamplerKind.of(p, ())
    token, _, (chosen, top_ids, top_lp) = sample_step(kind, logits, sampler_consts(p, V, ()),
                                                       sampler_state(kind, 1, [1, 2, 3], V))
    ref = np.array(logits[0]) - np.log(np.exp(np.array(logits[0], np.float64)).sum())
    assert chosen.item() == pytest.approx(ref[token.item()], abs=1e-5)
    assert top_ids[0].tolist() == np.argsort(-ref)[:4].tolist()
    assert np.allclose(np.array(top_lp[0]), np.sort(ref)[::-1][:4], atol=1e-5)


def test_same_seed_same_draw_different_seed_different_draws():
    logits = _logits(2, scale=0.5)
    assert all(_draw(logits, seed=s, temperature=1.0) == _draw(logits, seed=s, temperature=1.0) for s in range(20))
    assert len({_draw(logits, seed=s, temperature=1.0) for s in range(20)}) > 5


def test_every_engine_setting_is_a_job_key():
    """The runner passes generation settings to the engine by name: none may be dropped silently."""
    import dataclasses

    from pipeline.jobspec import GenerationSpec
    from pipeline.run import generate_params

    engine_fields = {f.name for f in dataclasses.fields(GenerateParams)} - {"seed"}
    assert engine_fields <= {f.name for f in dataclasses.fields(GenerationSpec)}
    spec = GenerationSpec(max_tokens=9, min_tokens=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1,
                          repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, stop=["x"],
                          stop_token_ids=[4], include_stop_str_in_output=True, ignore_eos=True,
                          skip_special_tokens=False, logprobs=3)
    params = generate_params(spec, seed=11)
    for name in engine_fields:
        expected = getattr(spec, name)
        assert getattr(params, name) == (tuple(expected) if isinstance(expected, list) else expected), name
    assert params.seed == 11
