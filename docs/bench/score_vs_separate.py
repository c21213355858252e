"""Rows/s of a 4-choice scoring job on the real default model: the shared-context batch
(``engine.score.score_shared``) vs one full prefill of context + choice per choice
(``engine.score.score_separately``), in one process, on the same rows, the job's prompt building included.

Usage (from the repository root): ``python docs/bench/score_vs_separate.py ROWS`` (rows cycle through the
20 questions of data_samples/arc_style.parquet, each with its own id in the context). Both paths first run
the 20 questions once, untimed (the warm-up).
"""

import statistics
import sys
import time

import pipeline
import pyarrow.parquet as pq

from pipeline.engine.score import score_separately, score_shared
from pipeline.inputs import InputRow
from pipeline.jobspec import InputSpec
from pipeline.prompts import build_score_prompt

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 200
lm = pipeline.load_model()
t = pq.read_table("data_samples/arc_style.parquet").to_pylist()
spec = InputSpec(path="x", apply_chat_template=False)
items = [(InputRow(index=i, id=i, prompt=f"Question {i}: {t[i % 20]['question']}\nAnswer: ", messages=None),
          t[i % 20]["choices"]) for i in range(rows)]


# Warm-up, untimed: both paths over the 20 distinct questions, so every prompt length the timed rows use has
# run once (on a GPU each new length compiles its kernels the first time).
t0 = time.perf_counter()
for k, (row, choices) in enumerate(items[:20]):
    sp = build_score_prompt(row, spec, lm.tokenizer, choices)
    score_shared(lm.engine, sp.context_ids, sp.continuation_ids)
    score_separately(lm.engine, sp.context_ids, sp.continuation_ids)
    if k % 5 == 4:
        print(f"warm-up: {k + 1} of 20 rows, {time.perf_counter() - t0:.1f} s", flush=True)
print(f"warm-up (20 rows, both paths): {time.perf_counter() - t0:.1f} s", flush=True)
ctx = [len(build_score_prompt(r, spec, lm.tokenizer, c).context_ids) for r, c in items[:20]]
print(f"{rows} rows x 4 choices; context tokens median {statistics.median(ctx)}", flush=True)
# Interleaved in blocks of 10 rows, so both paths see the same load on the machine; prompt building included.
spent = {score_shared: 0.0, score_separately: 0.0}
for b in range(0, rows, 10):
    for fn in spent:
        t0 = time.perf_counter()
        for row, choices in items[b : b + 10]:
            sp = build_score_prompt(row, spec, lm.tokenizer, choices)
            fn(lm.engine, sp.context_ids, sp.continuation_ids)
        spent[fn] += time.perf_counter() - t0
    # every 10 rows, so that a run stopped early still reports
    print(f"{b + 10} rows: shared {spent[score_shared]:.1f} s, separate {spent[score_separately]:.1f} s", flush=True)
shared, separate = spent[score_shared], spent[score_separately]
print(f"shared context: {shared:.1f} s, {rows / shared:.2f} rows/s")
print(f"separate prefills: {separate:.1f} s, {rows / separate:.2f} rows/s")
print(f"ratio: {separate / shared:.2f}x")
