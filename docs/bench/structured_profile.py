"""CUPTI profile (torch.profiler, on MLX's CUDA backend) of one batched run with and without the JSON schema of
jobs/bench_structured.yaml on the real default model, plus what one step's mask costs on the device.

Runs B real prompts (data_samples/real_prompts_1024.parquet) x 48 greedy tokens through ``BatchEngine`` twice
(warm-up), then once under the profiler for each kind; prints wall seconds, the GPU's busy seconds (the sum of
the kernels' device time) and the 14 kernels that took longest. Before that, the median ms of a random
``(B, words)`` bitmask uploaded and unpacked (``TokenMask.bools``), ``mx.array`` alone, and the unpacking of a
bitmask already on the device. Needs torch (with CUPTI) beside MLX.

Usage (from the repository root)::

    PYTHONPATH=. python docs/bench/structured_profile.py 256
"""

import collections
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import yaml
from torch.profiler import ProfilerActivity, profile

import pipeline
from pipeline.bench.throughput import file_prompts
from pipeline.engine import BatchEngine, GenerateParams, Request
from pipeline.engine import structured as st

ROOT = Path(__file__).resolve().parents[2]


def main():
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    schema = yaml.safe_load((ROOT / "jobs/bench_structured.yaml").read_text())["generation"]["structured"]["json"]
    lm = pipeline.load_model(batch_size=B)
    prompts = file_prompts(ROOT / "data_samples/real_prompts_1024.parquet", "prompt", lm.tokenizer, B)
    plain = GenerateParams(max_tokens=48)
    js = GenerateParams(max_tokens=48, structured=st.StructuredOutputsParams(json=schema))

    def run(params):
        t0 = time.perf_counter()
        gens = list(BatchEngine(lm.engine, B, 600).run([Request(i, p, params) for i, p in enumerate(prompts)]))
        return time.perf_counter() - t0, sum(len(g.token_ids) for _, g in gens)

    for p in (plain, js):
        run(p)
        run(p)
    vocab = lm.tokenizer.vocab_size
    bm = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(B, (vocab + 31) // 32), dtype=np.int64)
    bm = bm.astype(np.int32)
    dev = mx.array(bm.view(np.uint32))
    mx.eval(dev)
    cases = [("upload+unpack", lambda: mx.eval(st.TokenMask(mx.array(bm.view(np.uint32)), vocab).bools())),
             ("mx.array only", lambda: mx.eval(mx.array(bm.view(np.uint32)))),
             ("unpack device-resident", lambda: mx.eval(st.TokenMask(dev, vocab).bools()))]
    for name, fn in cases:
        ts = []
        for k in range(35):
            bm[0, 0] += 1
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(f"{name}: median {1e3 * statistics.median(ts[5:]):.3f} ms", flush=True)
    for name, params in (("plain", plain), ("json", js)):
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            wall, n = run(params)
        tot, cnt = collections.defaultdict(float), collections.Counter()
        for e in p.events():
            if e.device_type.name == "CUDA":
                tot[e.name[:70]] += e.device_time
                cnt[e.name[:70]] += 1
        busy = sum(tot.values()) / 1e6
        print(f"== {name}: wall {wall:.3f} s, tokens {n}, GPU busy {busy:.3f} s ({100 * busy / wall:.0f}%)", flush=True)
        for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:14]:
            print(f"{v / 1e3:9.1f} ms {cnt[k]:6d} calls {v / cnt[k]:8.2f} us/call  {k}")


if __name__ == "__main__":
    main()
