"""The fused CUDA step's knobs that are off by default (pipeline/engine/cuda/decoder.py: ``QKV_PREFETCH_KV``,
``LAYER_PREFETCH_KV``, ``ATTN_V_PREFETCH``, ``QKV_UNROLL``): each, switched on, still gives the model's logits, on the
five-kernel step and on one kernel a layer, for a full cache over several attention chunks and a ring after it wraps.
A knob is measured on a GPU before it is switched on; these keep the measured code correct. GPU only."""

from __future__ import annotations

import pytest

from pipeline.engine.cache import RotatingKVCache
from test_fused_gpu import compare_steps, decoder_module, gpu, make_model

KNOBS = {
    "qkv-prefetch-kv": {"QKV_PREFETCH_KV": True},
    "layer-prefetch-kv": {"LAYER_PREFETCH_KV": True},
    "attn-v-prefetch-l1": {"ATTN_V_PREFETCH": "L1"},
    "attn-v-prefetch-l2": {"ATTN_V_PREFETCH": "L2"},
    "qkv-unroll-2": {"QKV_UNROLL": 2},
}


@gpu
@pytest.mark.parametrize("one_kernel_layers", [False, True], ids=["five-kernels", "one-kernel"])
@pytest.mark.parametrize("prompt_len, ring", [(300, None), (200, 64)], ids=["keys-301", "ring-64"])
@pytest.mark.parametrize("knob", list(KNOBS), ids=list(KNOBS))
def test_a_knob_keeps_the_models_logits(knob, prompt_len, ring, one_kernel_layers, monkeypatch):
    for name, value in KNOBS[knob].items():
        monkeypatch.setattr(decoder_module, name, value)
    caches = (lambda: [RotatingKVCache(ring) for _ in range(3)]) if ring else None
    worst, mismatches = compare_steps(make_model(), prompt_len=prompt_len, steps=4,
                                      one_kernel_layers=one_kernel_layers, make_caches=caches)
    assert worst < 5e-3, worst
    assert mismatches == 0
