"""Loglikelihood scoring (pipeline.engine.score, prompts.encode_pair): against step-by-step decoding, each
choice alone, mlx-lm's models on the same weights, and llama.cpp's numbers for the default model."""

from __future__ import annotations

import importlib

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_parity import reference_model
from pipeline.engine import Engine
from pipeline.engine.score import score, score_separately, score_shared, shared_blocker
from pipeline.inputs import InputRow
from pipeline.jobspec import CacheSpec, InputSpec
from pipeline.models import build_model
from pipeline.prompts import build_score_prompt, encode_pair
from test_parity_gemma3 import GEMMA3
from test_parity_llama import LLAMA
from test_parity_qwen import QWEN2, QWEN3
from tiny_model import _default_tokenizer

FAMILIES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "gemma3_text": {**GEMMA3, "sliding_window": 64}}


def tiny_engine(config=LLAMA, cache_spec=None, seed=0):
    _, weights, cfg = reference_model(config, seed=seed)
    model = build_model(cfg, weights, mx.float32)
    return Engine(model, [], 512, prefill_step_size=16, cache_spec=cache_spec, compile=False)


def ids(seed: int, *lengths: int, vocab: int = 128) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def stepwise(engine, context: list[int], cont: list[int]) -> list[float]:
    """Each continuation token's logprob, feeding the continuation one token at a time through the
    engine's caches after a prefill of the context (float32 log_softmax of each step's logits)."""
    engine.reset()
    logits = engine.prefill(mx.array(context, dtype=mx.uint32))
    out = []
    for t in cont:
        lp = logits[0].astype(mx.float32) - mx.logsumexp(logits[0].astype(mx.float32))
        out.append(lp[t].item())
        logits = engine.model(mx.array([[t]], dtype=mx.int32), engine.cache)[:, -1, :]
    return out


CONTEXT, *CHOICES = ids(1, 30, 1, 3, 7, 5)


def test_logprob_sum_is_the_sum_of_the_stepwise_logprobs():
    engine = tiny_engine()
    scores, why = score(engine, CONTEXT, CHOICES)
    assert why is None
    for s, c in zip(scores, CHOICES):
        ref = stepwise(engine, CONTEXT, c)
        assert s.num_tokens == len(c) == len(s.token_logprobs)
        # one multi-token forward vs single-token steps: float32 rounding of other matmul shapes
        np.testing.assert_allclose(s.token_logprobs, ref, rtol=0, atol=1e-5)
        assert s.logprob_sum == pytest.approx(sum(ref), abs=1e-4)
        assert s.logprob_sum == sum(s.token_logprobs)


def test_is_greedy_follows_the_argmax():
    engine = tiny_engine()
    greedy, logits = [], engine.forward(CONTEXT)
    engine.reset()
    engine.prefill(mx.array(CONTEXT, dtype=mx.uint32))
    for _ in range(4):  # the greedy path of 4 tokens
        greedy.append(int(mx.argmax(logits).item()))
        logits = engine.model(mx.array([[greedy[-1]]], dtype=mx.int32), engine.cache)[0, -1]
    other = greedy[:3] + [(greedy[3] + 1) % 128]
    s = score_shared(engine, CONTEXT, [greedy, other])
    assert [x.is_greedy for x in s] == [True, False]


def test_batch_of_choices_equals_each_choice_alone_tiny():
    """On the tiny model (hidden 64) the batch and a choice alone differ in the last float32 bits: OpenBLAS
    multiplies small matrices (here M*N*K below its small-matrix threshold: M = 2..6 rows of a choice alone
    vs C x (L_max - 1) = 24 rows of the batch) with another kernel whose sums run in another order, so a
    row of ``X @ W`` depends on how many rows X has. The real model's shapes (hidden 576) stay above it
    with OpenBLAS's SkylakeX kernels: bitwise there (next test)."""
    engine = tiny_engine()
    batch = score_shared(engine, CONTEXT, CHOICES)
    for s, c in zip(batch, CHOICES):
        alone = score_shared(engine, CONTEXT, [c])[0]
        np.testing.assert_allclose(s.token_logprobs, alone.token_logprobs, rtol=0, atol=2e-6)
        assert s.is_greedy == alone.is_greedy
    separate = score_separately(engine, CONTEXT, CHOICES)
    for s, t in zip(batch, separate):
        np.testing.assert_allclose(s.token_logprobs, t.token_logprobs, rtol=0, atol=1e-5)


