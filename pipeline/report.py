"""``pipeline report OUT_DIR``: one HTML page with PNG charts of a job's committed rows (matplotlib, a
dependency): decode tok/s per row in commit order, TTFT vs prompt length, completion lengths,
finish reasons, failed rows, the job's fingerprint and summary numbers."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jinja2
import pyarrow as pa
import pyarrow.compute as pc

from .export import destination_error, file_in_the_way, read_committed, replace_beside
from .outdir import LOCK
from .status import completeness, format_settings, job_status, recorded_totals

# Chart files, written beside the HTML page: file name -> alt text.
CHARTS = {
    "decode_tps.png": "decode tokens/s of each row, in commit order",
    "ttft_vs_prompt.png": "time to first token vs prompt length",
    "completion_tokens.png": "histogram of completion lengths",
    "finish_reason.png": "rows per finish reason",
}
_FIG_INCHES, _DPI = (7.0, 3.2), 100
_MAX_FAILED_SHOWN = 1000  # failed rows listed in the table; the count covers them all


class ReportError(RuntimeError):
    """The report cannot be made: matplotlib missing (the CLI exits with ``exit_code`` 1), OUT_DIR holding
    ``task: score`` results or a destination that cannot be written (2: the command line; 1 when no space was
    left)."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def _column(table: pa.Table | None, name: str) -> list:
    return [] if table is None else table.column(name).to_pylist()


def summary_numbers(manifest: dict, table: pa.Table | None) -> dict:
    """The report's numbers, from the committed rows and the manifest.

    Returns:
        ``rows`` (committed output rows), ``failed`` (rows with ``error`` set), ``completion_tokens`` and
        ``prompt_tokens`` (sums), ``mean_decode_tps`` (mean of the rows' decode tok/s; None without a
        successful row), ``row_seconds`` (sum of the rows' ``total_s``), ``generation_seconds`` (wall
        seconds the runs that recorded their end spent generating, from the manifest),
        ``throughput_tps`` (those runs' completion tokens / generation_seconds; None when 0: a run killed
        without its record counts neither its tokens nor its time, as in ``pipeline status``) and ``runs``.
    """
    runs = manifest.get("runs", [])
    timed = recorded_totals(runs)
    gen_s = timed["seconds"]
    if table is None:
        return {"rows": 0, "failed": 0, "completion_tokens": 0, "prompt_tokens": 0, "mean_decode_tps": None,
                "row_seconds": 0.0, "generation_seconds": gen_s, "throughput_tps": None, "runs": len(runs)}
    tokens = int(pc.sum(table.column("completion_tokens")).as_py() or 0)
    return {
        "rows": table.num_rows,
        "failed": table.num_rows - table.column("error").null_count,
        "completion_tokens": tokens,
        "prompt_tokens": int(pc.sum(table.column("prompt_tokens")).as_py() or 0),
        "mean_decode_tps": pc.mean(table.column("decode_tps")).as_py(),
        "row_seconds": float(pc.sum(table.column("total_s")).as_py() or 0.0),
        "generation_seconds": gen_s,
        "throughput_tps": timed["tokens_per_s"],
        "runs": len(runs),
    }


def finish_counts(table: pa.Table | None) -> dict[str, int]:
    """Rows per ``finish_reason``, failed rows (``error`` set) counted as "failed"; most frequent first."""
    counts: dict[str, int] = {}
    for reason, error in zip(_column(table, "finish_reason"), _column(table, "error")):
        key = "failed" if error is not None else (reason or "none")
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=_FIG_INCHES, dpi=_DPI, layout="constrained")
    return fig, fig.add_subplot()


def _no_data(ax, text: str = "no successful rows") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _rolling_median(values: list[float], window: int) -> list[float]:
    import numpy as np

    a = np.asarray(values, dtype=float)
    half = window // 2
    return [float(np.median(a[max(0, i - half): i + half + 1])) for i in range(len(a))]


