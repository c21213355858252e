"""``pipeline status OUT_DIR``: how far a job's output has come, read from its manifest and shards."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc

from .inputs import InputError, read_rows
from .jobspec import JobSpecError, job_from_dict
from .shards import OutputError, read_committed, read_manifest

_COLUMNS = ["id", "sample_index", "error", "completion_tokens", "total_s", "decode_tps"]


def job_status(out_dir: str | Path) -> dict:
    """Progress of the job whose output is ``out_dir``.

    Returns:
        A dict: ``rows_done`` (committed output rows), ``rows_failed`` (committed with ``error`` set),
        ``rows_pending`` (output rows of the job's input not yet committed; None with ``pending_error``
        when the input cannot be read), ``completion_tokens``, ``mean_decode_tps`` (mean of the rows'
        decode tok/s), ``generation_s`` (wall seconds the runs that recorded their end spent generating),
        ``throughput_tps`` (the completion tokens of those runs / generation_s), ``runs_unrecorded`` (runs
        that ended without recording it, e.g. killed: their rows are committed, their time is unknown,
        so neither counts in ``throughput_tps``), ``eta_s`` (pending rows x wall seconds per row of
        those runs; without any, the mean of the committed rows' ``total_s``), ``runs``, ``complete``
        (no row pending; the last run's own flag when the input cannot be read), ``shards`` and
        ``fingerprint`` (a short summary).

    Raises:
        OutputError: no manifest in ``out_dir``, or an unreadable one.
    """
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise OutputError(f"{out_dir}: no manifest.json (not a pipeline output directory, or nothing committed yet)")
    table = read_committed(out_dir, manifest, _COLUMNS)
    runs = manifest.get("runs", [])
    timed = recorded_totals(runs)
    done = 0 if table is None else table.num_rows
    status = {
        "out_dir": str(out_dir),
        "rows_done": done,
        "rows_failed": 0 if table is None else table.num_rows - table.column("error").null_count,
        "completion_tokens": 0 if table is None else int(pc.sum(table.column("completion_tokens")).as_py() or 0),
        "mean_decode_tps": None if table is None else pc.mean(table.column("decode_tps")).as_py(),
        "generation_s": timed["seconds"],
        "runs": len(runs),
        "runs_unrecorded": len(runs) - timed["runs"],
        "complete": bool(manifest.get("complete")),
        "shards": len(manifest["shards"]),
        "fingerprint": fingerprint_summary(manifest.get("fingerprint", {})),
        "rows_pending": None,
        "pending_error": None,
        "eta_s": None,
    }
    timed_rows = timed["rows"]
    status["throughput_tps"] = timed["tokens_per_s"]
    try:
        job = job_from_dict(manifest["info"]["job"])
        rows, _ = read_rows(job.input)
    except (KeyError, JobSpecError, InputError) as e:
        status["pending_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return status
    from .runner import plan_samples

    committed = set() if table is None else set(zip(table["id"].to_pylist(), table["sample_index"].to_pylist()))
    status["rows_pending"] = sum((r.id, k) not in committed for r, k, _ in plan_samples(job, rows))
    status["complete"] = status["rows_pending"] == 0  # the manifest's flag covers only a run's --limit
    if status["rows_pending"] == 0:
        status["eta_s"] = 0.0
    elif timed_rows and status["generation_s"] > 0:  # wall time: rows overlap in batched mode and on Ray
        status["eta_s"] = status["rows_pending"] * status["generation_s"] / timed_rows
    elif done:
        per_row = (pc.sum(table.column("total_s")).as_py() or 0.0) / done
        status["eta_s"] = status["rows_pending"] * per_row
    return status


def recorded_totals(runs: list[dict]) -> dict:
    """Totals of the runs whose record has its end (``run_recorded``): ``runs`` (how many), ``seconds``
    (wall seconds generating), ``rows`` (rows written), ``tokens`` (completion tokens) and ``tokens_per_s``
    (tokens / seconds; None when no time was recorded). A run killed without its record counts neither
    its tokens nor its time."""
    timed = [r for r in runs if run_recorded(r)]
    seconds = float(sum(r["elapsed_s"] for r in timed))
    tokens = sum(r["completion_tokens"] for r in timed)
    return {"runs": len(timed), "seconds": seconds, "rows": sum(r["rows_written"] for r in timed), "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else None}


def run_recorded(run: dict) -> bool:
    """Whether a run record has the end of its run: generation seconds, rows and tokens (a run killed
    with SIGKILL, or still going, has only its start)."""
    return "finished" in run and all(isinstance(run.get(k), (int, float)) for k in
                                     ("elapsed_s", "rows_written", "completion_tokens"))


def fingerprint_summary(fp: dict) -> str:
    """One line: model, its hash prefix, and the generation settings that differ from the defaults."""
    from .jobspec import GenerationSpec

    model = fp.get("model", {})
    sha = model.get("sha256") or ""
    gen = fp.get("generation", {})
    defaults = GenerationSpec().__dict__
    changed = [f"{k}={v}" for k, v in gen.items() if k in defaults and defaults[k] != v]
    parts = [f"model {model.get('spec', '?')}" + (f" (sha256 {sha[:12]})" if sha else "")]
    parts.append("generation " + (", ".join(changed) if changed else "defaults"))
    cache = {k: v for k, v in fp.get("cache", {}).items() if v not in (None, 0, 64)}
    if cache:
        parts.append("cache " + ", ".join(f"{k}={v}" for k, v in cache.items()))
    return "; ".join(parts)


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_status(st: dict) -> str:
    """``job_status`` as a few human-readable lines."""
    pending = st["rows_pending"] if st["rows_pending"] is not None else f"unknown ({st['pending_error']})"
    tput = f"{st['throughput_tps']:.1f} tok/s" if st["throughput_tps"] else "n/a"
    mean = f"{st['mean_decode_tps']:.1f} tok/s" if st["mean_decode_tps"] else "n/a"
    state = "complete" if st["complete"] else "incomplete"
    untimed = st.get("runs_unrecorded") or 0
    unrecorded = f" ({untimed} run(s) ended unrecorded, e.g. killed: not counted)" if untimed else ""
    return "\n".join([
        f"{st['out_dir']}: {state}, {st['shards']} shard(s), {st['runs']} run(s)",
        f"rows: {st['rows_done']} done ({st['rows_failed']} failed), {pending} pending",
        (f"tokens: {st['completion_tokens']} generated; {tput} over {_duration(st['generation_s'])} of generation"
         f"{unrecorded}; mean per-row decode {mean}"),
        f"eta: {_duration(st['eta_s']) if st['eta_s'] is not None else ('0s' if st['rows_pending'] == 0 else 'unknown')}",
        f"fingerprint: {st['fingerprint']}",
    ])
