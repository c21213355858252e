"""Each fused kernel of layer 0 of a 2-layer Qwen2.5-7B-shape model (random 4-bit g64 weights, float16, a
512-token prompt), 8 launches each after one of each: a target for Nsight Compute, one kernel at a time.

Usage (from the repository root, on a CUDA machine; NAME=VALUE sets a constant of
``pipeline.engine.cuda.decoder`` first, e.g. GEMV_MMA_MODES=() for the warp-per-row gate/up kernel)::

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis \
        -k regex:pl_gemv_swiglu --launch-skip 4 --launch-count 1 python docs/bench/ncu_layer.py
"""

from __future__ import annotations

import ast
import sys

import mlx.core as mx

from pipeline.bench import RANDOM_SHAPES, random_weights
from pipeline.engine.cuda import decoder as decoder_module
from pipeline.engine.cuda import decoder_for
from pipeline.models import build_model
from pipeline.models.base import fuse_projections


def main() -> None:
    for arg in sys.argv[1:]:
        name, value = arg.split("=", 1)
        setattr(decoder_module, name, ast.literal_eval(value))
    config = {**RANDOM_SHAPES["qwen2.5-7b"], "num_hidden_layers": 2}
    model = build_model(config, random_weights(config, mx.float16, bits=4, group_size=64, seed=1), mx.float16)
    fuse_projections(model)
    caches = model.make_cache()
    mx.eval(model(mx.array([list(range(1, 513))]), caches))
    dec = decoder_for(model)
    dec.prepare(caches, 600)
    lay, cache = dec.layers[0], caches[0]
    h = mx.random.normal((dec.hidden,)).astype(mx.float16)
    pos = mx.array([512], mx.int32)
    q = dec._query(lay, h, pos, cache)
    o = dec._attend(q, pos, 512, cache)
    a = dec._gemv(lay["gu"], "swiglu", [h, lay["post_norm"], *lay["gu"].arrays])
    mx.eval(q, o, a)
    for _ in range(8):
        mx.eval(dec._query(lay, h, pos, cache))
        mx.eval(dec._attend(q, pos, 512, cache))
        mx.eval(dec._gemv(lay["o"], "residual", [o, *lay["o"].arrays, h]))
        mx.eval(dec._gemv(lay["gu"], "swiglu", [h, lay["post_norm"], *lay["gu"].arrays]))
        mx.eval(dec._gemv(lay["down"], "residual", [a, *lay["down"].arrays, h]))


if __name__ == "__main__":
    main()
