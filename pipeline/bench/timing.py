"""How a row is timed: one warm-up run kept apart, then the trials and their medians.

Shared by both drivers and by the peer's runs, so ours and mlx-lm are timed by the same code.
"""

from __future__ import annotations

import statistics
from typing import Callable

import mlx.core as mx

from ..engine import Generation


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _summary(trials: list[dict]) -> dict:
    return {k: _median([t[k] for t in trials]) for k in ("ttft_s", "prefill_tps", "decode_tps", "total_s")}


def _gen_record(gen: Generation) -> dict:
    """One ``Engine.generate`` run as a trial record (seconds, tokens/s, bytes)."""
    return {"ttft_s": gen.ttft_s, "prefill_tps": gen.prefill_tps, "decode_tps": gen.decode_tps,
            "total_s": gen.total_s, "generated_tokens": len(gen.token_ids),
            "peak_memory_bytes": gen.peak_memory_bytes, "compiled": gen.compiled, "fused": gen.fused}


def _time_row(run_once: Callable[[], dict], trials: int, after_warmup: Callable[[], object] = lambda: None) -> dict:
    """One warm-up run (its wall time is ``warmup_s``; not among the trials), then ``trials`` timed
    runs and their medians; ``after_warmup()`` is recorded between the two."""
    warmup = run_once()
    probe = after_warmup()
    timed = [run_once() for _ in range(trials)]
    return {"warmup_s": warmup["total_s"], "warmup": warmup, "after_warmup": probe, "trials": timed,
            "median": _summary(timed)}


# --- job throughput (batch mode) ------------------------------------------------------------------------


def _job_record(wall_s: float, counts: list[int], **extra) -> dict:
    """One job run as a trial record: ``counts`` generated tokens per prompt in ``wall_s`` seconds."""
    n = sum(counts)
    return {"wall_s": wall_s, "prompts": len(counts), "generated_tokens": n, "job_tps": n / wall_s,
            "min_tokens_per_prompt": min(counts), "max_tokens_per_prompt": max(counts),
            "peak_memory_bytes": int(mx.get_peak_memory()), **extra}


def _time_job(run_once: Callable[[list[list[int]], int], dict], prompts: list[list[int]], warmup_prompts: int,
              warmup_tokens: int, max_tokens: int, trials: int, probe: Callable[[], object] = lambda: None) -> dict:
    """One warm-up run (``warmup_prompts`` prompts of ``warmup_tokens`` new tokens; its wall time is
    ``warmup_s``), then ``trials`` timed runs of every prompt and their medians."""
    warmup = run_once(prompts[:warmup_prompts], warmup_tokens)
    after = probe()
    timed = [run_once(prompts, max_tokens) for _ in range(trials)]
    return {"warmup_s": warmup["wall_s"], "warmup": warmup, "trials": timed, "after_warmup": after,
            "median": {"job_tps": statistics.median(t["job_tps"] for t in timed),
                       "wall_s": statistics.median(t["wall_s"] for t in timed)}}
