"""The job-throughput driver (``pipeline bench --batch-size``): generated tokens / wall s per batch size.

Many distinct random prompts go through ``BatchEngine`` at each batch size (at B=1 also through the
sequential ``Engine.generate`` loop), with mlx-lm's ``batch_generate`` on the same weights as the peer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..engine import BatchEngine, Engine, GenerateParams, Request
from ..errors import RowError
from ..loader import compute_dtype
from .peer import _peer_batch, load_peer
from .settings import BenchError, _cache_spec, _check_context, parse_cache_kind
from .shapes import _load_ours
from .tables import _batch_row_line, emit, result_document
from .timing import _job_record, _time_job

WARMUP_TOKENS = 8  # new tokens per prompt in a batch row's warm-up run


def distinct_prompts(rng: np.random.Generator, count: int, length: int, vocab: int) -> list[list[int]]:
    """``count`` distinct random prompts of ``length`` token ids below ``vocab``.

    Raises:
        BenchError: fewer than ``count`` distinct prompts exist.
    """
    if vocab**length < count:
        raise BenchError(f"only {vocab}**{length} distinct prompts of {length} tokens exist; asked for {count}")
    seen: set[tuple] = set()
    out: list[list[int]] = []
    while len(out) < count:
        p = tuple(rng.integers(0, vocab, length).tolist())
        if p not in seen:
            seen.add(p)
            out.append(list(p))
    return out


def _ours_sequential(engine: Engine, prompts: list[list[int]], params: GenerateParams) -> dict:
    """The ``Engine.generate`` loop, one prompt after the other (what a job runs at batch size 1)."""
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gens = [engine.generate(p, params) for p in prompts]
    wall = time.perf_counter() - t0
    return _job_record(wall, [len(g.token_ids) for g in gens], compiled=all(g.compiled for g in gens))


def _ours_batch(be: BatchEngine, prompts: list[list[int]], params: GenerateParams) -> dict:
    """Every prompt through ``BatchEngine.run``; the wall time includes each request's prefill."""
    counts: dict[int, int] = {}
    t0 = time.perf_counter()
    for tag, got in be.run(Request(i, p, params) for i, p in enumerate(prompts)):
        if isinstance(got, Exception):
            raise BenchError(f"BatchEngine rejected prompt {tag}: {got}")
        counts[tag] = len(got.token_ids)
    wall = time.perf_counter() - t0
    if len(counts) != len(prompts):
        raise BenchError(f"BatchEngine returned {len(counts)} of {len(prompts)} requests")
    return _job_record(wall, [counts[i] for i in range(len(prompts))], compiled=be.compiled)


