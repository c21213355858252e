"""The structured-output worker's step (``SlotMasks._work``) in parts, for 256 matchers of
jobs/bench_structured.yaml's JSON schema on the real default model's tokenizer, with no model run: llguidance's
``consume_token_par`` (advance every matcher by a token), ``fill_next_token_bitmask_par`` (every next-token
mask), then the Python that follows them (each matcher's verdict, the rows kept). Each step feeds every matcher a
token its mask allows. Prints the median (and mean) milliseconds of each part over 30 steps, for each count of
matcher families in ``--families`` (``structured.MATCHER_FAMILIES``: the fresh matchers whose lexers the rows'
matchers share; the matchers listed family by family, as ``SlotMasks`` lists them), each from cold lexers.

Usage (from the repository root)::

    PYTHONPATH=. python docs/bench/structured_worker.py --families 1,2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import llguidance.numpy as llnp
import numpy as np
import yaml

from pipeline import load_model
from pipeline.engine import structured as st

ROOT = Path(__file__).resolve().parents[2]
ROWS, STEPS = 256, 30


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=str(st.MATCHER_FAMILIES))
    args = ap.parse_args()
    lm = load_model()
    schema = yaml.safe_load((ROOT / "jobs/bench_structured.yaml").read_text())["generation"]["structured"]["json"]
    params = st.StructuredOutputsParams(json=schema)
    eos = lm.engine.eos_token_ids
    for families in (int(f) for f in args.families.split(",")):
        st.MATCHER_FAMILIES = families
        st._fresh_matcher.cache_clear()
        run(lm, params, eos, families)


def run(lm, params, eos, families: int):
    pairs = [(st.Constraint(params, lm.tokenizer, eos, eos), b) for b in range(ROWS)]
    pairs.sort(key=lambda cb: cb[0].family)
    masks = st.SlotMasks(ROWS)
    ex = masks._executor()
    spans: dict[str, list[float]] = {"consume": [], "fill": [], "verdicts": [], "rows": []}
    for step in range(STEPS):
        words = masks._bitmask(pairs)
        llnp.fill_next_token_bitmask_par(ex, [(c.matcher, b) for c, b in pairs], words)
        toks = []
        for b in range(ROWS):
            allowed = np.flatnonzero(np.unpackbits(words[b].view(np.uint8), bitorder="little"))
            toks.append(int(allowed[(step * 7 + b) % len(allowed)]))
        feed = [(c, toks[b]) for c, b in pairs if not c.stopped]
        t0 = time.perf_counter()
        oks = llnp.consume_token_par(ex, [(c.matcher, t) for c, t in feed])
        t1 = time.perf_counter()
        llnp.fill_next_token_bitmask_par(ex, [(c.matcher, b) for c, b in pairs], words)
        t2 = time.perf_counter()
        for (c, t), ok in zip(feed, oks):
            c.verdict(t, ok)
        t3 = time.perf_counter()
        masks._rows(pairs)
        t4 = time.perf_counter()
        for c, t in feed:
            c.consume(t)
        for k, v in zip(spans, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spans[k].append(v)
    print(f"families {families}:", {k: round(1e3 * statistics.median(v), 3) for k, v in spans.items()},
          "mean", {k: round(1e3 * statistics.mean(v), 3) for k, v in spans.items()},
          f"ms ({STEPS} steps, {ROWS} matchers)")


if __name__ == "__main__":
    main()