def write_charts(table: pa.Table | None, out_dir: Path) -> list[str]:
    """Write the ``CHARTS`` PNGs into ``out_dir``; returns their file names.

    Rows that failed have no timing and are left out of the first three charts.
    """
    order = list(range(len(_column(table, "id"))))
    tps = _column(table, "decode_tps")
    written = []

    fig, ax = _figure()
    pts = [(i, v) for i, v in zip(order, tps) if v is not None]
    if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, ".", ms=6 if len(ys) < 200 else 2, alpha=0.6, label="row")
        window = max(1, len(ys) // 25)
        if window > 1:
            ax.plot(xs, _rolling_median(list(ys), window), "-", lw=1.5, label=f"median of {window} rows")
        ax.legend(loc="lower right", fontsize="small")
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax)
    ax.set(title="Decode speed per row over the run", xlabel="row (commit order)", ylabel="decode tokens/s")
    written.append(_save(fig, out_dir, "decode_tps.png"))

    fig, ax = _figure()
    pts = [(p, t * 1000) for p, t in zip(_column(table, "prompt_tokens"), _column(table, "ttft_s"))
           if p is not None and t is not None]
    if pts:
        ax.plot(*zip(*pts), ".", ms=4, alpha=0.6)
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax)
    ax.set(title="Time to first token vs prompt length", xlabel="prompt tokens", ylabel="TTFT (ms)")
    written.append(_save(fig, out_dir, "ttft_vs_prompt.png"))

    fig, ax = _figure()
    lengths = [n for n, e in zip(_column(table, "completion_tokens"), _column(table, "error"))
               if e is None and n is not None]
    if lengths:
        lo, hi = min(lengths), max(lengths)
        # one bar per length when the range is small; 50 bins otherwise
        bins = [x - 0.5 for x in range(lo, hi + 2)] if hi - lo < 50 else 50
        ax.hist(lengths, bins=bins, color="tab:green", edgecolor="white")
    else:
        _no_data(ax)
    ax.set(title="Completion lengths", xlabel="completion tokens", ylabel="rows")
    written.append(_save(fig, out_dir, "completion_tokens.png", counts=True))

    fig, ax = _figure()
    counts = finish_counts(table)
    if counts:
        colors = ["tab:red" if k == "failed" else "tab:blue" for k in counts]
        bars = ax.bar(list(counts), list(counts.values()), color=colors)
        ax.bar_label(bars)
        ax.margins(y=0.15)  # room for the labels above the bars
    else:
        _no_data(ax, "no rows")
    ax.set(title="Finish reasons", xlabel="finish_reason", ylabel="rows")
    written.append(_save(fig, out_dir, "finish_reason.png", counts=True))
    return written


def _save(fig, out_dir: Path, name: str, counts: bool = False) -> str:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # rows, tokens and counts are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if counts:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    replace_beside(out_dir / name, lambda tmp: fig.savefig(tmp, format="png"))
    return name


