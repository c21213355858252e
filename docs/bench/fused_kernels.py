"""The fused batch-1 step's kernels one by one, and the whole step, with the attention kernel's value loop as
committed (a warp per 32 keys) and as before 2026-12-03 (one thread per value dimension over every key of the
chunk).

Random 4-bit g64 weights of the named real shapes (``pipeline.bench.RANDOM_SHAPES``), a random prompt of
``--context`` tokens prefilled, float16. Per kernel (layer 0's, on the Llama/Qwen2 layer): the GPU time of one
call, ``--calls`` launches queued back to back (CUPTI through torch.profiler when torch is installed, else the
wall time of the launches evaluated together). Then the whole step (``Engine.generate``'s decode rate, 256
tokens, median of 3 after a warm-up) for each attention variant in ``--steps``, built token by token and, with
``--replay``, replayed (``Engine.compile_fused``). The first engine of a shape ran slower than later ones of the
same settings (Llama-3.2-1B: 610 against 936 tok/s), so each shape's first engine is run once untimed. With
``--splits``, the o and down GEMVs and the replayed step for each way of splitting long rows (``set_split``).
With ``--gemv``, every GEMV (and the q/k/v kernel) and the replayed step for each variant of the chunk loop's
unrolling, the gate/up rows a warp, the grid cap and the tensor-core GEMV (``set_gemv``: ``u2`` = ``GEMV_UNROLL``
2; then ``sN``: N gate/up row pairs a warp; ``bN``: ``GEMV_BLOCKS_PER_SM`` N (the warp-per-row kernels' grid cap),
``b0`` none; ``mN``: the modes on tensor cores, ``MMA_MODES[N]``; ``gN``: ``MMA_GROUPS_IN_FLIGHT`` N; ``cN``:
``MMA_BLOCKS_PER_SM`` N, ``c0`` none). With ``--attn-chunks``, the replayed step with each attention chunk
(``ATTN_FEW_HEADS_CHUNK``, applied to any head count). With ``--profile N``, where a token's GPU time goes: N tokens of the step
built token by token (``FusedDecoder.step`` and an argmax, each token read before the next), CUPTI's time per
kernel.

Usage (from the repository root, on a CUDA machine)::

    PYTHONPATH=. python docs/bench/fused_kernels.py --shapes qwen2.5-7b,llama-3.2-1b,smollm2-135m \
        --context 560 --json /tmp/kernels.json

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import mlx.core as mx

from pipeline.bench.shapes import _load_ours
from pipeline.engine import Engine, GenerateParams
from pipeline.engine.cuda import FusedDecoder, decoder_for
from pipeline.engine.cuda import decoder as decoder_module
from pipeline.engine.cuda.sources import fill, float_literal, header

try:
    import torch
    from torch.profiler import ProfilerActivity, profile
except ImportError:  # wall time instead
    torch = None

WARP_LOOP = "if constexpr (D % 32 == 0 && (VD & (VD - 1)) == 0 && VD <= 8)"


def thread_per_dim_attention(dec: FusedDecoder):
    """``dec._attn_kernel`` with the value loop of one thread per dimension (the kernel's fallback branch)."""
    def make(win: int):
        H, KVH, D = dec.n_heads, dec.n_kv_heads, dec.head_dim
        src = fill("attn.cu", "body", head_dim=D, chunk=dec.attn_chunk, group=H // KVH, window=win,
                   scale=float_literal(dec.scale), v_prefetch="")
        assert WARP_LOOP in src
        return mx.fast.cuda_kernel(name="pl_attn_thread_per_dim", input_names=["q", "kc", "vc", "pos", "scratch",
                                                                               "counts"],
                                   output_names=["o"], source=src.replace(WARP_LOOP, "if constexpr (false)"),
                                   header=header())

    cache: dict = {}
    return lambda win: cache.setdefault(win, make(win))


def gpu_us(fn, calls: int, prefix: str) -> float:
    """Microseconds of GPU time per call of ``fn`` (kernels whose name contains ``prefix``)."""
    mx.eval(fn())
    if torch is None:
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        return 1e6 * (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        outs = [fn() for _ in range(calls)]
        mx.eval(outs)
    ts = [e.device_time for e in p.events() if e.device_type.name == "CUDA" and prefix in e.name]
    return sum(ts) / max(len(ts), 1)


DEFAULT_SPLIT = (decoder_module.SPLIT_MIN_IN, decoder_module.SPLIT_UNITS)


def set_split(split: str | None) -> None:
    """The GEMVs built from now on: ``split`` "off" (every row a warp's), "N" (rows of at least
    ``SPLIT_MIN_IN`` inputs split over a block, N rows a block) or None (as committed)."""
    if split is None:
        decoder_module.SPLIT_MIN_IN, decoder_module.SPLIT_UNITS = DEFAULT_SPLIT
    elif split == "off":
        decoder_module.SPLIT_MIN_IN = 1 << 30
    else:
        decoder_module.SPLIT_MIN_IN, decoder_module.SPLIT_UNITS = DEFAULT_SPLIT[0], int(split)


DEFAULT_FEW_HEADS = (decoder_module.ATTN_FEW_HEADS, decoder_module.ATTN_FEW_HEADS_CHUNK)
GEMV_KNOBS = ("GEMV_UNROLL", "units_per_warp", "GEMV_BLOCKS_PER_SM", "GEMV_MMA_MODES", "MMA_GROUPS_IN_FLIGHT",
              "MMA_BLOCKS_PER_SM")
DEFAULT_GEMV = {name: getattr(decoder_module, name) for name in GEMV_KNOBS}
MMA_MODES = {"0": (), "1": ("swiglu",), "2": ("swiglu", "norm"), "3": ("swiglu", "norm", "residual"),
             "4": ("swiglu", "geglu"), "5": ("swiglu", "geglu", "res_logits")}


def set_gemv(variant: str | None) -> None:
    """The GEMVs built from now on: ``variant``
    ``u<unroll>[s<gate/up units>][p<units of other GEMVs of at least 16,384 rows>][b<blocks a SM>][m<tensor-core
    modes>][g<groups in flight>][c<tensor-core blocks a SM>]`` (``b0`` / ``c0``: no cap on the grid; ``m``:
    ``MMA_MODES``' key) or None (as committed)."""
    for name, value in DEFAULT_GEMV.items():
        setattr(decoder_module, name, value)
    if variant is None:
        return
    m = re.fullmatch(r"u(\d+)(?:s(\d+))?(?:p(\d+))?(?:b(\d+))?(?:m([0-5]))?(?:g(\d+))?(?:c(\d+))?", variant)
    if m is None:
        raise SystemExit(f"--gemv: {variant!r} is not u<N>[s<N>][p<N>][b<N>][m<0-5>][g<N>][c<N>]")
    u, su, pu, b, mm, g, c = m.groups()
    decoder_module.GEMV_UNROLL = int(u)
    units = DEFAULT_GEMV["units_per_warp"]

    def units_per_warp(rows: int, mode: str) -> int:
        if su and mode == "swiglu":
            return int(su)
        if pu and mode != "swiglu" and rows >= 16384:
            return int(pu)
        return units(rows, mode)

    decoder_module.units_per_warp = units_per_warp
    if b is not None:
        decoder_module.GEMV_BLOCKS_PER_SM = int(b) or None
    if mm is not None:
        decoder_module.GEMV_MMA_MODES = MMA_MODES[mm]
    if g:
        decoder_module.MMA_GROUPS_IN_FLIGHT = int(g)
    if c is not None:
        decoder_module.MMA_BLOCKS_PER_SM = int(c) or None


KNOBS = ("ATTN_V_PREFETCH", "QKV_UNROLL", "ATTN_CHUNK", "LAYER_ATTN_CHUNK", "LAYER_PREFETCH", "LAYER_ATTN",
         "ONE_KERNEL_MAX_LAYER_BYTES", "LAYER_BLOCKS_PER_SM", "LAYER_BARRIER", "LAYER_PREFETCH_KV",
         "QKV_PREFETCH_KV")
DEFAULT_KNOBS = {name: getattr(decoder_module, name) for name in KNOBS}


def set_knobs(spec: str) -> None:
    """The decoders built from now on: ``spec`` "base" (as committed) or ``NAME=VALUE[+NAME=VALUE...]`` of
    ``KNOBS`` (VALUE an int, None, or a string), the rest as committed."""
    for name, value in DEFAULT_KNOBS.items():
        setattr(decoder_module, name, value)
    if spec == "base":
        return
    for item in spec.split("+"):
        name, _, value = item.partition("=")
        if name not in KNOBS:
            raise SystemExit(f"--knobs: {name!r} is not one of {', '.join(KNOBS)}")
        setattr(decoder_module, name, int(value) if value.isdigit() else None if value == "None" else value)


def kernels(dec: FusedDecoder, cache, ctx: int, calls: int, shape: str, splits: list[str], gemvs: list[str]):
    lay = dec.layers[0]
    h = mx.random.normal((dec.hidden,)).astype(dec.dtype)
    pos = mx.array([ctx], mx.int32)
    q = dec._query(lay, h, pos, cache)
    o = dec._attend(q, pos, ctx, cache)
    a = dec._gemv(lay["gu"], "swiglu", [h, lay["post_norm"], *lay["gu"].arrays])
    mx.eval(q, o, a)
    cases = {
        "qkv": ("pl_qkv", lambda: dec._query(lay, h, pos, cache)),
        "o": ("pl_gemv_residual", lambda: dec._gemv(lay["o"], "residual", [o, *lay["o"].arrays, h])),
        "gate_up": ("pl_gemv_swiglu", lambda: dec._gemv(lay["gu"], "swiglu", [h, lay["post_norm"], *lay["gu"].arrays])),
        "down": ("pl_gemv_residual", lambda: dec._gemv(lay["down"], "residual", [a, *lay["down"].arrays, h])),
        "head": ("pl_gemv_norm", lambda: dec._gemv(dec.head, "norm", [h, dec.final_norm, *dec.head.arrays])),
    }
    for name, (prefix, fn) in cases.items():
        yield {"shape": shape, "kernel": name, "us": round(gpu_us(fn, calls, prefix), 2)}
    for split in splits:
        set_split(split)
        for name in ("o", "down"):
            prefix, fn = cases[name]
            yield {"shape": shape, "kernel": name, "split": split, "us": round(gpu_us(fn, calls, prefix), 2)}
    set_split(None)  # the GEMV variants below are timed with the split as committed
    for variant in gemvs:
        set_gemv(variant)
        dec._kernels.clear()  # the gate/up rows a warp are not part of a kernel's key
        for name in ("qkv", "o", "gate_up", "down", "head"):
            prefix, fn = cases[name]
            yield {"shape": shape, "kernel": name, "gemv": variant, "us": round(gpu_us(fn, calls, prefix), 2)}
    set_gemv(None)
    dec._kernels.clear()
    built = dec._attn_kernel
    for variant in ("warp-per-32-keys", "thread-per-dim"):
        if variant == "thread-per-dim":
            dec._attn_kernel = thread_per_dim_attention(dec)
        us = gpu_us(lambda: dec._attend(q, pos, ctx, cache), calls, "pl_attn")
        yield {"shape": shape, "kernel": "attn", "variant": variant, "context": ctx, "us": round(us, 2)}
    dec._attn_kernel = built


def token_profile(model, prompt: list[int], tokens: int, shape: str):
    """Rows of GPU time per kernel over ``tokens`` decode steps after 8 untimed ones (CUPTI; needs torch)."""
    dec, caches = decoder_for(model), model.make_cache()
    mx.eval(model(mx.array(prompt)[None], caches))
    dec.prepare(caches, len(prompt) + tokens + 16)
    y, pos, at = mx.array([5], mx.uint32), mx.array([len(prompt)], mx.int32), len(prompt)

    def run(n):
        nonlocal y, pos, at
        for _ in range(n):
            y = mx.argmax(dec.step(y, pos, at, caches), axis=-1).astype(mx.uint32)
            mx.eval(y)
            pos, at = pos + 1, at + 1

    run(8)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        run(tokens)
    total, calls = {}, {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            total[e.name] = total.get(e.name, 0.0) + e.device_time
            calls[e.name] = calls.get(e.name, 0) + 1
    yield {"shape": shape, "profile": "all", "gpu_us_per_token": round(sum(total.values()) / tokens, 1)}
    for name in sorted(total, key=total.get, reverse=True):
        yield {"shape": shape, "profile": name[:80], "calls_per_token": round(calls[name] / tokens, 2),
               "us_per_call": round(total[name] / calls[name], 2), "us_per_token": round(total[name] / tokens, 1)}


def step_rate(model, prompt: list[int], attn: str, replay: bool, trials: int) -> dict:
    engine = Engine(model, eos_token_ids=[], context_length=len(prompt) + 300, fused=True)
    engine.compile_fused = replay
    if attn == "thread-per-dim":
        engine.fused._attn_kernel = thread_per_dim_attention(engine.fused)
    params = GenerateParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate(prompt, params)
    warm = time.perf_counter() - t0
    gens = [engine.generate(prompt, params) for _ in range(trials)]
    assert all(g.fused for g in gens), "the fused step did not run"
    rates = [g.decode_tps for g in gens]
    return {"attn": attn, "replay": replay, "warm_up_s": round(warm, 1), "tok_s": round(statistics.median(rates), 1),
            "trials": [round(r, 1) for r in rates]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-7b,llama-3.2-1b,smollm2-135m")
    ap.add_argument("--context", type=int, default=560)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--steps", default="thread-per-dim,warp-per-32-keys,thread-per-dim,warp-per-32-keys",
                    help="whole-step runs, in order: the attention variant of each")
    ap.add_argument("--replay", action="store_true", help="also the replayed step of each setting")
    ap.add_argument("--splits", default="", help="GEMV row splits to compare (set_split), e.g. off,4,2: the o "
                    "and down kernels, then the whole replayed step, of each")
    ap.add_argument("--gemv", default="", help="GEMV variants to compare (set_gemv), e.g. u1,u2,u1s4,u1b4m1: "
                    "every GEMV kernel, then the whole replayed step, of each")
    ap.add_argument("--attn-chunks", default="", help="attention chunks to compare (keys a block, e.g. 128,64,32): "
                    "the replayed step of each, the chunk applied whatever the model's head count")
    ap.add_argument("--knobs", default="", help="decoder settings to compare, e.g. base,ATTN_V_PREFETCH=L1,"
                    "QKV_UNROLL=2+ATTN_V_PREFETCH=L2: the replayed step of each (set_knobs), in order")
    ap.add_argument("--knob-profile", type=int, default=0, help="with --knobs: also the per-kernel profile of "
                    "each setting over N tokens, one line")
    ap.add_argument("--profile", type=int, default=0, help="tokens of the per-kernel profile of the step (0: none)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    splits = [x for x in args.splits.split(",") if x]
    gemvs = [x for x in args.gemv.split(",") if x]

    def emit(row):
        print(json.dumps(row), flush=True)
        out.append(row)

    for shape in args.shapes.split(","):
        bm = _load_ours(None, shape, mx.float16, False, 0)
        model = bm.model
        prompt = mx.random.randint(0, model.args.vocab_size, (args.context,)).tolist()
        step_rate(model, prompt, "warp-per-32-keys", False, 1)  # untimed: a shape's first engine runs slower
        if not args.no_kernels and model.args.model_type in FusedDecoder.model_types:
            engine = Engine(model, eos_token_ids=[], context_length=args.context + 300, fused=True)
            engine.generate(prompt, GenerateParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            engine.fused.prepare(engine.cache, args.context + 300)
            for row in kernels(engine.fused, engine.cache[0], args.context, args.calls, shape, splits, gemvs):
                emit(row)
            del engine
        if args.profile and torch is not None:
            for row in token_profile(model, prompt, args.profile, shape):
                emit(row)
        set_split(None)
        for attn in args.steps.split(",") if args.steps else ():
            for replay in (False, True) if args.replay else (False,):
                emit({"shape": shape, "context": args.context, **step_rate(model, prompt, attn, replay, args.trials)})
        for chunk in [int(c) for c in args.attn_chunks.split(",") if c]:
            decoder_module.ATTN_FEW_HEADS, decoder_module.ATTN_FEW_HEADS_CHUNK = 1 << 30, chunk
            emit({"shape": shape, "context": args.context, "attn_chunk": chunk,
                  **step_rate(model, prompt, "warp-per-32-keys", True, args.trials)})
        decoder_module.ATTN_FEW_HEADS, decoder_module.ATTN_FEW_HEADS_CHUNK = DEFAULT_FEW_HEADS
        for split in splits:
            set_split(split)
            emit({"shape": shape, "context": args.context, "split": split,
                  **step_rate(model, prompt, "warp-per-32-keys", True, args.trials)})
        set_split(None)
        for variant in gemvs:
            set_gemv(variant)
            emit({"shape": shape, "context": args.context, "gemv": variant,
                  **step_rate(model, prompt, "warp-per-32-keys", True, args.trials)})
        set_gemv(None)
        for knobs in [k for k in args.knobs.split(",") if k]:
            set_knobs(knobs)
            emit({"shape": shape, "context": args.context, "knobs": knobs,
                  **step_rate(model, prompt, "warp-per-32-keys", True, args.trials)})
            if args.knob_profile and torch is not None:  # one line: us a call of each kernel
                rows = list(token_profile(model, prompt, args.knob_profile, shape))
                emit({"shape": shape, "knobs": knobs, "gpu_us_per_token": rows[0]["gpu_us_per_token"],
                      "us_per_call": {r["profile"][:24]: r["us_per_call"] for r in rows[1:8]}})
        set_knobs("base")
        del model, bm
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
