"""The batch-1 decode driver (``pipeline bench``): decode tok/s, prefill tok/s and TTFT per row.

Each row (implementation x variant x cache kind x prompt length) runs one warm-up generation (kernel
JIT, graph tracing, cache buffer allocation; timed and reported apart as ``warmup_s``), then ``trials``
timed generations of ``max_tokens`` new tokens, greedy, ``ignore_eos``, from the same random prompt;
the table shows the medians. The peer is mlx-lm's ``generate_step`` on the same weights, in the same
format (dense when ours were dequantized), in the same run.
The achieved read bandwidth is ``(weight bytes read per token + mean KV bytes read per decode step) x
median decode tok/s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..engine import Engine, GenerateParams
from ..errors import RowError
from ..engine.cuda import fused_blocker
from ..loader import compute_dtype
from .peer import _peer_generate, load_peer, peer_windows
from .settings import BenchError, _cache_spec, _check_context, check_json_path, parse_cache_kind
from .shapes import _kv_layout, _load_ours, kv_read_bytes, weight_format, weight_read_bytes
from .tables import _row_line, emit, result_document, same_format_peer
from .throughput import run_batch_bench
from .timing import _gen_record, _time_row


def run_bench(model: str | None = None, *, random: str | None = None, prompt_tokens=(64, 512, 2048),
              max_tokens: int = 256, trials: int = 3, caches=("full",), dequantize: bool | str = "auto",
              peer: bool = True, variants=("eager", "compiled"), json_path: str | Path | None = None,
              prefill_step_size: int = 512, seed: int = 0, echo: Callable[[str], None] = print,
              progress: Callable[[str], None] | None = None, batch_sizes=None, prompts: int | None = None,
              prompts_b1: int | None = None, temperature: float | None = None, top_p: float | None = None,
              prompts_file: str | Path | None = None, prompt_column: str = "prompt") -> dict:
    """Run the benchmark; prints the table with ``echo`` and returns (and with ``json_path`` writes) the
    result document (see ``docs/BENCHMARKS.md``).

    Models: any model spec (``load_model``'s rules: dtype "auto", the "auto" dequantize rule), or
    random weights of a named real shape (``RANDOM_SHAPES``). ``variants``: ``eager``, ``compiled``,
    ``fused`` (the fused CUDA step, built token by token; listed as skipped where it cannot run),
    ``fused-replay`` (the same step compiled once and replayed: ``Engine.compile_fused``, what a job runs),
    ``fused-layers`` (replayed, each layer one kernel: ``FusedDecoder.one_kernel_layers``; skipped with the reason
    where ``layer_blocker`` says it cannot run).

    The peer runs our weight format: dequantized to ``dtype`` when ours were (``load_peer``); a ratio
    between rows of different formats is never computed (``vs_peer`` None, with a note).

    With ``batch_sizes`` it measures job throughput instead (``run_batch_bench``; ``prompts``,
    ``prompts_b1``, ``temperature``, ``top_p``, ``prompts_file`` and ``prompt_column`` apply there only).

    Raises:
        BenchError: bad settings (also a batch-mode-only setting without ``batch_sizes``, no cache kind or
            variant, a ``json_path`` that cannot be written), before anything loads. Model-loading
            errors propagate as ``load_model``'s do.
    """
    check_json_path(json_path)  # before anything loads: the results are not lost at the end
    for option, values in (("--cache", caches), ("--variants", variants)):
        if not values:
            raise BenchError(f"{option}: name at least one")
    if batch_sizes:
        return run_batch_bench(model, random=random, batch_sizes=batch_sizes, prompts=prompts, prompts_b1=prompts_b1,
                               prompt_tokens=prompt_tokens[0], max_tokens=max_tokens, trials=trials, caches=caches,
                               dequantize=dequantize, peer=peer, variants=variants, json_path=json_path,
                               prefill_step_size=prefill_step_size, seed=seed, echo=echo, progress=progress,
                               temperature=0.0 if temperature is None else temperature,
                               top_p=1.0 if top_p is None else top_p, prompts_file=prompts_file,
                               prompt_column=prompt_column)
    given = [name for name, v in (("--temperature", temperature), ("--top-p", top_p), ("--prompts-file", prompts_file),
                                  ("--prompts", prompts), ("--prompts-b1", prompts_b1),
                                  ("--prompt-column", None if prompt_column == "prompt" else prompt_column))
             if v is not None]
    if given:
        raise BenchError(f"{', '.join(given)}: job throughput settings; add --batch-size")
    progress = progress or (lambda _s: None)
    if trials < 1 or max_tokens < 1 or not prompt_tokens or min(prompt_tokens) < 1:
        raise BenchError("trials, max_tokens and every prompt length must be >= 1")
    kinds = [parse_cache_kind(c) for c in caches]
    for v in variants:
        if v not in ("eager", "compiled", "fused", "fused-replay", "fused-layers"):
            raise BenchError(f"unknown variant {v!r} (eager, compiled, fused, fused-replay, fused-layers)")
    dtype = compute_dtype("auto")
    notes: list[str] = []

    bm = _load_ours(model, random, dtype, dequantize, seed)
    ours, args = bm.model, bm.model.args
    context = _check_context(args, prompt_tokens, max_tokens)
    progress(f"loaded {model or 'random ' + random} in {bm.load_s:.1f}s (dtype {dtype}, dequantized {bm.dequantized})")

    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, args.vocab_size, n).tolist() for n in prompt_tokens}
    params = GenerateParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    our_weight_bytes = weight_read_bytes(ours)
    our_weights = weight_format(ours)
    rows: list[dict] = []
    skipped: list[dict] = []

    def row_base(impl, variant, kind, n):
        return {"impl": impl, "variant": variant, "cache": kind["name"], "max_kv_size": kind["max_kv_size"],
                "kv_bits": kind["kv_bits"], "prompt_tokens": n, "max_tokens": max_tokens}

    ran_caches = set()
    for kind in kinds:
        for variant in variants:
            try:  # fused "auto": a fused row that cannot run is skipped below, not warned about
                engine = Engine(ours, eos_token_ids=[], context_length=context, prefill_step_size=prefill_step_size,
                                compile=variant == "compiled", fused="auto" if variant.startswith("fused") else False,
                                cache_spec=_cache_spec(kind))
                engine.compile_fused = variant in ("fused-replay", "fused-layers")
                if engine.fused is not None:
                    why = engine.fused.layer_blocker() if variant == "fused-layers" else None
                    if why:
                        skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"], "reason": why})
                        continue
                    engine.fused.one_kernel_layers = variant == "fused-layers"
            except (ValueError, NotImplementedError, RowError) as e:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"], "reason": str(e)})
                continue
            if variant.startswith("fused") and engine.fused is None:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"],
                                "reason": f"no fused step: {fused_blocker(ours, engine.cache)}"})
                continue
            windows = _kv_layout(args, kind["max_kv_size"])
            for n in prompt_tokens:
                row = row_base("pipeline", variant, kind, n)
                try:
                    row.update(_time_row(lambda: _gen_record(engine.generate(prompts[n], params)), trials,
                                         after_warmup=lambda: engine.trace_count))
                except (ValueError, NotImplementedError, RowError) as e:
                    skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                    continue
                row["compiled"] = row["trials"][-1]["compiled"]
                row["fused"] = row["trials"][-1]["fused"]
                if variant.startswith("fused") and not row["fused"]:
                    skipped.append({**row, "reason": "the fused step is not available for this model or machine"})
                    continue
                row["closure_count"] = engine.closure_count
                row["trace_count_after_warmup"] = row.pop("after_warmup")
                row["trace_count"] = engine.trace_count
                row["weight_read_bytes"] = our_weight_bytes
                row["weights"] = our_weights
                row["kv_read_bytes"] = kv_read_bytes(args, windows, n, max_tokens, dtype, kind["kv_bits"])
                rows.append(row)
                ran_caches.add(kind["name"])
                progress(_row_line(row))
            del engine

    ref, peer_info = load_peer(peer, bm.config, bm.weights, dtype, notes, "mlx_lm.generate.generate_step",
                               dequantize=bm.dequantized, prefill_step_size=prefill_step_size, quantized_kv_start=0)
    if ref is not None:
        for kind in kinds:
            if kind["name"] not in ran_caches:
                continue
            windows = peer_windows(ref, kind["max_kv_size"])
            same_layout = windows == _kv_layout(args, kind["max_kv_size"])
            if not same_layout:
                notes.append(f"cache {kind['name']}: mlx-lm's prompt cache for this model has another layout "
                             f"(per-layer windows {sorted(set(windows), key=str)}): its make_prompt_cache ignores "
                             f"max_kv_size for models with their own make_cache")
            for n in prompt_tokens:
                row = row_base("mlx-lm", "generate_step", kind, n)
                try:
                    row.update(_time_row(lambda: _peer_generate(ref, prompts[n], max_tokens, kind, prefill_step_size),
                                         trials))
                except (ValueError, NotImplementedError, RowError) as e:
                    skipped.append({**row, "reason": f"mlx-lm: {type(e).__name__}: {e}"})
                    continue
                del row["after_warmup"]
                row["cache_layout_matches_ours"] = same_layout
                row["compiled"] = False
                row["weight_read_bytes"] = peer_info["weight_read_bytes"]
                row["weights"] = peer_info["weights"]
                row["kv_read_bytes"] = kv_read_bytes(args, windows, n, max_tokens, dtype, kind["kv_bits"])
                rows.append(row)
                progress(_row_line(row))
        del ref

    for row in rows:
        m = row["median"]
        row["bandwidth_gbps"] = ((row["weight_read_bytes"] + row["kv_read_bytes"]) * m["decode_tps"] / 1e9
                                 if m["decode_tps"] else None)
    for row in rows:
        if row["impl"] != "pipeline":
            continue
        p = next((r for r in rows if r["impl"] == "mlx-lm" and r["cache"] == row["cache"]
                  and r["prompt_tokens"] == row["prompt_tokens"]), None)
        p = same_format_peer(row, p, notes)
        if p is None:
            row["vs_peer"] = None
            continue
        a, b = row["median"], p["median"]
        row["vs_peer"] = {
            "decode_tps": a["decode_tps"] / b["decode_tps"] if a["decode_tps"] and b["decode_tps"] else None,
            "prefill_tps": a["prefill_tps"] / b["prefill_tps"],
            "ttft_s": a["ttft_s"] / b["ttft_s"],
            "same_cache_layout": p["cache_layout_matches_ours"],
        }

    doc = result_document(bm, context=context, prompt_tokens=list(prompt_tokens), max_tokens=max_tokens,
                          trials=trials, kinds=kinds, variants=variants, prefill_step_size=prefill_step_size,
                          seed=seed, peer_info=peer_info, rows=rows, skipped=skipped, notes=notes)
    return emit(doc, echo, json_path)
