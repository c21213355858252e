"""Where a structured-output decode step's time goes: the batched job's host timeline, with and without a JSON
schema (jobs/bench_structured.yaml's), on the real default model, in one process.

The run loop (``BatchEngine.run``) is timed from outside: the step's forward and sampling as built
("forward", "queue: sampling"), the host's kernel launches (``mx.async_eval`` in the batch module: "launch",
every call; "launch: forward", "launch: sampling", "launch: other" by what was built before it), the time
from a step's sampling queued to its tokens read and their masks started ("sampled -> start"; "launched ->
start" from the end of its launch), the structured path's wait for the masks (``SlotMasks.wait``) and their
upload, and the worker thread's llguidance calls (``consume_token_par``, the batched mask); with
``--cprofile N`` also the N functions of most own time (Python 3.12's cProfile sees every thread, the masks'
worker included). Variants (``--variants``), each with and
without the schema: ``default``; ``switch-off`` (``SlotMasks.SWITCH_INTERVAL`` None: Python's 5 ms switch interval
kept); ``switch-N`` (the interval N microseconds); ``mx-array`` (every bitmask uploaded with ``mx.array``);
``mx-load`` (every bitmask uploaded with ``mx.load``: ``structured.LOAD_MIN_BYTES`` 0); ``no-kernel`` (the mask
applied with MLX ops, ``cuda.mask.ENABLED`` off);
``threads-N`` (``structured.MASK_THREADS`` N: llguidance's ``LLExecutor`` with N threads, not its default: 80% of the
CPUs, at most 32);
``families-N`` (``structured.MATCHER_FAMILIES`` N: the rows' matchers copied from N fresh matchers, each with its
own lexer; every variant starts from cold lexers; default ``structured.MATCHER_FAMILIES``); variants combine with
"+" (``threads-8+families-8``); ``unpacked`` (every row of the bitmask uploaded, not only its distinct ones:
``structured.pack`` returns the bitmask itself); ``host-reads`` (``BatchEngine.worker_reads`` off: the host reads a
step's tokens before it starts their masks and launches the next forward); ``pin`` (the host thread on CPU 0 and its
SMT siblings, the worker and llguidance's threads on the other CPUs). (``launch-first``, the forward launched before
the step's tokens were read, went with the order it measured: docs/BENCHMARKS.md, 2026-12-03 late.)

Usage (from the repository root)::

    PYTHONPATH=. python docs/bench/structured_trace.py --rows 512 --batch-size 256 --max-tokens 128 \
        --variants default,switch-off,mx-array,no-kernel

Prints one JSON line per (variant, schema or not): tok/s, steps, and the median milliseconds per step of each
interval.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import pipeline
import llguidance
import llguidance.numpy as llnp
import yaml

from pipeline.bench.throughput import file_prompts
from pipeline.engine import BatchEngine, GenerateParams, Request
from pipeline.engine import batch as batch_module
from pipeline.engine import structured as st
from pipeline.engine.batch_sampler import SlotSampler
from pipeline.engine.cuda import mask as mask_kernel
import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SPANS: dict[str, list[float]] = defaultdict(list)
MARK: dict[str, float] = {}


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t1 = time.perf_counter()
            SPANS[name].append(t1 - t0)
            MARK[name] = t1
    return wrapper


QUEUED = ["other"]  # what the batch module built last: "forward", "sampling" (``SlotSampler.step``) or "other"


def launch(*arrays):
    """``mx.async_eval``, timed as "launch" (every call) and as "launch: " + what was built since the last one:
    "forward" (the constrained path's forward alone), "sampling" (the sampling, with the forward on the plain
    path) or "other" (a prefill's)."""
    what, QUEUED[0] = QUEUED[0], "other"
    return timed("launch: " + what, timed("launch", mx.async_eval))(*arrays)


def queued(what, fn):
    def wrapper(*a, **k):
        try:
            return fn(*a, **k)
        finally:
            QUEUED[0] = what
    return wrapper


class _TimedMx:
    """``mlx.core`` for the batch module, with ``async_eval`` timed (``launch``)."""

    async_eval = staticmethod(launch)

    def __getattr__(self, name):
        return getattr(mx, name)


PIN: list = [None]  # (host CPUs, worker CPUs) of the next run, or None


def instrument():
    cls = st.SlotMasks
    orig_start = cls.start

    def start(self, slots, tokens):
        now = time.perf_counter()
        if "queue: sampling" in MARK:  # the previous step's sampling queued -> its tokens read
            SPANS["sampled -> start"].append(now - MARK["queue: sampling"])
        if "launch: sampling" in MARK:  # ... from the end of its launch
            SPANS["launched -> start"].append(now - MARK["launch: sampling"])
        return orig_start(self, slots, tokens)

    cls.start = start
    batch_module.mx = _TimedMx()

    def wait(self, vocab):
        t0 = time.perf_counter()
        job, self._job = self._job, None
        packed = job.result()
        t1 = time.perf_counter()
        out = self._finish(packed, vocab)
        SPANS["wait: masks"].append(t1 - t0)
        SPANS["host: upload"].append(time.perf_counter() - t1)
        return out

    cls.wait = wait
    st.llnp.consume_token_par = timed("worker: advance", llnp.consume_token_par)
    st.llnp.fill_next_token_bitmask_par = timed("worker: masks", llnp.fill_next_token_bitmask_par)
    def executor(self):
        if self.executor is None:
            if PIN[0] is not None:  # on the worker thread: llguidance's threads, made now, inherit its CPUs
                os.sched_setaffinity(0, PIN[0][1])
            self.executor = llguidance.LLExecutor(st.MASK_THREADS)
        return self.executor

    cls._executor = executor
    cls._work = timed("worker: job", cls._work)
    SlotSampler.step = queued("sampling", timed("queue: sampling", SlotSampler.step))
    orig_fn = BatchEngine._step_fn

    def step_fn(self):
        return queued("forward", timed("forward", orig_fn(self)))

    BatchEngine._step_fn = step_fn


def run(lm, prompts, params, b):
    SPANS.clear()
    MARK.clear()
    every = os.sched_getaffinity(0)
    if PIN[0] is not None:
        os.sched_setaffinity(0, PIN[0][0])
    t0 = time.perf_counter()
    engine = BatchEngine(lm.engine, b, max(len(p) for p in prompts) + params.max_tokens)
    try:
        gens = [g for _, g in engine.run([Request(i, p, params) for i, p in enumerate(prompts)])]
    finally:
        os.sched_setaffinity(0, every)
    s = time.perf_counter() - t0
    n = sum(len(g.token_ids) for g in gens)
    steps = len(SPANS["forward"])
    out = {"tok_s": round(n / s, 1), "tokens": n, "seconds": round(s, 3), "steps": steps,
           "ms_per_step": round(1e3 * s / max(steps, 1), 3)}
    for k, v in SPANS.items():
        out[k] = {"median_ms": round(1e3 * statistics.median(v), 3), "total_s": round(sum(v), 3), "n": len(v)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cprofile", type=int, default=0,
                    help="also profile the first variant's runs (plain and JSON) with cProfile and print their N "
                         "functions of most own time (every thread's)")
    args = ap.parse_args()
    schema = yaml.safe_load((ROOT / "jobs/bench_structured.yaml").read_text())["generation"]["structured"]["json"]
    lm = pipeline.load_model(batch_size=args.batch_size)
    prompts = file_prompts(ROOT / "data_samples/real_prompts_1024.parquet", "prompt", lm.tokenizer, args.rows)
    instrument()
    settings = {"plain": GenerateParams(max_tokens=args.max_tokens),
                "json": GenerateParams(max_tokens=args.max_tokens, structured=st.StructuredOutputsParams(json=schema))}
    for params in settings.values():
        run(lm, prompts[: args.batch_size], GenerateParams(max_tokens=8, structured=params.structured), args.batch_size)
    results = []
    device_words, interval, families = st.device_words, st.SlotMasks.SWITCH_INTERVAL, st.MATCHER_FAMILIES
    load_min = st.LOAD_MIN_BYTES
    pack = st.pack
    for name in args.variants.split(","):
        parts = name.split("+")
        def number(prefix, default, parts=parts):
            return next((int(p[len(prefix):]) for p in parts if p.startswith(prefix)), default)

        st.device_words = device_words if "mx-array" not in parts else (lambda bm: mx.array(bm.view(np.uint32)))
        st.LOAD_MIN_BYTES = 0 if "mx-load" in parts else load_min
        switch = next((p[len("switch-"):] for p in parts if p.startswith("switch-")), None)
        st.SlotMasks.SWITCH_INTERVAL = interval if switch is None else None if switch == "off" else 1e-6 * int(switch)
        mask_kernel.ENABLED = "no-kernel" not in parts
        st.pack = pack if "unpacked" not in parts else (lambda bm: (bm, np.arange(len(bm), dtype=np.int32)))
        st.MASK_THREADS = number("threads-", None)
        BatchEngine.worker_reads = "host-reads" not in parts
        PIN[0] = pin_sets() if "pin" in parts else None
        st.MATCHER_FAMILIES = number("families-", families)
        st._fresh_matcher.cache_clear()  # each run's families start from cold lexers
        for kind, params in settings.items():
            row = {"variant": name, "kind": kind, **run(lm, prompts, params, args.batch_size)}
            print(json.dumps(row), flush=True)
            results.append(row)
            if args.cprofile and name == args.variants.split(",")[0]:
                results.append({"kind": kind, **host_profile(lm, prompts, params, args.batch_size, args.cprofile)})
                print(json.dumps(results[-1]), flush=True)
    results.append(upload_costs(args.batch_size, lm.tokenizer.vocab_size))
    print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def pin_sets() -> tuple[set, set]:
    """(CPU 0 and its SMT siblings, the other CPUs this process may use)."""
    every = os.sched_getaffinity(0)
    path = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    host = {0}
    if path.exists():
        for part in path.read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            host |= set(range(int(lo), int(hi or lo) + 1))
    return host & every, every - host


def host_profile(lm, prompts, params, b: int, top: int) -> dict:
    """The run again under cProfile: the ``top`` functions by own time, every thread's (ms per step; time a C
    call spends waiting, e.g. ``tolist`` for the device, counts as its own)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    out = run(lm, prompts, params, b)
    prof.disable()
    stats = pstats.Stats(prof).stats
    steps = max(out["steps"], 1)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"cprofile_ms_per_step": round(out["ms_per_step"], 3),
            "functions": [{"fn": f"{Path(f).name}:{line}:{name}", "calls": nc,
                           "own_ms_per_step": round(1e3 * tt / steps, 3), "cum_ms_per_step": round(1e3 * ct / steps, 3)}
                          for (f, line, name), (_, nc, tt, ct, _) in rows]}


def upload_costs(rows: int, vocab: int, trials: int = 30) -> dict:
    """Median ms of one step's mask on the device (a random bitmask of 1, 8, 32 and ``rows`` rows uploaded, then
    applied to as many rows of float32 logits, evaluated; and the host's part: the upload's call alone), by
    ``mx.array`` and by ``mx.load`` (``structured.device_words`` with ``LOAD_MIN_BYTES`` 0)."""
    words = (vocab + 31) // 32
    out = {"upload_rows": rows}
    limit = st.LOAD_MIN_BYTES
    for n in sorted({1, 8, 32, rows}):
        bm = np.random.default_rng(n).integers(-2**31, 2**31 - 1, size=(n, words), dtype=np.int64).astype(np.int32)
        x = mx.zeros((n, vocab), mx.float32)
        mx.eval(x)
        for name, min_bytes in (("mx.array", 1 << 62), ("mx.load", 0)):
            st.LOAD_MIN_BYTES = min_bytes
            ts, host = [], []
            for k in range(trials + 5):
                bm[0, 0] += 1
                t0 = time.perf_counter()
                up = st.device_words(bm)
                host.append(time.perf_counter() - t0)
                mx.eval(st.TokenMask(up, vocab).apply(x))
                ts.append(time.perf_counter() - t0)
            out[f"{name}_{n}_rows_ms"] = round(1e3 * statistics.median(ts[5:]), 3)
            out[f"{name}_{n}_rows_host_ms"] = round(1e3 * statistics.median(host[5:]), 3)
    st.LOAD_MIN_BYTES = limit
    return out


if __name__ == "__main__":
    main()