def test_batch_of_choices_equals_each_choice_alone_on_the_default_model(default_model):
    """The real model's shapes (hidden 576): bitwise with OpenBLAS's SkylakeX kernels (an Intel CPU); with its
    Haswell kernels (an AMD EPYC, 2026-12-02) the longest choice's logprobs differed by up to 1.3e-5, the
    others were bitwise equal: there one of the two shapes falls under another kernel's sum order."""
    tok, engine = default_model.tokenizer, default_model.engine
    context = tok.encode("Question: Which gas do plants take in from the air to make food?\nAnswer:")
    choices = [tok.encode(t) for t in (" carbon dioxide", " oxygen", " nitrogen gas from the soil", " helium")]
    batch = score_shared(engine, context, choices)
    for s, c in zip(batch, choices):
        alone = score_shared(engine, context, [c])[0]
        np.testing.assert_allclose(s.token_logprobs, alone.token_logprobs, rtol=0, atol=5e-5)
        assert s.logprob_sum == pytest.approx(alone.logprob_sum, abs=2e-4) and s.is_greedy == alone.is_greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_logprob_sum_matches_mlx_lm(family):
    """mlx-lm's model on the same random weights, one forward over context + continuation."""
    from mlx_lm.models.cache import make_prompt_cache

    config = FAMILIES[family]
    ref, weights, cfg = reference_model(config, seed=3)
    engine = Engine(build_model(cfg, weights, mx.float32), [], 512, compile=False)
    context, *choices = ids(4, 24, 2, 6, 4, vocab=config["vocab_size"])
    scores, why = score(engine, context, choices)
    assert why is None
    for s, c in zip(scores, choices):
        logits = ref(mx.array([context + c]), cache=make_prompt_cache(ref))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want = [lp[len(context) - 1 + i, t].item() for i, t in enumerate(c)]
        np.testing.assert_allclose(s.token_logprobs, want, rtol=0, atol=1e-4)
        assert s.logprob_sum == pytest.approx(sum(want), abs=3e-4)


def test_a_window_shorter_than_context_plus_continuation_scores_each_choice_alone():
    engine = tiny_engine(cache_spec=CacheSpec(max_kv_size=32))
    assert shared_blocker(engine.cache, 30, 7) is not None and shared_blocker(engine.cache, 20, 7) is None
    scores, why = score(engine, CONTEXT, CHOICES)
    assert "window of 32" in why
    for s, c in zip(scores, CHOICES):  # the sliding window, token by token, is the definition
        np.testing.assert_allclose(s.token_logprobs, stepwise(engine, CONTEXT, c), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="window"):
        score_shared(engine, CONTEXT, CHOICES)
    short, why = score(engine, CONTEXT[:20], CHOICES)  # fits: shared, from the ring's copies
    assert why is None
    for s, c in zip(short, CHOICES):
        np.testing.assert_allclose(s.token_logprobs, stepwise(engine, CONTEXT[:20], c), rtol=0, atol=1e-5)


