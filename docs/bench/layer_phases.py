"""Where the one-kernel layer's time goes (``kernels/layer.cu``): its phases and grid barriers, timed inside the
kernel, and the replayed step's rate for each barrier (``decoder.LAYER_BARRIER``) and attention phase
(``decoder.LAYER_ATTN``) and L2 prefetch (``LAYER_PREFETCH``), alternated in one process.

Random 4-bit g64 weights of the named real shapes (``pipeline.bench.RANDOM_SHAPES``), float16, a 512-token prompt.
For each variant: ``--tokens`` greedy tokens built token by token with the layer's trace compiled in
(``FusedDecoder.layer_trace``: thread 0 of every block adds up the SM clock cycles of each span between its marks),
reported per span as the mean, the slowest and the fastest block, in microseconds a layer call (the cycles over the
SM clock, which the trace measures against the globaltimer); then the replayed step without the trace
(``Engine.compile_fused``), 256 tokens, median of ``--trials`` after one untimed generation. A barrier's span, for a
block, is the wait from its own arrival to its release: the fastest block's is the barrier's latency after the last
arrival plus that block's lateness; the phase before it ends when its slowest block does.

Usage (from the repository root, on a CUDA machine)::

    PYTHONPATH=. python docs/bench/layer_phases.py --shapes smollm2-135m \\
        --variants gen:block,flip-ra:block,flip-ra:warp,gen:block,flip-ra:block,flip-ra:warp --json /tmp/phases.json

Each variant is ``BARRIER:ATTN[:none|:ogd|:all][:nomma]`` (``LAYER_BARRIER``, ``LAYER_ATTN``, ``LAYER_PREFETCH``,
default "none"); ``:nomma``: no GEMV on tensor cores
(``GEMV_MMA_MODES`` empty: the gate/up phase a warp per row pair). Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx
import numpy as np

from pipeline.bench.shapes import _load_ours
from pipeline.engine import Engine, GenerateParams
from pipeline.engine.cuda import decoder as decoder_module

SPANS = ("qkv", "sync1", "attn", "sync2", "o_proj", "sync3", "gate_up", "sync4", "down")


def trace(eng: Engine, prompt: list[int], tokens: int) -> dict:
    """The layer's spans over ``tokens`` tokens built token by token: per span the mean / max / min over blocks of
    its microseconds a call, and the call's wall time (globaltimer) and the SM clock."""
    dec = eng.fused
    grid = decoder_module.sm_count() * decoder_module.LAYER_BLOCKS_PER_SM
    dec.layer_trace = mx.zeros((grid * 16,), mx.uint64)
    mx.eval(dec.layer_trace)
    eng.compile_fused = False
    eng._fused_closures.clear()
    try:
        eng.generate(prompt, GenerateParams(max_tokens=tokens, ignore_eos=True))
        tr = np.array(dec.layer_trace, dtype=np.float64).reshape(grid, 16)
    finally:
        dec.layer_trace = None
        eng._fused_closures.clear()
    calls = tr[:, 11]
    ghz = tr[:, 10].sum() / tr[:, 9].sum()  # cycles a nanosecond
    us = tr[:, :9] / calls[:, None] / ghz / 1e3
    out = {"calls_per_block": float(calls[0]), "sm_ghz": round(ghz, 4),
           "layer_us": round(float((tr[:, 9] / calls).mean() / 1e3), 3)}
    for i, name in enumerate(SPANS):
        out[name] = {"mean": round(float(us[:, i].mean()), 3), "max": round(float(us[:, i].max()), 3),
                     "min": round(float(us[:, i].min()), 3)}
    return out


def run(shape: str, variants: list[str], tokens: int, trials: int, out: list[dict]) -> None:
    bm = _load_ours(None, shape, mx.float16, False, 0)
    prompt = list(range(5, 517))
    params = GenerateParams(max_tokens=256, ignore_eos=True)
    eng = Engine(bm.model, [], 4096)
    eng.fused.one_kernel_layers = True
    eng.generate(prompt, params)  # untimed: a shape's first generation runs slower
    mma_modes = decoder_module.GEMV_MMA_MODES
    for variant in variants:
        barrier, attn, *flags = variant.split(":")
        prefetch = next((f for f in flags if f in ("none", "ogd", "all")), "none")
        decoder_module.LAYER_BARRIER, decoder_module.LAYER_ATTN = barrier, attn
        decoder_module.LAYER_PREFETCH = prefetch
        decoder_module.GEMV_MMA_MODES = () if "nomma" in flags else mma_modes
        row = {"shape": shape, "barrier": barrier, "attn": eng.fused.layer_attn(), "prefetch": prefetch,
               "gemv_mma_modes": decoder_module.GEMV_MMA_MODES,
               "blocks_per_sm": decoder_module.LAYER_BLOCKS_PER_SM,
               "trace": trace(eng, prompt, tokens)}
        eng.compile_fused = True
        eng._fused_closures.clear()
        eng.generate(prompt, params)
        rates = [eng.generate(prompt, params).decode_tps for _ in range(trials)]
        row.update(tok_s=rates, median=statistics.median(rates))
        out.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m")
    ap.add_argument("--variants", default="gen:block,flip-ra:block,flip-ra:warp,gen:block,flip-ra:block,flip-ra:warp")
    ap.add_argument("--blocks-per-sm", type=int, default=decoder_module.LAYER_BLOCKS_PER_SM)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    decoder_module.LAYER_BLOCKS_PER_SM = args.blocks_per_sm
    out: list[dict] = []
    for shape in args.shapes.split(","):
        run(shape, args.variants.split(","), args.tokens, args.trials, out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
