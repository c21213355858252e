"""Sampled vs greedy job throughput in ONE process, and the sampling kernel alone (MLX's CUDA backend).

Job: a random model shape (dense float16 weights, as a batched GPU job loads them), ROWS distinct random
prompts of PROMPT tokens, exactly MAX new tokens each (EOS ignored), through ``BatchEngine.run`` at batch
size B: greedy, temperature 0.8 / top_p 0.95, and temperature 0.8 alone, interleaved, median of TRIALS after
a warm-up of each. Kernel: ``sampler.sample_tokens`` on B x vocab float32 rows (flat: random normal logits
of a random-weights model's spread; peaked: a real model's, a few tokens far above the rest), top_p 0.95,
with the binned cut (``cuda.sample.BINNED``) and 16-byte loads (``VEC``) on and off, median ms of 20 launches,
also with temperature only (no filters).

Usage (from the repository root)::

    PYTHONPATH=. python docs/bench/sampling.py --shape llama-3.2-1b --batch-size 256 --rows 512 --trials 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from pipeline.bench.shapes import _load_ours
from pipeline.bench.throughput import distinct_prompts
from pipeline.engine import BatchEngine, Engine, GenerateParams, Request
from pipeline.engine.cuda import sample as cuda_sample
from pipeline.engine.sampler import row_seed, sample_tokens

SETTINGS = {"greedy": {}, "t0.8_top_p0.95": {"temperature": 0.8, "top_p": 0.95}, "t0.8": {"temperature": 0.8}}


def job(engine, prompts, b, max_tokens, setting):
    t0 = time.perf_counter()
    n = 0
    for tag, got in BatchEngine(engine, b, len(prompts[0]) + max_tokens).run(
            Request(i, p, GenerateParams(max_tokens=max_tokens, ignore_eos=True, seed=row_seed(0, i, 0),
                                         **SETTINGS[setting])) for i, p in enumerate(prompts)):
        if isinstance(got, Exception):
            raise got
        n += len(got.token_ids)
    return n / (time.perf_counter() - t0)


def kernel_ms(rows, vocab, peaked, binned, vec, top_p=0.95, launches=20):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(rows, vocab)).astype(np.float32) * 1.25
    if peaked:
        x[:, :vocab // 1000] += 12 + 4 * rng.random((rows, vocab // 1000))
    x = mx.array(x)
    u = mx.array(rng.random((rows, 1)).astype(np.float32))
    cuda_sample.BINNED, cuda_sample.VEC = binned, vec
    filters = top_p < 1
    mx.eval(sample_tokens(x, vocab, top_p, 0.0, u, filters))
    times = []
    for _ in range(launches):
        t0 = time.perf_counter()
        mx.eval(sample_tokens(x, vocab, top_p, 0.0, u, filters))
        times.append((time.perf_counter() - t0) * 1e3)
    cuda_sample.BINNED = cuda_sample.VEC = True
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--no-job", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    bm = _load_ours(None, a.shape, mx.float16, True, 0, a.batch_size)
    vocab = bm.config["vocab_size"]
    out = {"kernel_ms": {}}
    if cuda_sample.sample_kernel(mx.zeros((1, 4))) is not None:
        for peaked in (False, True):
            for binned, vec in ((True, True), (True, False), (False, False)):
                ms = kernel_ms(a.batch_size, vocab, peaked, binned, vec)
                name = f"{'peaked' if peaked else 'flat'} binned={binned} vec={vec}"
                out["kernel_ms"][name] = ms
                print(f"kernel {a.batch_size} x {vocab} {name}: {ms:.3f} ms", flush=True)
            for vec in (True, False):
                ms = kernel_ms(a.batch_size, vocab, peaked, True, vec, top_p=1.0)
                name = f"{'peaked' if peaked else 'flat'} no filters vec={vec}"
                out["kernel_ms"][name] = ms
                print(f"kernel {a.batch_size} x {vocab} {name}: {ms:.3f} ms", flush=True)
    if not a.no_job:
        engine = Engine(bm.model, eos_token_ids=[], context_length=a.prompt_tokens + a.max_tokens + 8)
        prompts = distinct_prompts(np.random.default_rng(0), a.rows, a.prompt_tokens, vocab)
        res = {s: [] for s in SETTINGS}
        for s in SETTINGS:
            job(engine, prompts[: a.batch_size], a.batch_size, 16, s)  # warm-up
        for _ in range(a.trials):
            for s in SETTINGS:
                res[s].append(job(engine, prompts, a.batch_size, a.max_tokens, s))
                print(f"{s}: {res[s][-1]:,.0f} tok/s", flush=True)
        med = {s: statistics.median(v) for s, v in res.items()}
        out["job_tok_s"] = res
        out["median"] = med
        print("median: " + ", ".join(f"{s} {v:,.0f}" for s, v in med.items())
              + f"; sampled/greedy {med['t0.8_top_p0.95'] / med['greedy']:.3f}, "
              f"temperature-only/greedy {med['t0.8'] / med['greedy']:.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
