"""The batched CUDA step (``pipeline.engine.cuda.BatchedDecoder``, ``BatchEngine.path`` "cuda-batched") against the
generic batched step it replaces (the model's own modules over ``views.BatchView`` s: MLX's rope with per-row
offsets, ``put_along_axis`` writes and ``scaled_dot_product_attention`` masked over the whole capacity).

The kernel tests run only where MLX's CUDA backend is available; elsewhere the host side is checked with a
recording stand-in for ``mx.fast.cuda_kernel`` (launches, grids, the arrays each kernel names, buffers handed
back as the same arrays) and ``BatchEngine`` must pick the generic step without a word.

Tolerances: the two steps share every MLX op but the attention, which the kernel accumulates in float32
(MLX's masked SDPA rounds scores and probabilities to the compute dtype), so logits agree to the compute
dtype's rounding noise (relative L2 error as in tests/test_fused_gpu.py) and the keys/values written at layer
0, where both steps see the same input, agree to the last bit (values) or to one rounding (keys).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from pipeline.bench import random_weights
from pipeline.engine import Engine, GenerateParams
from pipeline.engine.batch import BatchEngine, Request
from pipeline.engine.cuda import BatchedDecoder, batched_blocker
from pipeline.engine.cuda.batched import ATTN_CHUNK, attn_chunks
from pipeline.engine.views import LayerKind
from pipeline.jobspec import CacheSpec
from pipeline.models import build_model, dequantize_model
from pipeline.models.base import fuse_projections

CUDA = mx.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="MLX CUDA backend not available")

# GQA 4:1 with head_dim 32; the "hd64" case has the real models' head_dim 64 (2:1).
BASE = {
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
    "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}
FAMILIES = {"llama": {}, "qwen2": {"model_type": "qwen2", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}}
# Relative L2 error of the logits. float32: 3.0e-4 measured on the H200 (MLX's float32 ops there are not
# exact float32 arithmetic: the generic step's SDPA differs from the kernel's float32 sums by that much).
TOL = {mx.float16: 5e-3, mx.bfloat16: 3e-2, mx.float32: 1.5e-3}
ULP = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2, mx.float32: 1e-6}


def make_model(dtype=mx.float16, fuse=True, **overrides):
    """A tiny random model, dense ``dtype`` weights, projections fused as ``load_model`` does."""
    config = {**BASE, **overrides}
    model = build_model(config, random_weights(config, dtype, seed=3), dtype)
    dequantize_model(model, dtype)
    if fuse:
        fuse_projections(model)
    return model


def engine_for(model, window=None, **kw) -> Engine:
    spec = CacheSpec(max_kv_size=window) if window else None
    return Engine(model, [], 4096, cache_spec=spec, compile=False, fused=False, **kw)


def random_buffers(be: BatchEngine, model, seed: int) -> list[np.ndarray]:
    """Per-layer keys and values ``(B, n_kv_heads, capacity, head_dim)`` float32 (every slot filled)."""
    a = model.model.layers[0].self_attn
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((be.B, a.n_kv_heads, k.capacity, a.head_dim)).astype(np.float32)
            for k in be.kinds for _ in (0, 1)]


def run_steps(be: BatchEngine, bufs: list[np.ndarray], dtype, pos: list[int], tokens: list[list[int]]):
    """Steps of ``be``'s decode step from buffers ``bufs`` at positions ``pos`` (one token list per step);
    returns (logits per step as float32 arrays, final buffers as float32 arrays)."""
    step = be._step_fn()
    arrays = [mx.array(b).astype(dtype) for b in bufs]
    mx.eval(arrays)
    p = mx.array(pos, mx.int32)
    active = mx.ones((be.B,), mx.int32)
    out = []
    for toks in tokens:
        logits, greedy, p, *arrays = step(mx.array(toks, mx.uint32), p, active, *arrays)
        mx.eval(logits, greedy, p, *arrays)
        out.append(np.array(logits))
    return out, [np.array(a.astype(mx.float32)) for a in arrays]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------------------------------ on the GPU

STEP_CASES = {
    **{f"{fam}-{name}-full": (fam, dt, None, {}) for fam in FAMILIES
       for name, dt in (("fp16", mx.float16), ("bf16", mx.bfloat16), ("fp32", mx.float32))},
    **{f"{fam}-fp16-rotating64": (fam, mx.float16, 64, {}) for fam in FAMILIES},
    "llama-fp16-hd64-llama3rope-traditional": ("llama", mx.float16, None, dict(
        num_attention_heads=4, head_dim=64, rope_traditional=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256})),
}


@gpu
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_cuda_step_matches_generic_step(case):
    """Rows at different positions (one slot, chunk edges 127/128, several 128-key chunks; for a 64-slot ring:
    before, at and long after it wraps), three steps: logits agree, and the buffers after the steps agree
    slot for slot (the generic step returns new buffers; the CUDA step wrote the same arrays in place)."""
    family, dtype, window, extra = STEP_CASES[case]
    model = make_model(dtype, **FAMILIES[family], **extra)
    engine = engine_for(model, window)
    pos = [0, 10, 63, 64, 127, 128, 300, 383] if window else [0, 5, 127, 128, 129, 255, 300, 383]
    generic, cuda = BatchEngine(engine, len(pos), 400), BatchEngine(engine, len(pos), 400)
    generic.cuda_step = False
    assert (generic.path, cuda.path) == ("generic", "cuda-batched")
    assert [k.capacity for k in cuda.kinds] == [64 if window else 512] * 2
    bufs = random_buffers(cuda, model, seed=1)
    rng = np.random.default_rng(2)
    tokens = [rng.integers(0, BASE["vocab_size"], len(pos)).tolist() for _ in range(3)]
    ref, ref_bufs = run_steps(generic, bufs, dtype, pos, tokens)
    got, got_bufs = run_steps(cuda, bufs, dtype, pos, tokens)
    for r, g in zip(ref, got):
        assert np.isfinite(g).all()
        worst = max(rel_err(g[b], r[b]) for b in range(len(pos)))
        assert worst < TOL[dtype], worst
        for b in range(len(pos)):  # the argmax wherever the reference's top-2 margin is clear of the noise
            top2 = np.sort(r[b])[-2:]
            if top2[1] - top2[0] > 0.05 * max(1.0, abs(top2[1])):
                assert g[b].argmax() == r[b].argmax()
    np.testing.assert_array_equal(got_bufs[1], ref_bufs[1])  # layer 0 values: the same projection
    np.testing.assert_allclose(got_bufs[0], ref_bufs[0], rtol=ULP[dtype], atol=ULP[dtype])  # layer 0 keys
    for g, r in zip(got_bufs[2:], ref_bufs[2:]):
        assert rel_err(g, r) < TOL[dtype]


def prompts_of(lengths, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, BASE["vocab_size"], n)] for n in lengths]


@gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_run_matches_generic_run(family):
    """Whole runs (float32, fewer near ties than float16): 8 requests of 1-300 prompt tokens through 3 reused
    slots give the generic step's tokens (up to a near tie of the generic run's top-2 logprobs)."""
    model = make_model(mx.float32, **FAMILIES[family])
    engine = engine_for(model)
    params = GenerateParams(max_tokens=14, logprobs=2)
    reqs = [Request(i, p, params) for i, p in enumerate(prompts_of([23, 1, 130, 260, 9, 300, 129, 64], seed=4))]
    generic, cuda = BatchEngine(engine, 3, 320), BatchEngine(engine, 3, 320)
    generic.cuda_step = False
    ref, got = dict(generic.run(reqs)), dict(cuda.run(reqs))
    assert cuda.path == "cuda-batched" and not cuda.compiled
    for r in reqs:
        a, b = ref[r.tag], got[r.tag]
        assert len(b.token_ids) == 14
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                gap = a.top_logprobs[i][0] - a.top_logprobs[i][1]
                assert gap < 1e-2, f"request {r.tag} step {i}: {y} != {x}, top-2 gap {gap:.3g}"
                break
        else:
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-2, rtol=0)


@gpu
@pytest.mark.parametrize("window", [None, 16], ids=["full", "rotating16"])
def test_greedy_request_does_not_depend_on_its_neighbours(window):
    """float16, the production dtype: a request's tokens and logprobs are bit-identical alone and among other
    requests, in other slots (its prompt of 140 tokens spans two attention chunks; with a 16-slot ring it has
    wrapped before decoding starts)."""
    model = make_model(mx.float16)
    be = BatchEngine(engine_for(model, window), 4, 192)
    assert be.path == "cuda-batched"
    ps = prompts_of([140, 23, 40, 9, 31], seed=5)
    x = Request("x", ps[0], GenerateParams(max_tokens=24, logprobs=1))
    others = [Request(i, p, GenerateParams(max_tokens=3 + 5 * i)) for i, p in enumerate(ps[1:])]
    runs = [dict(be.run(batch))["x"] for batch in
            ([x], [others[0], x], [*others[:3], x], [others[2], x, others[1], others[0], others[3]])]
    assert len(runs[0].token_ids) == 24
    for g in runs[1:]:
        assert g.token_ids == runs[0].token_ids
        assert g.logprobs == runs[0].logprobs


@gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_load_slots_writes_each_slot_in_place(dtype):
    """``pl_load_slots``: slots 3 and 0 of buffers full of noise get rows 1 and 0 of a group prefill's caches
    at their prompt positions and zeros after, bitwise; the other slots and the arrays themselves stay."""
    model = make_model(dtype)
    be = BatchEngine(engine_for(model), 4, 300)
    dec = be.decoder
    rng = np.random.default_rng(8)
    a = model.model.layers[0].self_attn
    cap = be.kinds[0].capacity
    src = [mx.array(rng.standard_normal((3, a.n_kv_heads, 32, a.head_dim)).astype(np.float32)).astype(dtype)
           for _ in (0, 1)]
    dst = [mx.array(rng.standard_normal((4, a.n_kv_heads, cap, a.head_dim)).astype(np.float32)).astype(dtype)
           for _ in (0, 1)]
    mx.eval(src, dst)
    before = [np.array(d.astype(mx.float32)) for d in dst]
    done = dec.load_slots(0, *src, mx.array([1, 0], mx.int32), mx.array([3, 0], mx.int32), mx.array([20, 32], mx.int32),
                          *dst)
    mx.eval(done)
    for s, d, b in zip(src, dst, before):
        got, s = np.array(d.astype(mx.float32)), np.array(s.astype(mx.float32))
        want = b.copy()
        want[3], want[0] = 0, 0
        want[3, :, :20], want[0, :, :32] = s[1, :, :20], s[0]
        np.testing.assert_array_equal(got, want)


@gpu
@pytest.mark.parametrize("window", [None, 16], ids=["full", "rotating16"])
def test_compiled_cuda_step_equals_eager(window):
    """``engine.compile`` on the CUDA step (``mx.compile`` of ``BatchedDecoder.step``): a run's tokens and
    logprobs are bitwise the eager step's, float16, slots reused by 7 requests of 1-140 prompt tokens."""
    model = make_model(mx.float16)
    spec = CacheSpec(max_kv_size=window) if window else None
    reqs = [Request(i, p, GenerateParams(max_tokens=6 + 3 * i, logprobs=1))
            for i, p in enumerate(prompts_of([23, 1, 140, 9, 64, 40, 17], seed=11))]
    runs = {}
    for c in (True, False):
        be = BatchEngine(Engine(model, [], 4096, cache_spec=spec, compile=c, fused=False), 3, 192)
        assert be.path == "cuda-batched" and be.compiled == c
        runs[c] = dict(be.run(reqs))
    for r in reqs:
        assert runs[True][r.tag].token_ids == runs[False][r.tag].token_ids
        assert runs[True][r.tag].logprobs == runs[False][r.tag].logprobs


