"""The job-throughput driver (``pipeline bench --batch-size``): generated tokens / wall s per batch size.

Many distinct random prompts, or the rows of a prompts file built as a job builds them, go through
``BatchEngine`` at each batch size (at B=1 also through the sequential ``Engine.generate`` loop), greedy or
sampled, with mlx-lm's ``batch_generate`` on the same weights, in the same weight format, as the peer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..engine import BatchEngine, Engine, GenerateParams, Request
from ..engine.sampler import SAMPLING_EPS, row_seed
from ..errors import RowError
from ..inputs import InputError, InputRow, read_rows
from ..jobspec import InputSpec
from ..loader import compute_dtype
from ..prompts import build_prompt
from ..tokenizer import Tokenizer
from .peer import PeerTokenizer, _peer_batch, load_peer, peer_sampler
from .settings import BenchError, BenchFailed, _cache_spec, _check_context, parse_cache_kind
from .shapes import _load_ours, weight_format
from .tables import _batch_row_line, emit, result_document, same_format_peer
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


def file_rows(path: str | Path, column: str, limit: int | None = None) -> tuple[InputSpec, list[InputRow]]:
    """The first ``limit`` rows (None: every row) of the input ``path``, read as a job with ``input: {path:
    PATH, prompt_column: COLUMN}`` (every other input key at its default) reads them (``inputs.read_rows``),
    and that input spec; before the model loads, so a bad file or column costs no load.

    Raises:
        BenchError: the file or the column cannot be read (``--prompts-file: `` and the input's message).
    """
    spec = InputSpec(path=str(path), prompt_column=column)
    try:
        rows, _ = read_rows(spec, limit)
    except InputError as e:
        raise BenchError(f"--prompts-file: {e}") from None
    return spec, rows


def file_prompts(spec: InputSpec, rows: list[InputRow], tokenizer: Tokenizer) -> list[list[int]]:
    """Prompt token ids of ``rows`` (``file_rows``), built as a job builds them: ``prompts.build_prompt``
    (the chat template with one user turn, one BOS if the model asks for it, special-token text in the data
    encoded as plain text).

    Raises:
        BenchError: the model has no chat template, or a row a job would fail (a null or empty prompt),
            naming its id.
    """
    if not tokenizer.chat_template:
        raise BenchError("--prompts-file: the model has no chat template (a job needs "
                         "input.apply_chat_template: false for it; the benchmark runs jobs with the template)")
    out = []
    for row in rows:
        try:
            if row.error is not None:
                raise RowError(row.error)
            out.append(build_prompt(row, spec, tokenizer).token_ids)
        except RowError as e:
            raise BenchError(f"{spec.path}: row {row.id!r}: {e}") from None
    return out


def _ours_sequential(engine: Engine, prompts: list[list[int]], params: Callable[[int], GenerateParams]) -> dict:
    """The ``Engine.generate`` loop, one prompt after the other (what a job runs at batch size 1);
    ``params(i)``: prompt i's settings."""
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gens = [engine.generate(p, params(i)) for i, p in enumerate(prompts)]
    wall = time.perf_counter() - t0
    return _job_record(wall, [len(g.token_ids) for g in gens], compiled=all(g.compiled for g in gens))


def _ours_batch(be: BatchEngine, prompts: list[list[int]], params: Callable[[int], GenerateParams]) -> dict:
    """Every prompt through ``BatchEngine.run`` (``params(i)``: prompt i's settings); the wall time runs
    from the first request's prefill to the last token."""
    counts: dict[int, int] = {}
    t0 = time.perf_counter()
    for tag, got in be.run(Request(i, p, params(i)) for i, p in enumerate(prompts)):
        if isinstance(got, Exception):
            raise BenchFailed(f"BatchEngine rejected prompt {tag}: {got}")
        counts[tag] = len(got.token_ids)
    wall = time.perf_counter() - t0
    if len(counts) != len(prompts):
        raise BenchFailed(f"BatchEngine returned {len(counts)} of {len(prompts)} requests")
    return _job_record(wall, [counts[i] for i in range(len(prompts))], compiled=be.compiled, path=be.path)


def _check_sampling(temperature: float, top_p: float) -> None:
    """Raises: BenchError: temperature not a finite number >= 0, or top_p outside (0, 1] (the job's ranges)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise BenchError(f"--temperature must be a finite number >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise BenchError(f"--top-p must be in (0, 1], got {top_p!r}")


def run_batch_bench(model: str | None = None, *, random: str | None = None, batch_sizes=(1, 8, 32, 64, 128),
                    prompts: int | None = None, prompts_b1: int | None = None, prompt_tokens: int = 64,
                    max_tokens: int = 128, trials: int = 1, caches=("full",), dequantize: bool | str = "auto",
                    peer: bool = True, variants=("auto",), json_path: str | Path | None = None,
                    prefill_step_size: int = 512, seed: int = 0, temperature: float = 0.0, top_p: float = 1.0,
                    prompts_file: str | Path | None = None, prompt_column: str = "prompt",
                    echo: Callable[[str], None] = print, progress: Callable[[str], None] | None = None) -> dict:
    """Job throughput (generated tokens / wall seconds, prefill included) per batch size B: ours through
    ``pipeline.engine.BatchEngine`` (and at B=1 also the sequential ``Engine.generate`` loop), mlx-lm's
    ``batch_generate`` (completion batch B, prefill batch min(B, 8)) on the same weights as the peer.

    Prompts: ``prompts`` (default 256) distinct random prompts of ``prompt_tokens`` tokens, ``ignore_eos``,
    exactly ``max_tokens`` new tokens each; or with ``prompts_file`` (a model spec only, not ``random``)
    the first ``prompts`` rows (default: all) of that input, column ``prompt_column``, built as a job
    builds them (``file_prompts``), EOS ending a row (the model's EOS ids on both sides), at most
    ``max_tokens`` new tokens each. Sampling: ``temperature`` 0 (below ``sampler.SAMPLING_EPS``) is greedy; above 0 each prompt samples
    with its own seed (``sampler.row_seed(seed, i, 0)``, as a job's row i) and ``top_p``; the peer runs
    ``mlx_lm.sample_utils.make_sampler(temperature, top_p=top_p)``.

    Weights: the peer is given the weights in our format: dense ``dtype`` when ours were dequantized,
    else quantized as read. Each row records its ``weights`` (``weight_format``); ``ratio_vs_peer`` is
    computed only between rows of the same format (else None, and a note says why).

    ``variants``: the engine's ``compile`` setting, ``auto`` (what a job uses), ``eager``, ``compiled``.
    Rows at B=1 (sequential, batch and peer) run ``prompts_b1`` prompts (default ``prompts``): their
    rate is per token, and they take longest. Each row: one warm-up run of min(prompts, B + 1) prompts of
    ``WARMUP_TOKENS`` new tokens (every slot filled, then one refilled) (the sequential row: min(prompts, 2)
    prompts of ``max_tokens``), reported as ``warmup_s``, then ``trials`` timed runs; B's rows of ours and
    mlx-lm run one after the other. Prints the table with ``echo`` and returns (and with ``json_path``
    writes) the result document.

    Raises:
        BenchError: bad settings; random prompts: a run that did not generate ``max_tokens`` per prompt.
        InputError: ``prompts_file`` or its column cannot be read.
    """
    progress = progress or (lambda _s: None)
    batch_sizes = list(batch_sizes)
    real = prompts_file is not None
    if real and random is not None:
        raise BenchError("--prompts-file needs a MODEL (its tokenizer and chat template), not --random")
    if prompts is None and not real:
        prompts = 256
    if trials < 1 or max_tokens < 1 or prompt_tokens < 1 or (prompts is not None and prompts < 1) or \
            (prompts_b1 is not None and prompts_b1 < 1):
        raise BenchError("trials, max_tokens, prompt tokens and prompts must be >= 1")
    if not batch_sizes or min(batch_sizes) < 1 or len(set(batch_sizes)) != len(batch_sizes):
        raise BenchError("batch sizes must be distinct integers >= 1")
    for v in variants:
        if v not in ("auto", "eager", "compiled"):
            raise BenchError(f"unknown variant {v!r} (auto, eager, compiled)")
    _check_sampling(temperature, top_p)
    if temperature < SAMPLING_EPS:  # greedy in our sampler (vLLM's rule): labelled and compared as greedy
        temperature = 0.0
    kinds = [parse_cache_kind(c) for c in caches]
    dtype = compute_dtype("auto")
    notes: list[str] = []
    skipped: list[dict] = []

    if real:  # read before the model loads: a missing file or column costs no load
        file_spec, rows = file_rows(prompts_file, prompt_column,
                                    None if prompts is None else max(prompts, prompts_b1 or 0))

    bm = _load_ours(model, random, dtype, dequantize, seed, batch_size=max(batch_sizes))
    ours, args = bm.model, bm.model.args
    ours_weights = weight_format(ours)
    progress(f"loaded {model or 'random ' + random} in {bm.load_s:.1f}s (dtype {dtype}, dequantized {bm.dequantized}, "
             f"weights {ours_weights})")

    file_info = None
    if real:
        all_prompts = file_prompts(file_spec, rows, bm.tokenizer)
        if not all_prompts:
            raise BenchError(f"{prompts_file} has no rows")
        prompts = len(all_prompts) if prompts is None else prompts
        lengths = [len(p) for p in all_prompts]
        file_info = {"path": str(prompts_file), "prompt_column": prompt_column, "rows": len(all_prompts),
                     "chat_template": True, "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                                                              "mean": sum(lengths) / len(lengths),
                                                              "total": sum(lengths)}}
        eos = list(bm.tokenizer.eos_token_ids)
        context = _check_context(args, [max(lengths)], max_tokens)
    else:
        context = _check_context(args, [prompt_tokens], max_tokens)
        all_prompts = distinct_prompts(np.random.default_rng(seed), max(prompts, prompts_b1 or 0), prompt_tokens,
                                       args.vocab_size)
        eos = []
    prompts_b1 = prompts if prompts_b1 is None else prompts_b1
    if max(prompts, prompts_b1) > len(all_prompts):
        raise BenchError(f"{prompts_file} has {len(all_prompts)} rows; asked for {max(prompts, prompts_b1)}")
    warmup_tokens = min(max_tokens, WARMUP_TOKENS)

    def n_prompts(b: int) -> int:
        return prompts_b1 if b == 1 else prompts

    def params(n_new: int) -> Callable[[int], GenerateParams]:
        return lambda i: GenerateParams(max_tokens=n_new, temperature=temperature, top_p=top_p, ignore_eos=not real,
                                        seed=row_seed(seed, i, 0))

    sampler_text = None if temperature == 0 else f"make_sampler({temperature:g}, top_p={top_p:g})"
    ref, peer_info = load_peer(peer, bm.config, bm.weights, dtype, notes, "mlx_lm.generate.batch_generate",
                               dequantize=bm.dequantized, prefill_step_size=prefill_step_size,
                               prefill_batch_size="min(B, 8)", stop_tokens=eos, sampler=sampler_text)
    sampler = peer_sampler(temperature, top_p) if ref is not None else None
    peer_tok = PeerTokenizer(eos, bm.tokenizer.decode if real else None)
    if ref is not None and temperature > 0 and top_p < 1:
        notes.append("top_p: ours keeps the nucleus of the distribution at the temperature (vLLM's order); "
                     "mlx-lm's make_sampler cuts it from the temperature-1 distribution, then samples at the "
                     "temperature")

    engines: dict[tuple, Engine] = {}
    run_kinds = []
    for kind in kinds:
        for variant in variants:
            compile_setting = {"auto": "auto", "eager": False, "compiled": True}[variant]
            try:
                engines[kind["name"], variant] = Engine(
                    ours, eos_token_ids=eos, context_length=context, prefill_step_size=prefill_step_size,
                    compile=compile_setting, cache_spec=_cache_spec(kind), tokenizer=bm.tokenizer if real else None)
            except (ValueError, NotImplementedError, RowError) as e:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"], "reason": str(e)})
                continue
        if any(k[0] == kind["name"] for k in engines):
            run_kinds.append(kind)
        if ref is not None and kind["name"] != "full":
            notes.append(f"cache {kind['name']}: no mlx-lm row (batch_generate is run with full caches only)")

    rows: list[dict] = []

    def base(impl, variant, compile_setting, kind, b):
        ps = all_prompts[: n_prompts(b)]
        return {"mode": "batch", "impl": impl, "variant": variant, "compile": compile_setting, "cache": kind["name"],
                "max_kv_size": kind["max_kv_size"], "kv_bits": kind["kv_bits"],
                "prompt_tokens": None if real else prompt_tokens, "prompt_tokens_total": sum(len(p) for p in ps),
                "max_tokens": max_tokens, "batch_size": b, "prompts": len(ps), "temperature": temperature,
                "top_p": top_p, "ignore_eos": not real,
                "weights": ours_weights if impl == "pipeline" else peer_info["weights"]}

    def add(row, timed):
        row.update(timed)
        row["trace_count_after_warmup"] = row.pop("after_warmup")
        row["compiled"] = row["trials"][-1]["compiled"]
        for t in row["trials"]:  # random prompts ignore EOS: exactly max_tokens each; real ones at most
            lo, hi = t["min_tokens_per_prompt"], t["max_tokens_per_prompt"]
            if hi > max_tokens or (not real and lo != max_tokens):
                raise BenchFailed(f"{row['impl']} {row['variant']} B={row['batch_size']} generated "
                                 f"{lo}-{hi} tokens per prompt, not {'up to ' * real}{max_tokens}")
        rows.append(row)
        progress(_batch_row_line(row))

    max_len = max(len(p) for p in all_prompts)
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
                    be = BatchEngine(engine, b, max_len + max_tokens)
                    timed = _time_job(lambda p, n: _ours_batch(be, p, params(n)), ps, min(len(ps), b + 1),
                                      warmup_tokens, max_tokens, trials, probe=lambda: be.trace_count)
                except (ValueError, NotImplementedError, RowError) as e:
                    skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                else:
                    add(row, timed)
                    row["trace_count"] = be.trace_count
                    row["path"] = be.path  # the decode step: "cuda-batched" or "generic" (BatchEngine.path)
                    try:
                        row["kv_bytes"] = be.kv_bytes()
                    except Exception:  # noqa: BLE001 - informational only
                        row["kv_bytes"] = None
                del be
        if ref is not None and any(k["name"] == "full" for k in run_kinds):
            pbs = min(b, 8)
            row = base("mlx-lm", "batch_generate", None, parse_cache_kind("full"), b)
            row["prefill_batch_size"] = pbs
            timed = _time_job(lambda p, n: _peer_batch(ref, p, n, b, pbs, prefill_step_size, peer_tok, sampler), ps,
                              min(len(ps), b + 1), warmup_tokens, max_tokens, trials)
            add(row, timed)

    for row in rows:
        if row["impl"] != "pipeline":
            continue
        p = next((r for r in rows if r["impl"] == "mlx-lm" and r["cache"] == row["cache"]
                  and r["batch_size"] == row["batch_size"]), None)
        p = same_format_peer(row, p, notes, f"B={row['batch_size']}: ")
        row["ratio_vs_peer"] = row["median"]["job_tps"] / p["median"]["job_tps"] if p else None
        seq = next((r for r in rows if r["impl"] == "pipeline" and r["variant"] == "sequential"
                    and r["cache"] == row["cache"] and r["compile"] == row["compile"]), None)
        row["speedup_vs_sequential"] = row["median"]["job_tps"] / seq["median"]["job_tps"] if seq else None

    doc = result_document(bm, context=context, prompt_tokens=[] if real else [prompt_tokens], max_tokens=max_tokens,
                          trials=trials, kinds=kinds, variants=variants, prefill_step_size=prefill_step_size,
                          seed=seed, peer_info=peer_info, rows=rows, skipped=skipped, notes=notes,
                          temperature=temperature, top_p=top_p, ignore_eos=not real,
                          batch={"batch_sizes": batch_sizes, "prompts": prompts, "prompts_b1": prompts_b1,
                                 "warmup_tokens": warmup_tokens, "prompts_file": file_info})
    return emit(doc, echo, json_path)
