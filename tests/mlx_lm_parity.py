"""Harness: the same random weights in mlx-lm's model and ours, logits compared over prefill and decode.

mlx-lm (a test-only peer) is the reference implementation of each architecture.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from pipeline.bench import random_tensor
from pipeline.models import build_model


def randomize(model: nn.Module, seed: int) -> None:
    """Replace mlx-lm's initial weights by random ones with larger spread, so logits and greedy paths
    are not degenerate (``pipeline.bench.random_tensor``: the rule ``pipeline bench --random`` uses)."""
    mx.random.seed(seed)
    params = [(name, random_tensor(name, p.shape)) for name, p in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def reference_model(config: dict, quantization: dict | None = None, seed: int = 0):
    """mlx-lm's model for ``config`` with random weights; returns (model, weights, config for ours)."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    family = importlib.import_module(f"mlx_lm.models.{model_type}")
    ref = family.Model(family.ModelArgs.from_dict(config))
    randomize(ref, seed)
    if quantization:
        nn.quantize(ref, group_size=quantization["group_size"], bits=quantization["bits"])
        config = {**config, "quantization": quantization}
    weights = dict(tree_flatten(ref.parameters()))
    return ref, weights, config


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def compare_with_mlx_lm(config: dict, *, quantization: dict | None = None, prompt_len: int = 40,
                        decode_steps: int = 20, rtol: float = 1e-4, seed: int = 0, fuse: bool = False,
                        dense_prefill: bool = False) -> dict:
    """Prefill ``prompt_len`` random tokens then ``decode_steps`` greedy single-token steps in both
    models (each with its own caches); assert logits agree (max abs error / max abs logit < rtol) and
    greedy tokens are identical; with ``fuse`` our model's projections are fused first (as
    ``load_model`` does), and with ``dense_prefill`` its quantized layers take multi-row inputs through
    dequantized weights (``pipeline.models.dense_prefill``, as ``load_model`` does on a CUDA GPU). Returns
    {"prefill_err", "decode_err", "tokens"}."""
    from mlx_lm.models.cache import make_prompt_cache

    ref, weights, our_config = reference_model(config, quantization, seed)
    ours = build_model(our_config, weights, mx.float32)
    if fuse:
        from pipeline.models.base import fuse_projections

        fuse_projections(ours)
    if dense_prefill:
        from pipeline.models import dense_prefill as make_dense_prefill

        assert make_dense_prefill(ours) > 0
    mx.random.seed(seed + 1)
    prompt = mx.random.randint(0, config["vocab_size"], (1, prompt_len))
    ref_cache, our_cache = make_prompt_cache(ref), ours.make_cache()

    ref_logits, our_logits = ref(prompt, cache=ref_cache), ours(prompt, our_cache)
    prefill_err = rel_err(our_logits, ref_logits)
    assert prefill_err < rtol, f"prefill logits differ: relative error {prefill_err:.2e}"

    tokens, decode_err = [], 0.0
    ref_last, our_last = ref_logits[:, -1], our_logits[:, -1]
    for step in range(decode_steps):
        ref_tok, our_tok = int(mx.argmax(ref_last).item()), int(mx.argmax(our_last).item())
        assert our_tok == ref_tok, f"greedy token differs at decode step {step}: {our_tok} vs {ref_tok}"
        tokens.append(ref_tok)
        y = mx.array([[ref_tok]])
        ref_last, our_last = ref(y, cache=ref_cache)[:, -1], ours(y, our_cache)[:, -1]
        err = rel_err(our_last, ref_last)
        assert err < rtol, f"decode step {step}: relative error {err:.2e}"
        decode_err = max(decode_err, err)
    assert len(set(tokens)) > 1, "degenerate greedy path; the comparison would prove little"
    return {"prefill_err": prefill_err, "decode_err": decode_err, "tokens": tokens}
