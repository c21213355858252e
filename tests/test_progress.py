"""What ``pipeline run`` shows while it works, on a tiny random-weight model: the load and warm-up lines on
stderr, the engine's count of tokens generated so far (what the bar's tok/s reads, rows in flight included)
and the thread that redraws the bar, which stops when the run ends."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tqdm import tqdm

import pipeline  # noqa: F401  (OpenBLAS before tiny_model imports mlx.core, as in `pipeline run`)

# isort: split
from tiny_model import write_tiny_model

from pipeline.describe import describe_model
from pipeline.inputs import read_rows
from pipeline.jobspec import JobSpecError, job_from_dict
from pipeline.run import BarRefresher, generate_samples, load_job_model, plan_samples, run_job

MAX_TOKENS = [2, 12, 3, 9]  # per-row max_tokens column; ignore_eos makes them the exact lengths


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def job(tiny: Path, tmp: Path, **engine):
    data = tmp / "in.parquet"
    if not data.exists():
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(MAX_TOKENS))],
                                 "prompt": [f"Say {i} words." for i in range(len(MAX_TOKENS))],
                                 "max_tokens": MAX_TOKENS}), data)
    return job_from_dict({
        "model": str(tiny),
        "input": {"path": str(data), "id_column": "id", "prompt_column": "prompt"},
        "generation": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        "engine": engine,
        "output": {"dir": str(tmp / "out"), "shard_size": 2},
    })


def progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pipeline-progress"]


def test_run_prints_load_and_warmup_lines_on_stderr(tiny, tmp_path, capsys):
    echoed = []
    summary = run_job(job(tiny, tmp_path), progress=True, echo=echoed.append)
    assert summary.rows_written == len(MAX_TOKENS) and summary.completion_tokens == sum(MAX_TOKENS)
    captured = capsys.readouterr()
    lines = [ln.strip() for ln in re.split(r"[\r\n]", captured.err) if ln.strip()]
    n = describe_model(str(tiny))["parameters"]
    size = f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}K"
    loaded = [i for i, ln in enumerate(lines) if re.fullmatch(
        rf"loaded {re.escape(str(tiny))} \(llama, {re.escape(size)} parameters, (float32|\d-bit g\d+) weights\) in \d+\.\d s",
        ln)]
    warmed = [i for i, ln in enumerate(lines) if re.fullmatch(r"warmed up in \d+\.\d s", ln)]
    assert len(loaded) == 1 and len(warmed) == 1 and loaded[0] < warmed[0], captured.err
    assert any("generating" in ln and "tok/s" in ln for ln in lines[warmed[0]:]), captured.err  # the bar after them
    assert "loaded" not in captured.out and not any("loaded" in e or "warmed" in e for e in echoed)
    assert progress_threads() == []  # the refresher stopped with the run


def test_no_progress_prints_nothing_on_stderr(tiny, tmp_path, capsys):
    run_job(job(tiny, tmp_path), progress=False, echo=lambda _: None)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("batch_size", [1, 2])
def test_token_count_includes_rows_in_flight(tiny, tmp_path, batch_size):
    spec = job(tiny, tmp_path, batch_size=batch_size)
    lm = load_job_model(spec, tiny)
    rows, _ = read_rows(spec.input)
    planned = plan_samples(spec, rows)
    base = lm.engine.tokens_generated
    seen = []  # (tokens counted by the engine, tokens of the finished rows) at each finished row

    def record(res):
        finished = (seen[-1][1] if seen else 0) + res.completion_tokens
        seen.append((lm.engine.tokens_generated - base, finished))

    generate_samples(lm, spec, planned, record, planned=planned)
    assert len(seen) == len(MAX_TOKENS) and seen[-1] == (sum(MAX_TOKENS), sum(MAX_TOKENS))
    if batch_size == 1:
        assert all(counted == finished for counted, finished in seen)  # nothing in flight between rows
    else:
        # the first row to finish (max_tokens 2) left the other slot's tokens counted, that row still in flight
        assert seen[0][1] == 2 and seen[0][0] > seen[0][1]


def test_refresher_redraws_from_the_counter_and_stops(tmp_path):
    buf = io.StringIO()
    bar = tqdm(total=3, file=buf, desc="generating", unit="row")
    counter = {"tokens": 0}
    refresher = BarRefresher(bar, lambda: f"{counter['tokens']} tokens", interval=0.01)
    try:
        assert refresher.thread.is_alive() and refresher.thread.daemon
        counter["tokens"] = 17  # no bar.update: only the refresher can show it
        deadline = time.monotonic() + 30
        while "17 tokens" not in buf.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "17 tokens" in buf.getvalue() and bar.n == 0  # rows stay the rows finished
    finally:
        refresher.stop()
        bar.close()
    assert not refresher.thread.is_alive()


def test_refresher_stops_when_the_run_fails(tiny, tmp_path):
    spec = job(tiny, tmp_path, batch_size=4, max_kv_memory_gb=1e-6)  # refused after the bar started
    with pytest.raises(JobSpecError, match="max_kv_memory_gb"):
        run_job(spec, progress=True, echo=lambda _: None)
    assert progress_threads() == []