@gpu
def test_generic_step_where_the_cuda_one_cannot_run_logged_once(caplog):
    """Unfused q/k/v projections (or quantized KV caches): the generic step, its reason logged once per engine."""
    model = make_model(mx.float16, fuse=False)
    engine = engine_for(model)
    be = BatchEngine(engine, 2, 64)
    assert be.path == "generic"
    reqs = [Request(i, p, GenerateParams(max_tokens=3)) for i, p in enumerate(prompts_of([5, 7], seed=6))]
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        dict(be.run(reqs)), dict(be.run(reqs))
    notes = [r.getMessage() for r in caplog.records if "generic step" in r.getMessage()]
    assert notes == ["batched decode through the generic step: q/k/v projections are not fused "
                     "(their weights differ in kind)"]
    quantized = BatchEngine(Engine(make_model(), [], 4096, cache_spec=CacheSpec(kv_bits=8, kv_group_size=32),
                                   fused=False), 2, 64)
    assert quantized.path == "generic" and quantized._generic_why == "quantized KV caches"


# --------------------------------------------------------------------------------- anywhere (host side)


def test_attn_chunks():
    assert ATTN_CHUNK == 128
    assert [attn_chunks(256, n) for n in (1, 128, 129, 256, 10_000)] == [1, 1, 2, 2, 2]
    assert [attn_chunks(512, n) for n in (300, 384, 385)] == [4, 4, 4]
    assert attn_chunks(1024, 300) == 4 and attn_chunks(1024, 1024) == 8
    assert attn_chunks(64, 64) == 1 and attn_chunks(1000, 1000) == 8 and attn_chunks(1000, 500) == 4


