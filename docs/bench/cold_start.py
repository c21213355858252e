"""Where a cold start's time goes: the kernels a job compiles on a machine with empty kernel caches.

Loads the model as a job does, times ``LoadedModel.warm_up`` and then each of the first ``--rows`` real
prompts (greedy, ``--max-tokens`` each), and after every phase counts the entries of MLX's PTX cache
(``MLX_PTX_CACHE_DIR``: one file per kernel NVRTC compiled) and the CUDA driver's cache (``CUDA_CACHE_PATH``).
At the end it lists the PTX entries in the order they were written with the seconds since the previous one
(that kernel's NVRTC compile plus the driver's compile of the one before it, and any host work between them).

Run it with both caches pointed at empty directories for a cold start, e.g.

    MLX_PTX_CACHE_DIR=/tmp/cold/ptx CUDA_CACHE_PATH=/tmp/cold/cu \
        PYTHONPATH=. python docs/bench/cold_start.py --rows 20 --out cold.json

then again with one cache kept and the other emptied to split NVRTC's share from the driver's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def entries(path: str | None) -> list[tuple[float, int, str]]:
    """``(mtime s, bytes, relative name)`` of every file under ``path`` (none when unset or missing)."""
    if not path or not os.path.isdir(path):
        return []
    out = []
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, os.path.relpath(p, path)))
    return sorted(out)


def counts() -> dict:
    ptx, cu = entries(os.environ.get("MLX_PTX_CACHE_DIR")), entries(os.environ.get("CUDA_CACHE_PATH"))
    return {"ptx_files": len(ptx), "ptx_bytes": sum(e[1] for e in ptx), "cuda_files": len(cu),
            "cuda_bytes": sum(e[1] for e in cu)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", default="data_samples/real_prompts_1024.parquet")
    ap.add_argument("--dequantize", action="store_true",
                    help="load the weights dequantized (prefill through dense matmuls, not MLX's quantized ones)")
    ap.add_argument("--no-dense-prefill", action="store_true",
                    help="keep MLX's quantized matmuls for prefill (loader.should_dense_prefill forced off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    t0 = time.time()
    import pipeline  # noqa: F401  (before mlx.core: the kernel caches' and BLAS's set-up)
    import mlx.core as mx
    import pyarrow.parquet as pq

    from pipeline import loader
    from pipeline.loader import load_model

    if args.no_dense_prefill:
        loader.should_dense_prefill = lambda model, dtype: False

    log = {"env": {k: os.environ.get(k) for k in ("MLX_PTX_CACHE_DIR", "CUDA_CACHE_PATH", "MLX_CUDA_USE_CUDNN_SDPA")},
           "args": vars(args), "phases": []}

    def phase(name: str, t: float, **extra) -> None:
        row = {"phase": name, "s": round(time.time() - t, 3), "at_s": round(time.time() - t0, 3), **counts(), **extra}
        log["phases"].append(row)
        print(json.dumps(row), flush=True)

    t = time.time()
    lm = load_model(args.model, batch_size=args.batch_size, dequantize=True if args.dequantize else "auto")
    mx.eval(lm.model.parameters())
    from pipeline.models import DensePrefillLinear

    phase("load", t, path=lm.engine.path.name,
          dense_prefill=any(type(m) is DensePrefillLinear for _, m in lm.model.named_modules()))
    t = time.time()
    lm.warm_up()
    phase("warm_up", t)
    prompts = pq.read_table(args.prompts, columns=["prompt"]).column("prompt").to_pylist()[: args.rows]
    for i, p in enumerate(prompts):
        t = time.time()
        gen = lm.engine.generate(_ids(lm, p), _params(args.max_tokens))
        phase(f"row {i}", t, prompt_tokens=gen.prompt_tokens, new_tokens=len(gen.token_ids),
              ttft_s=round(gen.ttft_s, 3))
    ptx = entries(os.environ.get("MLX_PTX_CACHE_DIR"))
    gaps, prev = [], t0
    for mtime, size, name in ptx:
        gaps.append({"name": name, "bytes": size, "gap_s": round(mtime - prev, 3), "at_s": round(mtime - t0, 3)})
        prev = mtime
    log["ptx"] = gaps
    print("slowest gaps before a PTX entry:")
    for g in sorted(gaps, key=lambda g: -g["gap_s"])[:25]:
        print(f"  {g['gap_s']:8.3f} s  at {g['at_s']:8.3f}  {g['bytes']:>9}  {g['name'][:110]}")
    if args.out:
        Path(args.out).write_text(json.dumps(log, indent=1))
    return 0


def _ids(lm, prompt: str) -> list[int]:
    from pipeline.inputs import InputRow
    from pipeline.jobspec import InputSpec
    from pipeline.prompts import build_prompt

    spec = InputSpec(path="", apply_chat_template=True)
    return build_prompt(InputRow(index=0, id=0, prompt=prompt, messages=None), spec, lm.tokenizer).token_ids


def _params(max_tokens: int):
    from pipeline.engine.params import GenerateParams

    return GenerateParams(max_tokens=max_tokens, temperature=0.0)


if __name__ == "__main__":
    sys.exit(main())
