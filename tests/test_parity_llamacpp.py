"""Tokenizer and model parity with llama.cpp on the default model (reference: tests/fixtures)."""

import numpy as np
import pytest

from pipeline import load_model

# Tolerances from tests/fixtures/README.md: llama.cpp multiplies Q4_1 weights with 8-bit-quantized
# activations, so a float32 implementation differs from it by up to a few tenths of a nat.
TOP1_MARGIN = 0.3
TOP5_TOLERANCE = 0.5


def test_raw_prompt_ids(default_model, llamacpp_cases):
    tok = default_model.tokenizer
    for case in llamacpp_cases:
        assert tok.encode(case["prompt"]) == case["raw_ids"], case["prompt"]


def test_chat_text_ids_with_special_tokens(default_model, llamacpp_cases):
    tok = default_model.tokenizer
    for case in llamacpp_cases:
        assert tok.encode(case["chat_text"], parse_special=True) == case["chat_ids"], case["prompt"]


def test_special_tokens_not_parsed_by_default(default_model, llamacpp_cases):
    tok = default_model.tokenizer
    ids = tok.encode(llamacpp_cases[0]["chat_text"])
    assert 1 not in ids and 2 not in ids  # <|im_start|>, <|im_end|> stay text


def test_chat_template_matches_llamacpp_rendering(default_model, llamacpp_cases):
    tok = default_model.tokenizer
    for case in llamacpp_cases:
        text = tok.apply_chat_template([{"role": "user", "content": case["prompt"]}], add_generation_prompt=True)
        assert text == case["chat_text"]


def test_decode_matches_llamacpp_text(default_model, llamacpp_cases):
    tok = default_model.tokenizer
    for case in llamacpp_cases:
        assert tok.decode(case["greedy_ids"]) == case["greedy_text"]


def test_special_tokens_and_bos_from_metadata(default_model):
    tok = default_model.tokenizer
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1 and tok.add_bos_token is False
    assert tok.encode("<|im_start|>", parse_special=True) == [1]


@pytest.fixture(scope="module", params=["dequantized", "quantized"])
def model_variant(request, default_model, default_model_path):
    if request.param == "dequantized":
        return default_model
    return load_model(path=default_model_path, dequantize=False)


def test_next_token_logprobs_match_llamacpp(model_variant, llamacpp_cases):
    for case in llamacpp_cases:
        lp = model_variant.logprobs(case["chat_ids"])
        assert lp.shape == (model_variant.tokenizer.vocab_size,) and lp.dtype == np.float32
        assert abs(float(np.exp(lp.astype(np.float64)).sum()) - 1.0) < 1e-3
        ref_ids, ref_lp = case["top10_ids"], np.array(case["top10_logprobs"])
        if ref_lp[0] - ref_lp[1] >= TOP1_MARGIN:
            assert int(lp.argmax()) == ref_ids[0], case["prompt"]
        np.testing.assert_allclose(lp[ref_ids[:5]], ref_lp[:5], atol=TOP5_TOLERANCE, err_msg=case["prompt"])
