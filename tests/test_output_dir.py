"""The output dir as a place to write, through the real CLI on a tiny random-weight model: one run at a time
(a second `pipeline run` on a dir in use is refused, touching nothing, while status, export and report
still read it; a lock left by a killed run is taken over; the Ray driver holds it too), a full disk (a
real 1 MiB tmpfs filled up: exit 1, the summary line, the run record finished, committed shards intact,
and a resume after freeing space completes every row once), a read-only output dir (a real read-only
mount: `run` and `validate` refuse it before the model loads; a remount between commits is one error), and
an output dir removed mid-run (one error line, exit 1, and the rerun starts over)."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from tiny_model import without_machine_warnings, wait_until, write_prompts

from pipeline import outdir
from pipeline.shards import DiskFullError, OutputError, OutputWriteError, ShardStore

ROWS = 24
HOST = socket.gethostname()
COMPARED = ["id", "sample_index", "prompt", "completion", "finish_reason", "completion_tokens", "seed", "error"]


pytestmark = pytest.mark.usefixtures("tiny_home")  # the tiny model and a temporary $PIPELINE_HOME (conftest)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet", 60)


def write_job(path: Path, model: Path, prompts: Path, out: Path, rows: int = ROWS, shard_size: int = 4,
              **extra) -> Path:
    job = {
        "model": str(model),
        "input": {"path": str(prompts), "id_column": "id", "limit": rows},
        "generation": {"max_tokens": 16, "temperature": 0.8, "seed": 7, **extra.pop("generation", {})},
        "output": {"dir": str(out), "shard_size": shard_size},
        **extra,
    }
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def cli(*args) -> list[str]:
    exe = Path(sys.executable).with_name("pipeline")
    return [str(exe) if exe.is_file() else shutil.which("pipeline"), *map(str, args)]


def pipeline(*args) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), cwd=ROOT, capture_output=True, text=True, timeout=600)


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(cli(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lock_record(out: Path) -> dict | None:
    try:
        return json.loads((out / ".lock").read_text())
    except (OSError, ValueError):
        return None


def rows_committed(out: Path) -> int:
    try:
        return json.loads((out / "manifest.json").read_text())["rows"]
    except (OSError, ValueError):
        return 0




def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def committed(out: Path) -> dict[tuple, dict]:
    """The committed rows by key, shard by shard as the manifest lists them; each shard readable with the
    rows the manifest records, no key twice."""
    manifest = json.loads((out / "manifest.json").read_text())
    rows = {}
    for s in manifest["shards"]:
        table = pq.read_table(out / s["file"])
        assert table.num_rows == s["rows"], s
        for r in table.select(COMPARED).to_pylist():
            key = (r["id"], r["sample_index"])
            assert key not in rows, f"duplicate row {key}"
            rows[key] = r
    assert len(rows) == manifest["rows"]
    return rows


def assert_clean(out: Path) -> None:
    """No temporary file, no lock file, no shard file the manifest does not list."""
    names = {p.name for p in out.iterdir()}
    listed = {s["file"] for s in json.loads((out / "manifest.json").read_text())["shards"]}
    assert not [n for n in names if n.endswith(".tmp")], names
    assert ".lock" not in names
    assert {n for n in names if n.endswith(".parquet")} == listed


def all_keys(rows: int = ROWS) -> list[tuple]:
    return [(f"row-{i:02d}", 0) for i in range(rows)]


def in_use(out: Path, record: dict) -> str:
    return (f"error: output.dir '{out}' is in use by another run (pid {record['pid']} on {record['host']}, "
            f"since {record['started']})")


# --- one run at a time ------------------------------------------------------------------------------


def test_a_second_run_on_a_dir_in_use_is_refused_and_touches_nothing(tiny_model, prompts, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out, rows=60)
    other = write_job(tmp_path / "other.yaml", tiny_model, prompts, out, rows=60, generation={"max_tokens": 4})
    first = start("run", job, "--no-progress")
    try:
        wait_until(lambda: (lock_record(out) or {}).get("pid") == first.pid and rows_committed(out) > 0, first)
        first.send_signal(signal.SIGSTOP)  # holds the lock, mid-run, for as long as the checks take
        record = lock_record(out)
        assert record["host"] == HOST and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["started"])
        before = snapshot(out)
        for args in (("run", job), ("run", other, "--no-progress"), ("validate", job)):
            proc = pipeline(*args)
            assert proc.stderr.splitlines() == [in_use(out, record)], f"{args}:\n{proc.stderr}"
            assert proc.returncode == 2, args
            assert proc.stdout == ""
        # readers take no lock
        assert pipeline("status", out).returncode == 0
        assert pipeline("export", out, "--to", tmp_path / "so-far.parquet").returncode == 0
        assert pq.read_table(tmp_path / "so-far.parquet").num_rows == rows_committed(out)
        assert pipeline("report", out, "--out", tmp_path / "report" / "report.html").returncode == 0
        assert snapshot(out) == before, "a refused run or a reader changed the output dir"
        first.send_signal(signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.communicate()
    assert first.returncode == 0, stderr[-3000:]
    assert "done: 60 rows written (0 failed, 0 from earlier runs)" in stdout
    assert sorted(committed(out)) == all_keys(60)
    assert_clean(out)


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tiny_model, prompts, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out)
    proc = start("run", job, "--no-progress")
    try:
        wait_until(lambda: (lock_record(out) or {}).get("pid") == proc.pid, proc)
    finally:
        proc.kill()
        proc.communicate()
    record = lock_record(out)
    assert record["pid"] == proc.pid  # left behind; the kernel dropped the flock itself
    done = pipeline("run", job, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"output.dir '{out}': taking over the lock of pid {proc.pid} on {HOST} (since {record['started']}), "
            "which is no longer running") in done.stdout.splitlines()
    assert sorted(committed(out)) == all_keys()
    assert_clean(out)


def test_the_lock_in_process(tmp_path, caplog):
    """Two holders in one process conflict too (flock is per open file); the in-use check changes nothing;
    release removes the file. Without flock (ENOLCK) a run goes on with a warning, refused only by the
    record of a live process of this host."""
    out = tmp_path / "out"
    notes = []
    with outdir.RunLock(out, note=notes.append) as lock:
        assert lock.locked and lock_record(out) == lock.holder and lock.holder["pid"] == os.getpid()
        for attempt in (lambda: outdir.RunLock(out), lambda: outdir.check_not_in_use(out)):
            with pytest.raises(OutputError) as e:
                attempt()
            assert f"error: {e.value}" == in_use(out, lock.holder)
        assert lock_record(out) == lock.holder
    assert not (out / ".lock").exists() and notes == []
    outdir.check_not_in_use(out)

    real = outdir.fcntl.flock

    def no_locks(fd, op):
        if op & outdir.fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, op)

    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING):
        mp.setattr(outdir.fcntl, "flock", no_locks)
        with outdir.RunLock(out) as lock:
            assert not lock.locked
            assert "does not support locks" in caplog.text
            with pytest.raises(OutputError, match=f"in use by another run \\(pid {os.getpid()} on"):
                outdir.RunLock(out)
    assert not (out / ".lock").exists()


def test_the_ray_driver_holds_the_lock(tiny_model, prompts, tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out, rows=48, generation={"max_tokens": 48},
                    executor="ray", ray={"actors": 1, "unit_rows": 4})
    local = write_job(tmp_path / "local.yaml", tiny_model, prompts, out, rows=48, generation={"max_tokens": 48})
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen(cli("run", job, "--ray", "local", "--no-progress"), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (lock_record(out) or {}).get("pid") == driver.pid, driver, timeout=180)
        second = pipeline("run", local, "--no-progress")
        assert driver.poll() is None, "the Ray run ended before the second run was refused"
        assert second.stderr.splitlines() == [in_use(out, lock_record(out))], second.stderr
        assert second.returncode == 2
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 0, stderr[-3000:]
    assert sorted(committed(out)) == all_keys(48)
    assert_clean(out)


# --- real small and read-only file systems (the tmpfs fixture: conftest.py) -------------------------


PAGE = 4096


def free_pages(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // PAGE


def fill(mnt: Path, leave_pages: int) -> Path:
    """A filler file that leaves exactly ``leave_pages`` pages of ``mnt`` free."""
    filler = mnt / f"filler-{uuid.uuid4().hex}"
    filler.write_bytes(b"\0" * ((free_pages(mnt) - leave_pages) * PAGE))
    assert free_pages(mnt) == leave_pages
    return filler


BIG_SHARDS = {"shard_size": 8, "generation": {"max_tokens": 32, "ignore_eos": True, "logprobs": 20}}  # ~10 pages each


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, prompts):
    """The rows of an uninterrupted run of the disk-full job, on an ordinary disk."""
    tmp = tmp_path_factory.mktemp("reference")
    job = write_job(tmp / "job.yaml", tiny_model, prompts, tmp / "out", **BIG_SHARDS)
    proc = pipeline("run", job, "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return committed(tmp / "out")


def test_disk_full_while_writing_a_shard_stops_cleanly_and_resumes(tiny_model, prompts, tmp_path, tmpfs, reference):
    mnt = tmpfs("size=1m")
    out = mnt / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out, **BIG_SHARDS)
    first = pipeline("run", job, "--no-progress", "--limit", "8")  # one shard committed
    assert first.returncode == 0, first.stderr[-3000:]
    shard = math.ceil((out / "part-00000.parquet").stat().st_size / PAGE)  # the others within a page of it
    manifest = math.ceil((out / "manifest.json").stat().st_size / PAGE) + 1  # it grows a little
    assert shard >= 2 * (manifest + 2), (shard, manifest)
    # the lock file, the manifest's temporary copy and 1.5 shards: the second shard of this run does not fit
    filler = fill(mnt, 1 + manifest + 3 * shard // 2)

    proc = pipeline("run", job, "--no-progress")
    assert proc.returncode == 1, proc.stderr[-3000:]
    m = re.fullmatch(rf"error: output\.dir '{re.escape(str(out))}': no space left on device while writing "
                     r"(part-\d{5}\.parquet); (\d+) rows committed, resume after freeing space",
                     "\n".join(without_machine_warnings(proc.stderr)))
    assert m, proc.stderr
    file, n = m.group(1), int(m.group(2))
    assert (file, n) == ("part-00002.parquet", 16) and rows_committed(out) == n
    assert proc.stdout.splitlines()[-1] == (f"stopped (no space left on device while writing {file}): {n}/{ROWS} "
                                            f"rows committed in {out}; free space, then run the same command "
                                            "again to resume")
    record = json.loads((out / "manifest.json").read_text())["runs"][-1]
    assert record["stopped"] == f"no space left on device while writing {file}"
    assert record["finished"] and record["rows_written"] == 8 and record["interrupted"] is None
    before = committed(out)  # every committed shard reads, each key once
    assert all(before[k] == reference[k] for k in before)
    assert_clean(out)

    filler.unlink()
    done = pipeline("run", job, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{ROWS - n} rows written (0 failed, {n} from earlier runs)" in done.stdout
    assert committed(out) == reference  # every row exactly once, as an uninterrupted run made it
    assert_clean(out)


def test_disk_full_before_the_run_record_is_saved_says_so(tiny_model, prompts, tmp_path, tmpfs):
    """One page left: the write check and the lock file fit, the manifest does not, twice (the run record
    at the start, and its end): both are said, and the manifest is left as it was."""
    mnt = tmpfs("size=1m")
    out = mnt / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out)
    first = pipeline("run", job, "--no-progress", "--limit", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = (out / "manifest.json").read_bytes()
    filler = fill(mnt, 1)

    proc = pipeline("run", job)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: output.dir '{out}': no space left on device while writing manifest.json; 4 rows committed, "
        "resume after freeing space",
        "error: the run record could not be saved (no space left on device while writing manifest.json): "
        "manifest.json holds the last commit, without this run's end",
    ]
    assert proc.stdout.splitlines() == [
        f"stopped (no space left on device while writing manifest.json): 4/{ROWS} rows committed in {out}; "
        "free space, then run the same command again to resume"]
    assert (out / "manifest.json").read_bytes() == manifest
    assert_clean(out)

    filler.unlink()
    done = pipeline("run", job, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(committed(out)) == all_keys()
    assert_clean(out)


def test_a_read_only_output_dir_is_refused_before_the_model_loads(tiny_model, prompts, tmp_path, tmpfs):
    ro = tmpfs("ro,size=1m")
    fresh = write_job(tmp_path / "fresh.yaml", tiny_model, prompts, ro / "out")  # would be created there
    rw = tmpfs("size=1m")
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, rw / "out")
    assert pipeline("run", job, "--no-progress", "--limit", "4").returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True)
    before = snapshot(rw / "out")
    for job_file, out in ((fresh, ro / "out"), (job, rw / "out")):
        for command in ("validate", "run"):
            proc = pipeline(command, job_file)  # run with progress: no "loaded ..." line either
            assert proc.stderr.splitlines() == [f"error: output.dir '{out}' is not writable: Read-only file system"], \
                f"{command} {out}:\n{proc.stderr}"
            assert proc.returncode == 2 and proc.stdout == ""
    assert not (ro / "out").exists()
    assert snapshot(rw / "out") == before


def test_an_output_dir_under_a_file_is_refused_by_validate_as_by_run(tiny_model, prompts, tmp_path):
    (tmp_path / "afile").write_text("x")
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, tmp_path / "afile" / "sub" / "out")
    for command in ("validate", "run"):
        proc = pipeline(command, job)
        assert proc.stderr.splitlines() == [f"error: output.dir '{tmp_path / 'afile' / 'sub' / 'out'}' is not "
                                            f"writable: {tmp_path / 'afile'} is a file, not a directory"], proc.stderr
        assert proc.returncode == 2 and proc.stdout == ""
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("given, out, refused", [
    ("indir", "indir/out", True),  # a directory input is searched recursively
    ("indir", "indir", True),
    ("indir/**/*.parquet", "indir/runs/out", True),
    ("indir/*.parquet", "indir", True),  # its shards would sit where the glob looks
    ("indir/*.parquet", "indir/out", False),  # the glob does not go into subdirectories
    ("indir/**/*.parquet", "indir/.runs/out", False),  # nor does a wildcard into hidden ones
    ("indir/prompts.parquet", "indir/out", False),
], ids=["dir-sub", "dir-itself", "recursive-glob", "glob-same-dir", "glob-not-below", "glob-hidden", "file"])
def test_an_output_dir_where_the_input_is_read_from_is_refused(tiny_model, prompts, tmp_path, given, out, refused):
    """The first run used to work; the next read its own shards (or manifest.json) as input rows and failed on
    'files mix formats' or duplicate ids."""
    (tmp_path / "indir").mkdir()
    shutil.copy(prompts, tmp_path / "indir" / "prompts.parquet")
    job = write_job(tmp_path / "job.yaml", tiny_model, tmp_path / given, tmp_path / out, rows=2,
                    generation={"max_tokens": 2})
    for command in ("validate", "run", "run"):
        proc = pipeline(command, job, "--no-progress") if command == "run" else pipeline(command, job)
        if refused:
            assert proc.returncode == 2 and proc.stdout == "", proc.stderr
            assert proc.stderr.splitlines()[-1] == (
                f"error: output.dir '{tmp_path / out}' is inside what input.path '{tmp_path / given}' reads: a later "
                f"run would read its shards as input rows; write the output elsewhere"), proc.stderr
            assert not (tmp_path / out / "manifest.json").exists()
        else:
            assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("out, refused", [("ds/out", True), ("ds", True), ("elsewhere/out", False)])
def test_an_output_dir_inside_a_local_dataset_directory_is_refused(tiny_model, prompts, tmp_path, out, refused):
    """``datasets`` picks a local dataset directory's files from all of it (the most common suffix): a later run
    would read the shards as its input rows, as an input.path directory would. ``run`` and ``validate``
    (``check_output_dir``) refuse it alike, before writing."""
    from pipeline.jobspec import job_from_dict
    from pipeline.run import run_job
    from pipeline.run.plan import check_output_dir

    (tmp_path / "ds").mkdir()
    shutil.copy(prompts, tmp_path / "ds" / "train.parquet")
    job = job_from_dict({"model": str(tiny_model), "input": {"dataset": {"name": str(tmp_path / "ds")},
                                                             "id_column": "id", "limit": 2},
                         "generation": {"max_tokens": 2}, "output": {"dir": str(tmp_path / out), "shard_size": 1}})
    if not refused:
        assert run_job(job, progress=False, echo=lambda _m: None).rows_total == 2
        assert check_output_dir(job) is not None
        return
    for check in (check_output_dir, lambda j: run_job(j, progress=False, echo=lambda _m: None)):
        with pytest.raises(OutputError) as ei:
            check(job)
        assert str(ei.value) == (f"output.dir '{tmp_path / out}' is inside what input.dataset '{tmp_path / 'ds'}' "
                                 "reads: a later run would read its shards as input rows; write the output elsewhere")
    assert not (tmp_path / out / "manifest.json").exists()


def test_a_relative_input_path_is_recorded_for_readers_elsewhere(tiny_model, prompts, tmp_path):
    """status, export --join-input and report read the job's input from the manifest; a relative input.path
    was resolved against their own working directory (a wrong pending count, or null input columns)."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    run_dir.mkdir(), other.mkdir()
    shutil.copy(prompts, run_dir / "in.parquet")
    pq.write_table(pa.table({"id": ["x1", "x2"], "prompt": ["a", "b"]}), other / "in.parquet")  # a decoy
    job = write_job(run_dir / "job.yaml", tiny_model, Path("in.parquet"), run_dir / "out", rows=6,
                    generation={"max_tokens": 2})
    proc = subprocess.run(cli("run", job, "--no-progress", "--limit", 4), cwd=run_dir, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    recorded = json.loads((run_dir / "out" / "manifest.json").read_text())["info"]["job"]["input"]["path"]
    assert recorded == str(run_dir / "in.parquet")
    status = subprocess.run(cli("status", run_dir / "out", "--json"), cwd=other, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert (st["rows_done"], st["rows_pending"]) == (4, 2)
    export = subprocess.run(cli("export", run_dir / "out", "--to", other / "x.parquet", "--join-input"), cwd=other,
                            capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    t = pq.read_table(other / "x.parquet")
    assert t.column("input_prompt").null_count == 0
    assert t.column("input_prompt").to_pylist() == pq.read_table(run_dir / "in.parquet").column("prompt").to_pylist()[:4]


def test_a_manifest_that_does_not_fit_commits_nothing(tmpfs):
    """The shard fits exactly, its manifest does not: nothing is committed, the manifest in memory is the one
    on disk (a later save cannot commit the shard), and the shard file is removed to give its space back."""
    mnt = tmpfs("size=1m")
    out = mnt / "out"
    table = pa.table({"id": [f"r{i}" for i in range(200)], "sample_index": [0] * 200,
                      "error": pa.array([None] * 200, pa.string()),
                      "text": [uuid.uuid4().hex * 20 for _ in range(200)]})  # ~160 KB, incompressible
    store = ShardStore(out, {"generation": {"max_tokens": 2}})
    store.add_run({})
    store.commit(table)
    on_disk = (out / "manifest.json").read_bytes()
    fill(mnt, math.ceil((out / "part-00000.parquet").stat().st_size / PAGE))  # room for the same bytes again
    with pytest.raises(DiskFullError) as e:
        store.commit(table)
    assert str(e.value) == f"output.dir '{out}': no space left on device while writing manifest.json"
    assert (out / "manifest.json").read_bytes() == on_disk
    assert json.loads(on_disk)["shards"] == store.manifest["shards"] and store.manifest["rows"] == 200
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "part-00000.parquet"]


def test_a_read_only_remount_between_commits_raises_an_output_write_error(tmpfs):
    """The file system turns read-only between two commits (a real remount): the next commit is one
    ``OutputWriteError`` naming the file, nothing is committed, and once writable again the same store
    commits."""
    mnt = tmpfs("size=1m")
    out = mnt / "out"
    table = pa.table({"id": ["a", "b"], "sample_index": [0, 0], "error": pa.array([None, None], pa.string())})
    store = ShardStore(out, {"generation": {"max_tokens": 2}})
    store.add_run({})
    store.commit(table)
    before = snapshot(out)
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    with pytest.raises(OutputWriteError) as e:
        store.commit(table.slice(0, 1))
    assert not isinstance(e.value, DiskFullError) and e.value.fix == "make the output dir writable"
    assert str(e.value) == f"output.dir '{out}': read-only file system while writing part-00001.parquet"
    assert snapshot(out) == before and store.manifest["rows"] == 2 and len(store.manifest["shards"]) == 1
    subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
    assert store.commit(table.slice(0, 1)) == "part-00001.parquet"  # nothing of the failed write is left
    assert json.loads((out / "manifest.json").read_text())["rows"] == 3


def test_an_output_dir_removed_mid_run_stops_the_run_with_one_line(tiny_model, prompts, tmp_path, reference):
    """``rm -rf`` of the output dir while a run writes it (the run held still by SIGSTOP after its first
    shard): the next write fails, the run stops with exit 1, one error line naming the file and the summary
    line, no traceback; the same command then starts over and makes every row as an uninterrupted run."""
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out, **BIG_SHARDS)
    proc = start("run", job, "--no-progress")
    wait_until(lambda: (out / "part-00000.parquet").exists(), proc, what="the first shard")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        shutil.rmtree(out)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]
    lines = without_machine_warnings(stderr)
    m = re.fullmatch(rf"error: output\.dir '{re.escape(str(out))}': no such file or directory while writing "
                     r"(part-\d{5}\.parquet|manifest\.json); (\d+) rows committed, resume once it is writable", lines[0])
    assert m, stderr  # the rows the run had committed (0 or 8: where SIGSTOP caught it), though the dir is gone
    assert lines[1:] == ["error: the run record could not be saved (no such file or directory while writing "
                         "manifest.json): manifest.json holds the last commit, without this run's end"], stderr
    assert stdout.splitlines()[-1] == (f"stopped (no such file or directory while writing {m.group(1)}): "
                                       f"{m.group(2)}/{ROWS} rows committed in {out}; make the output dir writable, "
                                       "then run the same command again to resume")
    assert not out.exists()
    again = pipeline("run", job, "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert committed(out) == reference
    assert_clean(out)
