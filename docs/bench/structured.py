"""The cost of structured output on the real default model, in one process: generated tokens / wall s of
the same rows with and without a JSON schema (jobs/bench_structured.yaml's), at batch 1 (``Engine.generate``)
and at each batch size (``BatchEngine.run``), median of trials after a warm-up; and what llguidance's mask
costs per token on the host (the finished completions' tokens replayed through a matcher: mask + consume,
and the batched mask of B matchers at once).

Prompts: the first ROWS rows of data_samples/real_prompts_1024.parquet, built as a job builds them (chat
template, one user turn). Greedy; EOS ends a row; every row's tokens counted, the stopping EOS excluded.

Usage (from the repository root)::

    PYTHONPATH=. python docs/bench/structured.py --rows 32 --batch-sizes 1,8 --max-tokens 64 --trials 3
    PYTHONPATH=. python docs/bench/structured.py --rows 1024 --rows-b1 32 --batch-sizes 1,64,256 --max-tokens 128

``--json-variants default,threads-4``: a JSON run per variant in every trial, beside the same trial's plain run:
``default`` (the code as it is), ``threads-N`` (llguidance's threads ``structured.MASK_THREADS`` N and
``MATCHER_FAMILIES`` min(8, N)).

Prints one line per batch size (plain and JSON tok/s medians, each JSON setting's ratio of medians and median of
per-trial ratios) and the mask costs; ``--json PATH`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pipeline
import llguidance
import llguidance.numpy as llnp
import numpy as np
import yaml

from pipeline.bench.throughput import file_prompts, file_rows
from pipeline.engine import BatchEngine, GenerateParams, Request
from pipeline.engine import structured as st
from pipeline.engine.structured import StructuredOutputsParams, ll_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run(lm, prompts, params, b):
    """(tokens, seconds, generations) of one pass over ``prompts``."""
    t0 = time.perf_counter()
    if b == 1:
        gens = [lm.engine.generate(p, params) for p in prompts]
    else:
        gens = [g for _, g in sorted(BatchEngine(lm.engine, b, max(len(p) for p in prompts) + params.max_tokens)
                                     .run([Request(i, p, params) for i, p in enumerate(prompts)]))]
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0, gens


def mask_costs(lm, schema, gens, batch):
    """Median microseconds per token of one matcher's mask and consume, replaying ``gens``' tokens; and of
    one batched mask of ``batch`` matchers (``fill_next_token_bitmask_par``), per step."""
    tok = ll_tokenizer(lm.tokenizer, tuple(sorted(lm.engine.eos_token_ids)))
    grammar = StructuredOutputsParams(json=schema).lark()
    mask = np.empty((1, (tok.vocab_size + 31) // 32), dtype=np.int32)
    per_mask, per_consume = [], []
    for g in gens:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        for t in g.token_ids:
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(m, mask)
            t1 = time.perf_counter()
            m.consume_token(t)
            per_mask.append(t1 - t0)
            per_consume.append(time.perf_counter() - t1)
    executor, steps = llguidance.LLExecutor(), []
    seqs = [g.token_ids for g in gens][:batch]
    matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in seqs]
    masks = np.empty((len(seqs), mask.shape[1]), dtype=np.int32)
    for k in range(max(len(s) for s in seqs)):
        live = [(m, i) for i, (m, s) in enumerate(zip(matchers, seqs)) if k < len(s)]
        t0 = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, live, masks)
        steps.append(time.perf_counter() - t0)
        for m, i in live:
            m.consume_token(seqs[i][k])
    us = lambda xs: round(1e6 * statistics.median(xs), 1)  # noqa: E731
    return {"mask_us": us(per_mask), "mask_p90_us": round(1e6 * float(np.percentile(per_mask, 90)), 1),
            "consume_us": us(per_consume), "batched_rows": len(seqs), "batched_mask_us_per_step": us(steps),
            "tokens_replayed": len(per_mask)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rows-b1", type=int, default=None, help="rows at batch 1 (default: --rows)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--json-variants", default="default",
                    help="the JSON runs of each trial, a comma list: default, threads-N (see above)")
    args = ap.parse_args()
    schema = yaml.safe_load((ROOT / "jobs/bench_structured.yaml").read_text())["generation"]["structured"]["json"]
    lm = pipeline.load_model(batch_size=max(int(b) for b in args.batch_sizes.split(",")))
    prompts = file_prompts(*file_rows(ROOT / "data_samples/real_prompts_1024.parquet", "prompt", args.rows), lm.tokenizer)
    structured = StructuredOutputsParams(json=schema)
    variants = args.json_variants.split(",")
    json_names = ["json" if v == "default" else f"json-{v}" for v in variants]
    settings = {"plain": GenerateParams(max_tokens=args.max_tokens),
                **{name: GenerateParams(max_tokens=args.max_tokens, structured=structured) for name in json_names}}
    as_is = (st.MASK_THREADS, st.MATCHER_FAMILIES)
    threads = {name: int(v[len("threads-"):]) for name, v in zip(json_names, variants) if v.startswith("threads-")}
    setups = {name: (n, min(8, n)) for name, n in threads.items()}
    rows, gens = [], None
    for b in (int(x) for x in args.batch_sizes.split(",")):
        ps = prompts[: args.rows_b1] if b == 1 and args.rows_b1 else prompts
        for params in settings.values():
            run(lm, ps[: max(2, b)], GenerateParams(max_tokens=8, structured=params.structured), b)  # warm-up
        tps = {name: [] for name in settings}
        for _ in range(args.trials):  # interleaved, so drift hits both alike
            for name, params in settings.items():
                st.MASK_THREADS, st.MATCHER_FAMILIES = setups.get(name, as_is)
                n, s, g = run(lm, ps, params, b)
                tps[name].append(n / s)
                if name != "plain":
                    gens = g
        med = {name: statistics.median(v) for name, v in tps.items()}
        row = {"batch_size": b, "rows": len(ps), "plain_tps": round(med["plain"], 1)}
        for name in json_names:
            pairs = [j / p for j, p in zip(tps[name], tps["plain"])]
            row.update({f"{name}_tps": round(med[name], 1), f"{name}_ratio": round(med[name] / med["plain"], 3),
                        f"{name}_pair_ratio": round(statistics.median(pairs), 3)})
        row.update({"trials": {k: [round(x, 1) for x in v] for k, v in tps.items()},
                    "json_finished": sum(g.finish_reason == "stop" for g in gens)})
        print(json.dumps(row), flush=True)
        rows.append(row)
    costs = mask_costs(lm, schema, gens, max(int(b) for b in args.batch_sizes.split(",")))
    print(json.dumps(costs), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "mask": costs}, indent=1))


if __name__ == "__main__":
    main()