def _shown(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


_PAGE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pipeline report: {{ out_dir }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
pre { background: #f5f5f5; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.muted { color: #666; }
</style>
</head>
<body>
<h1>pipeline report</h1>
<p><code>{{ out_dir }}</code>: {{ state }}; {{ shards }} shard(s), {{ summary.runs }} run(s).</p>

<h2>Summary</h2>
<table id="summary">
{% for key, label, value in numbers %}<tr data-key="{{ key }}"><th>{{ label }}</th>
  <td class="num" data-value="{{ value if value is not none else '' }}">{{ shown(value) }}</td></tr>
{% endfor %}</table>

<h2>Finish reasons</h2>
<table id="finish-reasons">
<tr><th>finish_reason</th><th>rows</th></tr>
{% for reason, count in finish.items() %}<tr data-key="{{ reason }}"><td>{{ reason }}</td>
  <td class="num" data-value="{{ count }}">{{ count }}</td></tr>
{% endfor %}</table>

<h2>Charts</h2>
{% for name, alt in charts %}<img src="{{ name }}" alt="{{ alt }}" width="700" height="320">
{% endfor %}
<h2>Failed rows ({{ failed_rows | length }}
{%- if failed_total > failed_rows | length %} of {{ failed_total }} shown{% endif %})</h2>
{% if failed_rows %}<table id="failed">
<tr><th>id</th><th>sample_index</th><th>error</th></tr>
{% for r in failed_rows %}<tr><td>{{ r.id }}</td><td class="num">{{ r.sample_index }}</td>
  <td>{{ r.error }}</td></tr>
{% endfor %}</table>
{% else %}<p class="muted">none</p>
{% endif %}
<h2>Job fingerprint</h2>
{% if settings_line %}<p id="settings">{{ settings_line }}</p>
{% endif %}<p>{{ fingerprint_line }}</p>
<details><summary>full fingerprint</summary><pre id="fingerprint">{{ fingerprint }}</pre></details>

<h2>Runs</h2>
<table id="runs">
<tr><th>started</th><th>finished</th><th>rows written</th><th>failed</th><th>tokens</th><th>seconds</th>
  <th>stopped by</th></tr>
{% for r in runs %}<tr><td>{{ r.get("started", "") }}</td><td>{{ r.get("finished", "") }}</td>
  {% for k in ("rows_written", "rows_failed", "completion_tokens", "elapsed_s") -%}
  <td class="num">{{ r.get(k, "") }}</td>
  {% endfor %}<td>{{ r.get("interrupted") or "" }}</td></tr>
{% endfor %}</table>
</body>
</html>
""")


def write_report(out_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML report of ``out_dir`` and its PNG charts (``CHARTS``, in the page's directory).

    Args:
        out_dir: a pipeline output directory.
        out: the HTML file to write; default ``OUT_DIR/report/report.html``.

    Returns:
        The HTML file's path.

    Raises:
        ReportError: matplotlib is not installed; ``out_dir`` holds ``task: score`` results; the page's
            directory is ``out_dir`` itself, or the page or a chart would replace ``manifest.json``, the lock
            file or a committed shard (exit 2, nothing written); the page's directory cannot be made or written
            (a parent that is a file, a read-only or special file system, no space left: one line naming
            ``--out`` and the OS's reason; each file is written under a temporary name and renamed, so none is
            left half written, and the directories made for the page are removed again).
        OutputError: ``out_dir`` has no manifest, or a committed shard is missing or damaged (as in
            ``pipeline export``).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError('pipeline report needs matplotlib, a dependency of pipeline that is missing here: '
                          'pip install "matplotlib>=3.7"') from None
    out_dir = Path(out_dir)
    manifest, table = read_committed(out_dir)
    if table is not None and "choice_index" in table.column_names:
        raise ReportError(f"pipeline report: {out_dir} holds task: score results, which the report does not chart; "
                          f"pipeline status {out_dir} summarizes them, pipeline export {out_dir} --to F --pivot "
                          "gives each row's pred", exit_code=2)
    page = Path(out) if out is not None else out_dir / "report" / "report.html"
    option = "--out" if out is not None else "the default --out"
    try:
        _check_page(out_dir, manifest, page, option)
        blocker = file_in_the_way(page)
        if blocker is not None:
            raise ReportError(f"{option} {page}: cannot write it: {blocker} is a file, not a directory", exit_code=2)
        if page.is_dir():
            raise ReportError(f"{option} {page}: a directory; name the HTML file to write", exit_code=2)
        made = next((d for d in reversed([page.parent, *page.parent.parents]) if not d.exists()), None)
        page.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise destination_error(option, page, e, ReportError) from None
    try:
        return _write_page(out_dir, manifest, table, page, option)
    except BaseException:
        if made is not None:  # the directories made for the page hold only what this call wrote
            shutil.rmtree(made, ignore_errors=True)
        raise


def _write_page(out_dir: Path, manifest: dict, table, page: Path, option: str) -> Path:
    """``write_report``'s charts and page into ``page.parent``, which exists."""
    summary = summary_numbers(manifest, table)
    status = job_status(out_dir)
    pending = status["rows_pending"]
    numbers = [
        ("rows", "rows committed", summary["rows"]),
        ("failed", "rows failed", summary["failed"]),
        ("pending", "rows pending" + (f" (unknown: {status['pending_error']})" if pending is None else ""), pending),
        ("completion_tokens", "completion tokens", summary["completion_tokens"]),
        ("prompt_tokens", "prompt tokens", summary["prompt_tokens"]),
        ("prefix_hit_rate", "prefix cache hit rate (cached / all prompt tokens of the rows recording it)",
         None if status.get("prefix_hit_rate") is None else f"{100 * status['prefix_hit_rate']:.1f}%"),
        ("mean_decode_tps", "mean decode tok/s per row", summary["mean_decode_tps"]),
        ("throughput_tps", "completion tok/s over generation time", summary["throughput_tps"]),
        ("generation_seconds", "generation time, all runs (s)", summary["generation_seconds"]),
        ("row_seconds", "sum of row times (s)", summary["row_seconds"]),
    ]
    failed = [] if table is None else table.select(["id", "sample_index", "error"]).filter(
        pc.invert(pc.is_null(table.column("error")))).to_pylist()
    try:
        charts = write_charts(table, page.parent)
    except OSError as e:
        raise destination_error(option, page, e, ReportError) from None
    html = _PAGE.render(
        out_dir=str(out_dir), state=completeness(status), shards=status["shards"],
        summary=summary, numbers=[(k, label, _finite(v)) for k, label, v in numbers], shown=_shown,
        finish=finish_counts(table), charts=[(c, CHARTS[c]) for c in charts],
        failed_rows=failed[:_MAX_FAILED_SHOWN], failed_total=len(failed),
        fingerprint_line=status["fingerprint"], settings_line=format_settings(status),
        fingerprint=json.dumps(manifest.get("fingerprint", {}), indent=1, sort_keys=True, ensure_ascii=False),
        runs=manifest.get("runs", []),
    )
    try:
        replace_beside(page, lambda tmp: tmp.write_text(html, encoding="utf-8"))
    except OSError as e:
        raise destination_error(option, page, e, ReportError) from None
    return page


def _check_page(out_dir: Path, manifest: dict, page: Path, option: str) -> None:
    """Refuse a page that would replace ``out_dir``'s own files: one whose directory is ``out_dir`` (its charts
    would land beside the shards), or whose path or a chart's is ``manifest.json``, the lock file or a
    committed shard (symlinks resolved).

    Raises:
        ReportError: exit 2, one line naming ``option``.
    """
    root = out_dir.resolve()
    if page.parent.resolve() == root:
        default = out_dir / "report" / "report.html"
        raise ReportError(f"{option} {page}: in the output dir {out_dir} itself, beside its shards and "
                          f"manifest.json; write it elsewhere, or in a subdirectory (the default is {default})",
                          exit_code=2)
    own = {root / "manifest.json", root / LOCK, *(root / s["file"] for s in manifest["shards"])}
    for path in (page, *(page.parent / name for name in CHARTS)):
        if path.resolve() in own:
            raise ReportError(f"{option} {page}: would replace {path}, a file of the output dir {out_dir}; write "
                              "the report elsewhere", exit_code=2)


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v
