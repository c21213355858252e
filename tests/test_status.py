"""``pipeline status`` (``pipeline.status.job_status``) after a run that ended without recording its end (killed
with SIGKILL): its rows count as done, but neither its rows nor its tokens enter the tok/s and the ETA, which
come from the runs that recorded both their tokens and their time."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline  # noqa: F401  (OpenBLAS before tiny_model imports mlx.core, as in `pipeline run`)

# isort: split
from tiny_model import write_tiny_model

from pipeline.jobspec import job_from_dict
from pipeline.run import run_job
from pipeline.status import format_settings, format_status, job_status

ROWS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def job(tiny: Path, tmp: Path):
    data = tmp / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(ROWS)], "prompt": [f"Say {i} words." for i in range(ROWS)]}),
                   data)
    return job_from_dict({
        "model": str(tiny),
        "input": {"path": str(data), "id_column": "id", "prompt_column": "prompt"},
        "generation": {"max_tokens": 8, "temperature": 0.7, "seed": 3},
        "output": {"dir": str(tmp / "out"), "shard_size": 2},
    })


def test_a_killed_run_does_not_count_in_the_rate(tiny, tmp_path):
    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    assert run_job(spec, limit=2, progress=False, echo=lambda _: None).rows_written == 2
    assert run_job(spec, limit=4, progress=False, echo=lambda _: None).rows_written == 2
    manifest = json.loads((out / "manifest.json").read_text())
    first, second = manifest["runs"]
    # The second run as a SIGKILL leaves it: its rows committed, its record holding only its start.
    manifest["runs"][1] = {k: second[k] for k in ("started", "rows_pending", "retry_failed", "force", "executor")}
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))

    st = job_status(out)
    assert (st["rows_done"], st["rows_pending"], st["runs"], st["runs_unrecorded"]) == (4, 2, 2, 1)
    assert st["completion_tokens"] == first["completion_tokens"] + second["completion_tokens"]
    assert st["generation_s"] == pytest.approx(first["elapsed_s"])
    assert st["throughput_tps"] == pytest.approx(first["completion_tokens"] / first["elapsed_s"])
    assert st["eta_s"] == pytest.approx(2 * first["elapsed_s"] / first["rows_written"])
    assert "(1 run(s) ended unrecorded, e.g. killed: not counted)" in format_status(st)


def test_without_a_recorded_run_the_eta_comes_from_the_rows(tiny, tmp_path):
    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=3, progress=False, echo=lambda _: None)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["runs"] = [{k: manifest["runs"][0][k] for k in ("started", "rows_pending")}]
    (out / "manifest.json").write_text(json.dumps(manifest))
    total_s = sum(pq.read_table(out / s["file"], columns=["total_s"]).column(0).to_pylist()[i]
                  for s in manifest["shards"] for i in range(s["rows"]))

    st = job_status(out)
    assert (st["rows_done"], st["rows_pending"], st["runs_unrecorded"]) == (3, 3, 1)
    assert st["generation_s"] == 0 and st["throughput_tps"] is None
    assert st["eta_s"] == pytest.approx(3 * total_s / 3)
    assert "n/a over 0m00s of generation (1 run(s) ended unrecorded" in format_status(st)


def legacy(out: Path, forced_without_run: bool = False) -> dict:
    """Make ``out``'s manifest look as written before run records held their fingerprint and shard entries
    their run (and, with ``forced_without_run``, before a ``forced`` entry named the run that forced)."""
    manifest = json.loads((out / "manifest.json").read_text())
    for s in manifest["shards"]:
        s.pop("run")
    for r in manifest["runs"]:
        r.pop("fingerprint")
    if forced_without_run:
        for f in manifest["forced"]:
            f.pop("run")
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_an_old_manifest_without_per_run_settings_reads_and_resumes(tiny, tmp_path):
    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=2, progress=False, echo=lambda _: None)
    run_job(spec, limit=4, progress=False, echo=lambda _: None)
    legacy(out)
    st = job_status(out)
    assert st["settings_mixed"] is False and "settings:" not in format_status(st)
    assert [(g["rows"], g["runs"]) for g in st["settings"]] == [(4, [1, 2])]
    assert st["fingerprint"].endswith("; generation max_tokens=8, seed=3, temperature=0.7")

    # --force with other settings on the old manifest: the old rows keep the settings they were made with
    changed = job_from_dict({**spec.to_dict(), "generation": {**spec.to_dict()["generation"], "max_tokens": 3}})
    run_job(changed, force=True, progress=False, echo=lambda _: None)
    st = job_status(out)
    assert [(g["rows"], g["runs"], g["forced"], g["settings"]) for g in st["settings"]] == [
        (4, [1, 2], False, "max_tokens=8"), (2, [3], True, "max_tokens=3")]
    assert "settings: mixed — 4 rows max_tokens=8 (runs 1-2), 2 rows max_tokens=3 (run 3, --force)" in \
        format_status(st)


def test_rows_an_old_force_mixed_are_reported_as_unrecorded(tiny, tmp_path):
    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=2, progress=False, echo=lambda _: None)
    changed = job_from_dict({**spec.to_dict(), "generation": {**spec.to_dict()["generation"], "max_tokens": 3}})
    run_job(changed, limit=4, force=True, progress=False, echo=lambda _: None)
    legacy(out, forced_without_run=True)
    st = job_status(out)
    assert st["settings_mixed"] is True and st["rows_done"] == 4 and "max_tokens=mixed" in st["fingerprint"]
    assert format_settings(st) == ("settings: mixed — 4 rows settings not recorded (an older manifest; --force "
                                   "changed them) (runs 1-2)")
    run_job(changed, progress=False, echo=lambda _: None)  # resumes with the latest settings, as before
    assert format_settings(job_status(out)) == (
        "settings: mixed — 4 rows settings not recorded (an older manifest; --force changed them) (runs 1-2), "
        "2 rows max_tokens=3 (run 3)")


def test_a_manifest_without_its_job_says_the_pending_rows_are_unknown(tiny, tmp_path):
    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=2, progress=False, echo=lambda _: None)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["info"]["job"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    st = job_status(out)
    assert st["rows_done"] == 2 and st["rows_pending"] is None and st["eta_s"] is None
    assert st["pending_error"] == "the manifest records no job (info.job)"
    assert "unknown (the manifest records no job (info.job))" in format_status(st)


def test_completeness_is_unknown_when_the_input_cannot_be_read(tiny, tmp_path):
    """A --limit run leaves the manifest's own flag set ('complete' for that run's rows); with the input gone,
    status (text and JSON) and the report say completeness is unknown, not complete."""
    from pipeline.report import write_report

    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=2, progress=False, echo=lambda _: None)
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
    assert job_status(out)["complete"] is False  # 4 rows pending
    (tmp_path / "in.parquet").rename(tmp_path / "moved.parquet")
    st = job_status(out)
    assert st["complete"] is None and st["rows_pending"] is None and st["pending_error"]
    assert json.loads(json.dumps(st))["complete"] is None
    assert format_status(st).splitlines()[0] == f"{out}: completeness unknown, 1 shard(s), 1 run(s)"
    page = write_report(out).read_text()
    assert f"<code>{out}</code>: completeness unknown;" in page and "complete;" not in page


def test_a_short_eta_with_rows_pending_is_not_shown_as_nothing_left():
    """An ETA under half a second rounded to 0m00s, read as 'done' while rows were pending."""
    from pipeline.status import _duration

    assert (_duration(0.2), _duration(0.0), _duration(65.4), _duration(3700.0), _duration(None)) == (
        "0m01s", "0m00s", "1m05s", "1h01m40s", "unknown")


def test_a_run_whose_model_did_not_load_is_recorded_as_such(tiny, tmp_path):
    """kv_group_size 32 does not divide the tiny model's head_dim of 16: the load fails (an error of the job for
    this model); its run record ends with why, so status does not call it killed."""
    from pipeline.engine.cache import CacheConfigError

    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=2, progress=False, echo=lambda _: None)
    bad = job_from_dict({**spec.to_dict(), "cache": {"kv_bits": 8, "kv_group_size": 32}})
    with pytest.raises(CacheConfigError):
        run_job(bad, force=True, progress=False, echo=lambda _: None)
    last = json.loads((out / "manifest.json").read_text())["runs"][-1]
    assert last["stopped"].startswith("the model did not load: ") and last["rows_written"] == 0
    st = job_status(out)
    assert (st["runs"], st["runs_unrecorded"]) == (2, 0) and "unrecorded" not in format_status(st)


def test_a_run_going_on_is_said_so_not_counted_as_killed(tiny, tmp_path):
    """While a run holds the output dir's lock its record has only its start: status says a run is going on
    (naming it) and does not call that run ended unrecorded; once the lock is free the same record is one."""
    from pipeline import outdir

    spec = job(tiny, tmp_path)
    out = tmp_path / "out"
    run_job(spec, limit=2, progress=False, echo=lambda _: None)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["runs"].append({"started": "2026-12-07T00:00:00Z", "rows_pending": 4})  # a run that has just begun
    (out / "manifest.json").write_text(json.dumps(manifest))
    with outdir.RunLock(out) as lock:
        st = job_status(out)
        assert st["running"] == f"pid {lock.holder['pid']} on {lock.holder['host']}, since {lock.holder['started']}"
        text = format_status(st)
        assert f"; a run is going on ({st['running']})" in text.splitlines()[0] and "unrecorded" not in text
    st = job_status(out)
    assert st["running"] is None and "(1 run(s) ended unrecorded, e.g. killed: not counted)" in format_status(st)