def run_batch_bench(model: str | None = None, *, random: str | None = None, batch_sizes=(1, 8, 32, 64, 128),
                    prompts: int = 256, prompts_b1: int | None = None, prompt_tokens: int = 64,
                    max_tokens: int = 128, trials: int = 1, caches=("full",), dequantize: bool | str = "auto",
                    peer: bool = True, variants=("auto",), json_path: str | Path | None = None,
                    prefill_step_size: int = 512, seed: int = 0, echo: Callable[[str], None] = print,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Job throughput (generated tokens / wall seconds, prefill included) of ``prompts`` distinct random
    prompts, greedy, ``ignore_eos``, ``max_tokens`` new tokens each, per batch size B: ours through
    ``pipeline.engine.BatchEngine`` (and at B=1 also the sequential ``Engine.generate`` loop), mlx-lm's
    ``batch_generate`` (completion batch B, prefill batch min(B, 8)) on the same weights as the peer.

    ``variants``: the engine's ``compile`` setting, ``auto`` (what a job uses), ``eager``, ``compiled``.
    Rows at B=1 (sequential, batch and peer) run ``prompts_b1`` prompts (default ``prompts``): their
    rate is per token, and they take longest. Each row: one warm-up run of min(prompts, B + 1) prompts of
    ``WARMUP_TOKENS`` new tokens (every slot filled, then one refilled) (the sequential row: min(prompts, 2)
    prompts of ``max_tokens``), then ``trials`` timed runs; B's rows of ours and mlx-lm run one after the
    other. Prints the table with ``echo`` and returns (and with ``json_path`` writes) the result document.

    Raises:
        BenchError: bad settings, or a run that did not generate ``max_tokens`` per prompt.
    """
    progress = progress or (lambda _s: None)
    batch_sizes = list(batch_sizes)
    prompts_b1 = prompts if prompts_b1 is None else prompts_b1
    if trials < 1 or max_tokens < 1 or prompt_tokens < 1 or prompts < 1 or prompts_b1 < 1:
        raise BenchError("trials, max_tokens, prompt tokens and prompts must be >= 1")
    if not batch_sizes or min(batch_sizes) < 1 or len(set(batch_sizes)) != len(batch_sizes):
        raise BenchError("batch sizes must be distinct integers >= 1")
    for v in variants:
        if v not in ("auto", "eager", "compiled"):
            raise BenchError(f"unknown variant {v!r} (auto, eager, compiled)")
    kinds = [parse_cache_kind(c) for c in caches]
    dtype = compute_dtype("auto")
    notes: list[str] = []
    skipped: list[dict] = []

    bm = _load_ours(model, random, dtype, dequantize, seed, batch_size=max(batch_sizes))
    ours, args = bm.model, bm.model.args
    context = _check_context(args, [prompt_tokens], max_tokens)
    progress(f"loaded {model or 'random ' + random} in {bm.load_s:.1f}s (dtype {dtype}, dequantized {bm.dequantized})")

    rng = np.random.default_rng(seed)
    all_prompts = distinct_prompts(rng, max(prompts, prompts_b1), prompt_tokens, args.vocab_size)
    warmup_tokens = min(max_tokens, WARMUP_TOKENS)

    def n_prompts(b: int) -> int:
        return prompts_b1 if b == 1 else prompts

    def params(n_new: int) -> GenerateParams:
        return GenerateParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)

    ref, peer_info = load_peer(peer, bm.config, bm.weights, dtype, notes, "mlx_lm.generate.batch_generate",
                               prefill_step_size=prefill_step_size, prefill_batch_size="min(B, 8)", stop_tokens=[])

    engines: dict[tuple, Engine] = {}
    run_kinds = []
    for kind in kinds:
        for variant in variants:
            compile_setting = {"auto": "auto", "eager": False, "compiled": True}[variant]
            try:
                engines[kind["name"], variant] = Engine(
                    ours, eos_token_ids=[], context_length=context, prefill_step_size=prefill_step_size,
                    compile=compile_setting, cache_spec=_cache_spec(kind))
            except (ValueError, NotImplementedError, RowError) as e:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"], "reason": str(e)})
                continue
        if any(k[0] == kind["name"] for k in engines):
            run_kinds.append(kind)
        if ref is not None and kind["name"] != "full":
            notes.append(f"cache {kind['name']}: no mlx-lm row (batch_generate is run with full caches only)")

    rows: list[dict] = []

    def base(impl, variant, compile_setting, kind, b):
        return {"mode": "batch", "impl": impl, "variant": variant, "compile": compile_setting, "cache": kind["name"],
                "max_kv_size": kind["max_kv_size"], "kv_bits": kind["kv_bits"], "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens, "batch_size": b, "prompts": n_prompts(b)}

    def add(row, timed):
        row.update(timed)
        row["trace_count_after_warmup"] = row.pop("after_warmup")
        row["compiled"] = row["trials"][-1]["compiled"]
        for t in row["trials"]:
            if (t["min_tokens_per_prompt"], t["max_tokens_per_prompt"]) != (max_tokens, max_tokens):
                raise BenchError(f"{row['impl']} {row['variant']} B={row['batch_size']} generated "
                                 f"{t['min_tokens_per_prompt']}-{t['max_tokens_per_prompt']} tokens per prompt, "
                                 f"not {max_tokens}")
        rows.append(row)
        progress(_batch_row_line(row))

    for b in batch_sizes:
        ps = all_prompts[: n_prompts(b)]
        for kind in run_kinds:
            for variant in variants:
                engine = engines.get((kind["name"], variant))
                if engine is None:
                    continue
                if b == 1:
                    row = base("pipeline", "sequential", variant, kind, 1)
                    try:
                        timed = _time_job(lambda p, n: _ours_sequential(engine, p, params(n)), ps, min(len(ps), 2),
                                          max_tokens, max_tokens, trials, probe=lambda: engine.trace_count)
                    except (ValueError, NotImplementedError, RowError) as e:
                        skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                    else:
                        add(row, timed)
                        row["trace_count"] = engine.trace_count
                row = base("pipeline", "batch", variant, kind, b)
                try:
                    be = BatchEngine(engine, b, prompt_tokens + max_tokens)
                    timed = _time_job(lambda p, n: _ours_batch(be, p, params(n)), ps, min(len(ps), b + 1),
                                      warmup_tokens, max_tokens, trials, probe=lambda: be.trace_count)
                except (ValueError, NotImplementedError, RowError) as e:
                    skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                else:
                    add(row, timed)
                    row["trace_count"] = be.trace_count
                    try:
                        row["kv_bytes"] = be.kv_bytes()
                    except Exception:  # noqa: BLE001 - informational only
                        row["kv_bytes"] = None
                del be
        if ref is not None and any(k["name"] == "full" for k in run_kinds):
            pbs = min(b, 8)
            row = base("mlx-lm", "batch_generate", None, parse_cache_kind("full"), b)
            row["prefill_batch_size"] = pbs
            timed = _time_job(lambda p, n: _peer_batch(ref, p, n, b, pbs, prefill_step_size), ps, min(len(ps), b + 1),
                              warmup_tokens, max_tokens, trials)
            add(row, timed)

    for row in rows:
        if row["impl"] != "pipeline":
            continue
        p = next((r for r in rows if r["impl"] == "mlx-lm" and r["cache"] == row["cache"]
                  and r["batch_size"] == row["batch_size"]), None)
        row["ratio_vs_peer"] = row["median"]["job_tps"] / p["median"]["job_tps"] if p else None
        seq = next((r for r in rows if r["impl"] == "pipeline" and r["variant"] == "sequential"
                    and r["cache"] == row["cache"] and r["compile"] == row["compile"]), None)
        row["speedup_vs_sequential"] = row["median"]["job_tps"] / seq["median"]["job_tps"] if seq else None

    doc = result_document(bm, context=context, prompt_tokens=[prompt_tokens], max_tokens=max_tokens, trials=trials,
                          kinds=kinds, variants=variants, prefill_step_size=prefill_step_size, seed=seed,
                          peer_info=peer_info, rows=rows, skipped=skipped, notes=notes,
                          batch={"batch_sizes": batch_sizes, "prompts": prompts, "prompts_b1": prompts_b1,
                                 "warmup_tokens": warmup_tokens})
    return emit(doc, echo, json_path)
