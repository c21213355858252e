"""``pipeline status OUT_DIR``: how far a job's output has come, read from its manifest and shards."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc

from .inputs import InputError, read_rows
from .jobspec import JobSpecError, job_from_dict
from .run.plan import plan_samples
from .shards import check_shards, diff_fields, key_column, read_committed, read_consistent, read_shard

_COLUMNS = ["id", "sample_index", "error", "completion_tokens", "total_s", "decode_tps"]


def job_status(out_dir: str | Path, *, verify: bool = False) -> dict:
    """Progress of the job whose output is ``out_dir``.

    Every committed shard is checked for presence and size first; ``verify`` checks its Parquet footer and
    its sha256 too (reading every byte), and adds ``verified``.

    Returns:
        A dict: ``rows_done`` (committed output rows), ``rows_failed`` (committed with ``error`` set),
        ``rows_pending`` (output rows of the job's input not yet committed; None with ``pending_error``
        when the input cannot be read), ``rows_not_in_input`` (committed rows the job no longer selects:
        rows removed from the input, or selected by an earlier ``input.limit``; None likewise), ``completion_tokens``, ``mean_decode_tps`` (mean of the rows'
        decode tok/s), ``generation_s`` (wall seconds the runs that recorded their end spent generating),
        ``throughput_tps`` (the completion tokens of those runs / generation_s), ``runs_unrecorded`` (runs
        that ended without recording it, e.g. killed: their rows are committed, their time is unknown,
        so neither counts in ``throughput_tps``; the last one while ``running``), ``running`` (the output
        dir's lock is held: a run is going on, ``pid N on HOST, since T``, else None), ``eta_s`` (pending rows x wall seconds per row of
        those runs; without any, the mean of the committed rows' ``total_s``), ``runs``, ``complete``
        (no row pending; None, unknown, when the manifest records no job or its input cannot be read: the
        manifest's own flag covers only the last run's ``--limit``), ``shards``,
        ``settings`` (the committed rows grouped by the settings that made them, ``settings_groups``),
        ``settings_mixed`` (more than one group, or rows whose settings were not recorded) and
        ``fingerprint`` (a short summary of the settings; with mixed settings the fields that differ
        read ``mixed``); generation outputs: ``prefix_hit_rate``, ``cached_prompt_tokens`` and
        ``hit_prompt_tokens`` (``prefix_hits``); with ``verify``, ``verified``: ``shards`` (checked), ``hashed`` (matched their
        sha256) and ``unhashed`` (files whose entry records no sha256, an older manifest's: only their size
        and footer were checked).

    Raises:
        OutputError: no manifest in ``out_dir``, or an unreadable one; committed shards that are missing or
            damaged (one line each, naming the shard and the way out).
    """
    out_dir = Path(out_dir)

    def snapshot(manifest: dict):
        check = check_shards(out_dir, manifest["shards"], footer=verify, digest=lambda _: verify)
        check.raise_bad()
        key = key_column(manifest.get("fingerprint"))
        scored = key == "choice_index"  # task: score: no generated tokens
        table = read_committed(out_dir, manifest, ["id", key, "error", "total_s"] if scored else _COLUMNS)
        return check, key, scored, table, None if scored else prefix_hits(out_dir, manifest)

    # one manifest's shards, though a run may commit (and --retry-failed delete rewritten shards) meanwhile
    manifest, (check, key, scored, table, hits) = read_consistent(out_dir, snapshot)
    runs = manifest.get("runs", [])
    timed = recorded_totals(runs)
    done = 0 if table is None else table.num_rows
    status = {
        "out_dir": str(out_dir),
        "rows_done": done,
        "rows_failed": 0 if table is None else table.num_rows - table.column("error").null_count,
        "completion_tokens": 0 if table is None or scored else int(pc.sum(table.column("completion_tokens")).as_py() or 0),
        "mean_decode_tps": None if table is None or scored else pc.mean(table.column("decode_tps")).as_py(),
        "generation_s": timed["seconds"],
        "runs": len(runs),
        "runs_unrecorded": len(runs) - timed["runs"],
        "running": _running(out_dir),
        "complete": None,  # known with the pending rows: the manifest's flag covers only a run's --limit
        "shards": len(manifest["shards"]),
        **_settings(manifest),
        "rows_pending": None,
        "rows_not_in_input": None,
        "pending_error": None,
        "eta_s": None,
    }
    if hits is not None:
        status.update(hits)
    if verify:
        status["verified"] = {"shards": len(manifest["shards"]), "hashed": check.hashed, "unhashed": check.unhashed}
    timed_rows = timed["rows"]
    status["throughput_tps"] = timed["tokens_per_s"]
    try:
        recorded = manifest["info"]["job"]
    except (KeyError, TypeError):
        status["pending_error"] = "the manifest records no job (info.job)"
        return status
    try:
        job = job_from_dict(recorded)
        rows, _ = read_rows(job.input)
    except (KeyError, JobSpecError, InputError) as e:
        status["pending_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return status

    committed = set() if table is None else set(zip(table["id"].to_pylist(), table[key].to_pylist()))
    planned = {(r.id, k) for r, k, _ in plan_samples(job, rows)}
    status["rows_pending"] = len(planned - committed)
    status["rows_not_in_input"] = len(committed - planned)
    status["complete"] = status["rows_pending"] == 0
    if status["rows_pending"] == 0:
        status["eta_s"] = 0.0
    elif timed_rows and status["generation_s"] > 0:  # wall time: rows overlap in batched mode and on Ray
        status["eta_s"] = status["rows_pending"] * status["generation_s"] / timed_rows
    elif done:
        per_row = (pc.sum(table.column("total_s")).as_py() or 0.0) / done
        status["eta_s"] = status["rows_pending"] * per_row
    return status


def prefix_hits(out_dir: Path, manifest: dict) -> dict:
    """The prefix cache's hit rate over the committed rows that record ``cached_prompt_tokens`` (shards
    written before the column existed are left out): ``cached_prompt_tokens`` and ``hit_prompt_tokens`` (the
    prompt tokens of those rows) as ints, ``prefix_hit_rate`` their ratio (None when no row records it)."""
    cached = total = 0
    for entry in manifest["shards"]:
        t = read_shard(out_dir, entry, ["prompt_tokens", "cached_prompt_tokens", "error"], present=True)
        if "cached_prompt_tokens" not in t.column_names:
            continue
        ok = t.filter(pc.is_null(t.column("error")))
        cached += int(pc.sum(ok.column("cached_prompt_tokens")).as_py() or 0)
        total += int(pc.sum(ok.column("prompt_tokens")).as_py() or 0)
    return {"cached_prompt_tokens": cached, "hit_prompt_tokens": total,
            "prefix_hit_rate": cached / total if total else None}


def format_hits(st: dict) -> str | None:
    """``prefix cache: 87.5% of prompt tokens reused (5600 of 6400)``, or None without the numbers."""
    if st.get("prefix_hit_rate") is None:
        return None
    return (f"prefix cache: {100 * st['prefix_hit_rate']:.1f}% of prompt tokens reused "
            f"({st['cached_prompt_tokens']} of {st['hit_prompt_tokens']})")


def _legacy_fingerprint(manifest: dict) -> dict | None:
    """The settings of shards written before shard entries named their run: the manifest's fingerprint
    when no ``--force`` changed it since, the fingerprint before the first change recorded with its run;
    None (unknown) when an older ``--force`` changed it without saying which shards came after."""
    forced = manifest.get("forced", [])
    if not forced:
        return manifest.get("fingerprint", {})
    return forced[0]["previous"] if "run" in forced[0] else None


def settings_groups(manifest: dict) -> list[dict]:
    """The committed rows grouped by the fingerprint that made them (each shard's ``run`` and that run
    record's ``fingerprint``), in order of first commit.

    Returns:
        One dict per group: ``rows``, ``runs`` (sorted run numbers, 1-based), ``forced`` (the group's
        first run had ``--force``), ``fingerprint`` (the full fingerprint; None when not recorded: shards
        of an older manifest whose fingerprint an older ``--force`` changed).
    """
    runs = manifest.get("runs", [])
    legacy = _legacy_fingerprint(manifest)
    legacy_runs = {i for i, r in enumerate(runs, 1) if "fingerprint" not in r and r.get("rows_written", 1)}
    groups: dict[str, dict] = {}
    for shard in manifest["shards"]:
        n = shard.get("run")
        record = runs[n - 1] if isinstance(n, int) and 1 <= n <= len(runs) else None
        fp = record["fingerprint"] if record is not None and "fingerprint" in record else legacy
        g = groups.setdefault(json.dumps(fp, sort_keys=True), {"rows": 0, "runs": set(), "fingerprint": fp})
        g["rows"] += shard["rows"]
        g["runs"] |= {n} if record is not None else legacy_runs
    out = []
    for g in groups.values():
        first = min(g["runs"], default=None)
        out.append({"rows": g["rows"], "runs": sorted(g["runs"]), "fingerprint": g["fingerprint"],
                    "forced": first is not None and bool(runs[first - 1].get("force"))})
    return out


def _settings(manifest: dict) -> dict:
    """``settings``, ``settings_mixed`` and ``fingerprint`` of ``job_status``."""
    groups = settings_groups(manifest)
    known = [g["fingerprint"] for g in groups if g["fingerprint"] is not None]
    differ = sorted({p for fp in known[1:] for p in diff_fields(known[0], fp)}
                    | {p for f in manifest.get("forced", []) if "run" not in f for p in f["changed"]})
    mixed = len(groups) > 1 or len(known) < len(groups)
    common = manifest.get("fingerprint", {})
    if mixed:
        common = json.loads(json.dumps(common))
        for path in differ:
            *parents, leaf = path.split(".")
            node = common
            for k in parents:
                node = node.setdefault(k, {})
            if isinstance(node, dict):
                node[leaf] = "mixed"
    shown = [{"rows": g["rows"], "runs": g["runs"], "forced": g["forced"],
              "settings": None if g["fingerprint"] is None else _values(g["fingerprint"], differ),
              "fingerprint": None if g["fingerprint"] is None else fingerprint_summary(g["fingerprint"])}
             for g in groups]
    return {"settings": shown, "settings_mixed": mixed, "fingerprint": fingerprint_summary(common)}


def _values(fp: dict, paths: list[str]) -> str:
    """``key=value`` for each dotted ``path`` of ``fp`` (generation keys by their own name), long values cut."""
    out = []
    for path in paths:
        v = fp
        for k in path.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        text = v if isinstance(v, str) else json.dumps(v)
        out.append(f"{path.removeprefix('generation.')}={text if len(text) <= 24 else text[:21] + '...'}")
    return ", ".join(out)


def _run_numbers(runs: list[int]) -> str:
    """``run 3`` or ``runs 1-2, 4``."""
    spans: list[list[int]] = []
    for n in runs:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"run{'s' * (len(runs) != 1)} {text}" if runs else "runs unknown"


def format_settings(st: dict) -> str | None:
    """The ``settings: mixed — ...`` line of a ``job_status`` with mixed settings, else None."""
    if not st["settings_mixed"]:
        return None
    parts = []
    for g in st["settings"]:
        where = _run_numbers(g["runs"]) + (", --force" if g["forced"] else "")
        what = ("settings not recorded (an older manifest; --force changed them)" if g["fingerprint"] is None
                else g["settings"] or "the same settings")
        parts.append(f"{g['rows']} row{'' if g['rows'] == 1 else 's'} {what} ({where})")
    return "settings: mixed — " + ", ".join(parts)


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


def _running(out_dir: Path) -> str | None:
    """``pid N on HOST, since T`` of the run holding ``out_dir``'s lock (``outdir.lock_held``), or None."""
    from . import outdir

    held, holder = outdir.lock_held(out_dir)
    return outdir.holder_text(holder) if held else None


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
    defaults = GenerationSpec().to_dict()
    changed = [f"{k}={v}" for k, v in gen.items() if k in defaults and defaults[k] != v]
    parts = [f"model {model.get('spec', '?')}" + (f" (sha256 {sha[:12]})" if sha else "")]
    parts.append("generation " + (", ".join(changed) if changed else "defaults"))
    cache = {k: v for k, v in fp.get("cache", {}).items() if v not in (None, 0, 64)}
    if cache.get("prefix_block_size") == 32:  # the default
        del cache["prefix_block_size"]
    if "prefix_block_size" in fp.get("cache", {}) and fp["cache"]["prefix_block_size"] is None:
        cache["prefix_cache"] = "off"
    if cache:
        parts.append("cache " + ", ".join(f"{k}={v}" for k, v in cache.items()))
    return "; ".join(parts)


def _duration(s: float | None) -> str:
    """``12m05s`` or ``1h02m05s`` (rounded; a positive time under half a second is ``0m01s``, not nothing left)."""
    if s is None:
        return "unknown"
    s = max(int(round(s)), 1 if s > 0 else 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def completeness(st: dict) -> str:
    """``complete``, ``incomplete`` or, when the pending rows are unknown, ``completeness unknown``."""
    return {True: "complete", False: "incomplete"}.get(st["complete"], "completeness unknown")


def format_status(st: dict) -> str:
    """``job_status`` as a few human-readable lines."""
    pending = st["rows_pending"] if st["rows_pending"] is not None else f"unknown ({st['pending_error']})"
    tput = f"{st['throughput_tps']:.1f} tok/s" if st["throughput_tps"] else "n/a"
    mean = f"{st['mean_decode_tps']:.1f} tok/s" if st["mean_decode_tps"] else "n/a"
    state = completeness(st)
    untimed = (st.get("runs_unrecorded") or 0) - bool(st.get("running"))  # the run going on has no end yet
    unrecorded = f" ({untimed} run(s) ended unrecorded, e.g. killed: not counted)" if untimed > 0 else ""
    settings = format_settings(st)
    verified = format_verified(st)
    gone = f"; {st['rows_not_in_input']} no longer in the job's selection of the input" \
        if st.get("rows_not_in_input") else ""
    return "\n".join([
        f"{st['out_dir']}: {state}, {st['shards']} shard(s), {st['runs']} run(s)"
        + (f"; a run is going on ({st['running']})" if st.get("running") else ""),
        f"rows: {st['rows_done']} done ({st['rows_failed']} failed{gone}), {pending} pending",
        (f"tokens: {st['completion_tokens']} generated; {tput} over {_duration(st['generation_s'])} of generation"
         f"{unrecorded}; mean per-row decode {mean}"),
        f"eta: {_duration(st['eta_s']) if st['eta_s'] is not None else ('0s' if st['rows_pending'] == 0 else 'unknown')}",
        *([hits] if (hits := format_hits(st)) else []),
        *([settings] if settings else []),
        f"fingerprint: {st['fingerprint']}",
        *([verified] if verified else []),
    ])


def format_verified(st: dict) -> str | None:
    """The ``verified: ...`` line of a ``job_status(verify=True)``, else None."""
    v = st.get("verified")
    if v is None:
        return None
    unhashed = v["unhashed"]
    parts = []
    if v["hashed"] or not unhashed:
        parts.append(f"{'all ' * (not unhashed)}{v['hashed']} committed shard(s) match their sha256")
    if unhashed:
        names = ", ".join(unhashed[:3]) + (f" and {len(unhashed) - 3} more" if len(unhashed) > 3 else "")
        parts.append(f"{len(unhashed)} ({names}) record no sha256 (an older manifest): only their size and "
                     "Parquet footer were checked")
    return "verified: " + "; ".join(parts)