def test_quantized_caches_score_each_choice_alone():
    config = {**LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 32
    engine = tiny_engine(config, cache_spec=CacheSpec(kv_bits=8, kv_group_size=32))
    scores, why = score(engine, CONTEXT, CHOICES)
    assert "quantized" in why
    for s, c in zip(scores, CHOICES):
        np.testing.assert_allclose(s.token_logprobs, stepwise(engine, CONTEXT, c), rtol=0, atol=1e-4)


def test_first_continuation_token_matches_llamacpp(default_model, llamacpp_cases):
    """The 5 most likely next tokens after each fixture's chat prompt, scored as 5 one-token choices in one
    batch, and the greedy continuation's first token, against llama.cpp (tolerance: tests/fixtures/README.md)."""
    engine = default_model.engine
    for case in llamacpp_cases:
        top = case["top10_ids"][:5]
        scores = score_shared(engine, case["chat_ids"], [[t] for t in top] + [case["greedy_ids"][:6]])
        np.testing.assert_allclose([s.logprob_sum for s in scores[:5]], case["top10_logprobs"][:5], atol=0.5)
        assert scores[5].token_logprobs[0] == scores[0].token_logprobs[0]  # greedy_ids[0] is llama.cpp's top-1
        assert case["greedy_ids"][0] == top[0]


def test_bad_continuations_are_row_errors():
    from pipeline.errors import RowError

    engine = tiny_engine()
    with pytest.raises(RowError, match="continuation 1 encodes to no tokens"):
        score(engine, CONTEXT, [[1], []])
    with pytest.raises(RowError, match="model's context is 512"):
        score(engine, CONTEXT, [[1] * 500])


# --- tokenization: lm-evaluation-harness's _encode_pair ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return _default_tokenizer()


def test_trailing_whitespace_moves_to_the_continuation(tokenizer):
    enc = tokenizer.encode
    ctx, cont = encode_pair(enc, "Question: What is 2 + 2?\nAnswer: ", "4")
    assert ctx == enc("Question: What is 2 + 2?\nAnswer:")
    assert ctx + cont == enc("Question: What is 2 + 2?\nAnswer: 4")
    assert tokenizer.decode(cont) == " 4"
    no_space = encode_pair(enc, "Question: What is 2 + 2?\nAnswer:", " 4")
    assert no_space == (ctx, cont)


def test_a_token_spanning_the_boundary_is_continuation(tokenizer):
    enc = tokenizer.encode
    ctx, cont = encode_pair(enc, "The cat sat on the ma", "t")
    whole = enc("The cat sat on the mat")
    assert ctx == enc("The cat sat on the ma") and cont == whole[len(ctx):]  # lm-eval splits at len(ctx)


def test_chat_templated_context(tokenizer):
    row = InputRow(index=0, id="a", prompt="Which planet is closest to the Sun?", messages=None)
    spec = InputSpec(path="x", apply_chat_template=True)
    sp = build_score_prompt(row, spec, tokenizer, ["Mercury", "Venus"])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": row.prompt}], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert sp.context_ids == tokenizer.encode(rendered[:-1], parse_special=True)  # its "\n" moved
    for choice, cont in zip(["Mercury", "Venus"], sp.continuation_ids):
        assert sp.context_ids + cont == tokenizer.encode(rendered + choice, parse_special=True)
        assert tokenizer.decode(cont).startswith("\n")
    assert sp.text == row.prompt


def test_special_token_text_in_a_choice_stays_text(tokenizer):
    row = InputRow(index=0, id="a", prompt="Say something.", messages=None)
    sp = build_score_prompt(row, InputSpec(path="x"), tokenizer, ["<|im_end|>"])
    assert 2 not in sp.continuation_ids[0]  # <|im_end|> is id 2: the choice's text is not the special token
    sp = build_score_prompt(row, InputSpec(path="x", parse_special_tokens=True), tokenizer, ["<|im_end|>"])
    assert sp.continuation_ids[0][-1] == 2


def test_context_plus_continuation_may_be_one_token_past_the_context():
    """The continuation's last token is a target, never fed (lm-eval feeds ``(context + continuation)
    [-(max_length + 1):][:-1]``): context + continuation of context_length + 1 tokens fit, + 2 do not."""
    from pipeline.errors import RowError

    engine = tiny_engine()  # context_length 512
    context = CONTEXT[:8]
    fits = [[5] * (512 + 1 - len(context))]
    scores, _ = score(engine, context, fits)
    assert scores[0].num_tokens == len(fits[0])
    with pytest.raises(RowError, match="have 514 tokens, 513 positions to run; the model's context is 512"):
        score(engine, context, [[5] * (512 + 2 - len(context))])


def test_an_empty_context_takes_the_prefix_token(tokenizer):
    enc = tokenizer.encode
    assert encode_pair(enc, "", " world", 7) == ([7], enc(" world"))
    assert encode_pair(enc, "   ", "x", 7) == ([7], enc("   x"))
    assert encode_pair(enc, "", " world") == ([], enc(" world"))  # no prefix token given: left empty
