"""Padded prefill (``Engine.pad_prefill``, off by default): a prompt's last chunk runs at a
power-of-two length and the padding is trimmed from the caches, so prefill meets a few shapes. Forced on
here, on the CPU: the caches and logits it leaves are those of the prompt alone (to float rounding), it
keeps llama.cpp's next-token logprobs on the default model, and it stays off where a cache cannot trim."""

from __future__ import annotations

import numpy as np
import pytest

import pipeline  # noqa: F401  (OpenBLAS before tiny_model imports mlx.core, as in `pipeline run`)

# isort: split
import mlx.core as mx
from test_parity_llamacpp import TOP1_MARGIN, TOP5_TOLERANCE
from tiny_model import write_tiny_model

from pipeline import load_model
from pipeline.engine import GenerateParams
from pipeline.engine.views import PREFILL_MIN_BUCKET, prefill_pad
from pipeline.jobspec import CacheSpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _keys(engine, n):
    return [np.array(c.keys[..., :n, :]) for c in engine.cache]


# On MLX's CUDA backend float32 matmuls of different shapes (the padded prefill's against the prompt's
# own) differ by more than float32 rounding: on an H200 up to 8.3e-3 in these logits (n = 17, 70), against
# 0 to 1e-4 on the CPU. A wrong cache (a pad position attended, a position shifted) is off by ~1.
FLOAT32_GPU_TOL = 2e-2


@pytest.mark.parametrize("n", [3, 16, 17, 40, 70])
def test_the_caches_and_logits_are_the_prompts_own(tiny, n):
    # float32 on every device: the claim is equality to float32 rounding (float16 has its own, ~1e-3)
    lm = load_model(path=tiny, prefill_step_size=64, dtype="float32")
    eng = lm.engine
    ids = [1 + (7 * i) % 200 for i in range(n)]
    eng.pad_prefill = False
    want, keys = np.array(eng.forward(ids)), _keys(eng, n)
    eng.pad_prefill = True
    size = eng._padded(0, n) if n <= 64 else eng._padded(64, n - 64)
    assert size == max(PREFILL_MIN_BUCKET, 1 << ((min(n, 64) if n <= 64 else n - 64) - 1).bit_length())
    got = np.array(eng.forward(ids))
    assert all(c.offset == n for c in eng.cache)
    tol = FLOAT32_GPU_TOL if mx.default_device() == mx.gpu else 1e-4
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    for a, b in zip(_keys(eng, n), keys):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)
    params = GenerateParams(max_tokens=6, ignore_eos=True)
    eng.pad_prefill = False
    plain = eng.generate(ids, params).token_ids
    eng.pad_prefill = True
    assert eng.generate(ids, params).token_ids == plain


def test_lengths_and_where_it_stays_off(tiny):
    lm = load_model(path=tiny, prefill_step_size=100)
    eng = lm.engine
    eng.pad_prefill = True
    assert eng._padded(0, 70) == 70  # 128 would exceed the chunk size
    assert eng._padded(0, 5) == 16 and eng._padded(0, 33) == 64
    ring = load_model(path=tiny, cache_spec=CacheSpec(max_kv_size=20)).engine
    ring.pad_prefill = True
    assert ring._padded(0, 3) == 16 and ring._padded(10, 3) == 3  # 10 + 16 would wrap the 20-slot ring
    eng.pad_prefill = False
    assert eng._padded(0, 5) == 5


def test_padded_prefill_keeps_llamacpp_logprobs(default_model_path, llamacpp_cases):
    quant = load_model(path=default_model_path, cache_spec=CacheSpec(kv_bits=8, kv_group_size=64)).engine
    quant.pad_prefill = True
    assert quant._padded(0, 3) == 3  # quantized storage: never padded
    lm = load_model(path=default_model_path)
    lm.engine.pad_prefill = True
    lengths = [len(case["chat_ids"]) for case in llamacpp_cases]
    assert [lm.engine._padded(0, n) for n in lengths] == [prefill_pad(n) for n in lengths]
    assert any(prefill_pad(n) > n for n in lengths)  # some prompts do run padded
    for case in llamacpp_cases:
        lp = lm.logprobs(case["chat_ids"])
        ref_ids, ref_lp = case["top10_ids"], np.array(case["top10_logprobs"])
        if ref_lp[0] - ref_lp[1] >= TOP1_MARGIN:
            assert int(lp.argmax()) == ref_ids[0], case["prompt"]
        np.testing.assert_allclose(lp[ref_ids[:5]], ref_lp[:5], atol=TOP5_TOLERANCE, err_msg=case["prompt"])
