"""The replayed batch-1 step with five kernels a layer against one kernel a layer (``FusedDecoder.one_kernel_layers``),
and the one-kernel grid's blocks an SM (``decoder.LAYER_BLOCKS_PER_SM``), alternated in one process.

Random 4-bit g64 weights of the named real shapes (``pipeline.bench.RANDOM_SHAPES``), float16, a 512-token prompt,
256 greedy tokens, ``Engine.generate``'s decode rate (``Generation.decode_tps``), median of 3 after one untimed
generation per variant; one engine per shape, its replayed closures cleared between variants.

Usage (from the repository root, on a CUDA machine)::

    PYTHONPATH=. python docs/bench/one_kernel_layers.py --json /tmp/layers.json \\
        --runs "llama-3.2-1b:0,2,0,2,0,1" "smollm2-135m:0,1,0,1" "qwen2.5-7b:0,2,0,3"

Each run is ``SHAPE:V,V,...``: ``0`` five kernels a layer, ``N`` one kernel a layer at N blocks an SM. Prints one
JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics

import mlx.core as mx

from pipeline.bench.shapes import _load_ours
from pipeline.engine import Engine, GenerateParams
from pipeline.engine.cuda import decoder as decoder_module


def run(shape: str, variants: list[int], out: list[dict]) -> None:
    bm = _load_ours(None, shape, mx.float16, False, 0)
    prompt = list(range(5, 517))
    params = GenerateParams(max_tokens=256, ignore_eos=True)
    eng = Engine(bm.model, [], 4096)
    eng.compile_fused = True
    for per_sm in variants:
        decoder_module.LAYER_BLOCKS_PER_SM = max(per_sm, 1)
        eng.fused.one_kernel_layers = per_sm > 0
        eng._fused_closures.clear()
        eng.generate(prompt, params)
        rates = [eng.generate(prompt, params).decode_tps for _ in range(3)]
        row = {"shape": shape, "one_kernel_layers": per_sm > 0, "blocks_per_sm": per_sm or None, "tok_s": rates,
               "median": statistics.median(rates)}
        out.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", default=["smollm2-135m:0,1,0,1"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: list[dict] = []
    for spec in args.runs:
        shape, vs = spec.split(":")
        run(shape, [int(v) for v in vs.split(",")], out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