def test_blockers():
    model = make_model(mx.float32)
    full = [LayerKind(False, 256, None, None, None)] * 2
    if not CUDA:
        assert batched_blocker(model, full) == "not on MLX's CUDA backend"
    assert BatchedDecoder.blocker(model, full) is None
    assert BatchedDecoder.blocker(model, [LayerKind(True, 256, None, 8, 64)] * 2) == "quantized KV caches"
    assert "not fused" in BatchedDecoder.blocker(make_model(mx.float32, fuse=False), full)
    assert "qwen3" in BatchedDecoder.blocker(make_model(mx.float32, model_type="qwen3", head_dim=32), full)


def test_generic_step_off_cuda_without_a_word(caplog):
    if CUDA:
        pytest.skip("on CUDA the batched CUDA step runs")
    model = make_model(mx.float32)
    be = BatchEngine(engine_for(model), 2, 64)
    assert be.path == "generic" and be.decoder is None
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        got = dict(be.run([Request(0, [1, 2, 3], GenerateParams(max_tokens=3))]))
    assert len(got[0].token_ids) == 3
    assert not [r for r in caplog.records if "generic step" in r.getMessage()]


class _RecordingKernel:
    """Stands in for ``mx.fast.cuda_kernel`` on machines without CUDA: records each launch and returns zeros."""

    launches: list = []

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True, **_):
        self.name, self.input_names, self.source, self.contiguous = name, input_names, source, ensure_row_contiguous

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        assert len(inputs) == len(self.input_names), self.name
        _RecordingKernel.launches.append({"name": self.name, "grid": grid, "threadgroup": threadgroup,
                                          "contiguous": self.contiguous, "source": self.source,
                                          "inputs": dict(zip(self.input_names, inputs))})
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.mark.parametrize("window", [None, 64], ids=["full", "rotating64"])
def test_launch_plan(window, monkeypatch):
    """Per step: the embedding and the MLX ops, and per layer ``pl_rope_store`` (a thread per (row, rotation
    pair), built without ensure_row_contiguous so the write lands in the buffer itself) then ``pl_batch_attn``
    (grid: the capacity's chunks x KV heads x rows); each kernel gets the step's very buffers, and the step
    returns them as the same arrays."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", _RecordingKernel)
    _RecordingKernel.launches = []
    model = make_model(mx.float32, model_type="qwen2", tie_word_embeddings=False)
    be = BatchEngine(engine_for(model, window), 3, 300)
    be.decoder = BatchedDecoder(model, be.kinds)  # off CUDA: built by hand (batched_blocker refuses)
    assert be.path == "cuda-batched" and not be.compiled
    bufs = [mx.array(b) for b in random_buffers(be, model, seed=0)]
    out = be._step_fn()(mx.array([1, 2, 3], mx.uint32), mx.array([0, 70, 299], mx.int32), mx.ones((3,), mx.int32),
                        *bufs)
    assert all(o is b for o, b in zip(out[3:], bufs)) and len(out) == 3 + len(bufs)
    assert out[0].shape == (3, BASE["vocab_size"]) and out[0].dtype == mx.float32
    assert out[2].tolist() == [1, 71, 300]
    a = model.model.layers[0].self_attn
    H, KVH, D = a.n_heads, a.n_kv_heads, a.head_dim
    launches = _RecordingKernel.launches
    assert [k["name"] for k in launches] == ["pl_rope_store", "pl_batch_attn"] * 2
    cap = 64 if window else 512
    for i in range(2):
        rope, attn = launches[2 * i], launches[2 * i + 1]
        assert rope["inputs"]["kc"] is bufs[2 * i] and rope["inputs"]["vc"] is bufs[2 * i + 1]
        assert attn["inputs"]["kc"] is bufs[2 * i] and attn["inputs"]["vc"] is bufs[2 * i + 1]
        assert rope["inputs"]["qkv"].shape == (3, 1, (H + 2 * KVH) * D)
        assert not rope["contiguous"] and attn["contiguous"]
        assert rope["grid"][0] >= 3 * (H + 2 * KVH) * D // 2 and rope["threadgroup"] == (256, 1, 1)
        assert attn["grid"] == (attn_chunks(cap, cap) * ATTN_CHUNK, KVH, 3) and attn["threadgroup"] == (128, 1, 1)
        assert f"WIN = {window or 0}" in attn["source"] and f"WIN = {window or 0}" in rope["source"]
    scratch = launches[1]["inputs"]["scratch"]
    assert scratch.size >= 3 * H * (cap // ATTN_CHUNK or 1) * (D + 2)
    assert launches[1]["inputs"]["counts"].shape == (3 * KVH,)


def test_run_through_the_cuda_step_plumbing(monkeypatch):
    """``BatchEngine.run`` on the CUDA path (kernels recorded, their outputs zeros): every request gets its
    tokens, slots are reused, the decode step's launches see the buffers ``_load_slot`` wrote."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", _RecordingKernel)
    _RecordingKernel.launches = []
    model = make_model(mx.float32)
    be = BatchEngine(engine_for(model), 2, 64)
    be.decoder = BatchedDecoder(model, be.kinds)
    reqs = [Request(i, p, GenerateParams(max_tokens=2 + i)) for i, p in enumerate(prompts_of([5, 9, 3, 12], seed=7))]
    got = dict(be.run(reqs))
    assert [len(got[i].token_ids) for i in range(4)] == [2, 3, 4, 5]
    assert not any(g.compiled for g in got.values())
    last = [k for k in _RecordingKernel.launches if k["name"] == "pl_rope_store"][-1]
    assert last["inputs"]["kc"] is be.buffers[-2]
