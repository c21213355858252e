"""A row whose generation raises what is not a ``RowError`` stops the run, through the real CLI in a subprocess
on a tiny random-weight model: exit 1, one error line naming the row and the exception, the summary line, the
run record finished with the reason, the rows committed before it intact (no row marked failed); the next run
resumes and makes every row once, as an uninterrupted run does. Sequential, batched, and on Ray.

The failure is a real MLX error raised inside the model's forward pass: a ``sitecustomize`` module on the
subprocess's ``PYTHONPATH`` (Python imports it at start-up, in Ray workers too) wraps the llama family's
``Model.__call__`` so that a forward over ``PIPELINE_TEST_FORWARD_FAIL_AT`` or more tokens at once runs a matmul
of mismatched shapes. Only row ``row-06`` has such a prompt (155 tokens; the others about 40, the warm-up 8),
so the rows before it generate normally and row-06's prefill fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT

ROWS = 10
BAD = "row-06"
FAIL_AT = 100  # tokens in one forward call; row-06's prompt has 155, the others about 40
COMPARED = ["id", "sample_index", "prompt", "completion", "finish_reason", "stop_reason", "stop_token_id",
            "completion_tokens", "prompt_tokens", "seed", "error"]
MLX_ERROR = ("ValueError: [matmul] Last dimension of first input with shape (2,3) must match second to last "
             "dimension of second input with shape (4,5).")

HOOK = '''\
"""Test hook (tests/test_generation_error.py): the llama forward raises a real MLX error on long inputs."""
import os

if os.environ.get("PIPELINE_TEST_FORWARD_FAIL_AT"):
    import pipeline.models.llama as llama  # pipeline first: it loads OpenBLAS before mlx.core

    import mlx.core as mx

    _at = int(os.environ["PIPELINE_TEST_FORWARD_FAIL_AT"])
    _forward = llama.Model.__call__

    def _failing(self, inputs, *args, **kwargs):
        if inputs.shape[-1] >= _at:
            mx.zeros((2, 3)) @ mx.zeros((4, 5))  # mismatched shapes: MLX raises ValueError
        return _forward(self, inputs, *args, **kwargs)

    llama.Model.__call__ = _failing
'''


pytestmark = pytest.mark.usefixtures("tiny_home")  # the tiny model and a temporary $PIPELINE_HOME (conftest)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    text = [f"Item {i}: " + ("tell me more " * 40 if f"row-{i:02d}" == BAD else "tell me more " * (1 + i % 3))
            for i in range(ROWS)]
    path = tmp_path_factory.mktemp("input") / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"row-{i:02d}" for i in range(ROWS)], "prompt": text}), path)
    return path


@pytest.fixture(scope="module")
def hook_env(tmp_path_factory):
    """The environment of a run whose long forward calls fail: the hook's directory first on PYTHONPATH."""
    d = tmp_path_factory.mktemp("hook")
    (d / "sitecustomize.py").write_text(HOOK, encoding="utf-8")
    path = os.pathsep.join(p for p in (str(d), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PIPELINE_TEST_FORWARD_FAIL_AT": str(FAIL_AT),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def write_job(path: Path, model: Path, prompts: Path, out: Path, **extra) -> Path:
    job = {
        "model": str(model),
        "input": {"path": str(prompts), "id_column": "id"},
        "generation": {"max_tokens": 12, "temperature": 0.8, "seed": 5},
        "output": {"dir": str(out), "shard_size": 4},
        # prefix caching off: with it, prompts are prefilled in one-block chunks and no forward is long
        # enough to fail
        "cache": {"prefix_cache_gb": 0},
        **extra,
    }
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def pipeline(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["pipeline", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def committed(out: Path) -> dict[tuple, dict]:
    """The committed rows by key; every shard readable with the rows the manifest records, no key twice."""
    manifest = json.loads((out / "manifest.json").read_text())
    rows = {}
    for s in manifest["shards"]:
        table = pq.read_table(out / s["file"])
        assert table.num_rows == s["rows"], s
        for r in table.select(COMPARED).to_pylist():
            assert (r["id"], r["sample_index"]) not in rows
            rows[(r["id"], r["sample_index"])] = r
    assert len(rows) == manifest["rows"]
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, prompts):
    """The rows of an uninterrupted run (no hook), sequential and batched (the same job otherwise)."""
    out = {}
    for batch_size in (1, 2):
        tmp = tmp_path_factory.mktemp(f"reference-b{batch_size}")
        job = write_job(tmp / "job.yaml", tiny_model, prompts, tmp / "out", engine={"batch_size": batch_size})
        proc = pipeline("run", job, "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[batch_size] = committed(tmp / "out")
    return out


def check_stopped(proc: subprocess.CompletedProcess, out: Path, reference: dict, sample: str = "0") -> int:
    """The stopped run's output: exit 1, the error line, the summary line, the run record, the committed
    rows (as the uninterrupted run made them, none failed). Returns how many rows it committed."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr
    m = re.fullmatch(rf"error: row '{BAD}' \(sample {sample}\) raised {re.escape(MLX_ERROR)}; (\d+) rows "
                     r"committed, run again to resume", error[0])
    assert m, error[0]
    n = int(m.group(1))
    reason = error[0].removeprefix("error: ").rsplit(f"; {n} rows committed", 1)[0]
    assert proc.stdout.splitlines()[-1] == (f"stopped ({reason}): {n}/{ROWS} rows committed in {out}; fix the "
                                            "error, then run the same command again to resume")
    assert "row(s) failed" not in proc.stderr and "failed, " not in proc.stdout  # no row took the blame
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["runs"][-1]
    assert record["stopped"] == reason and record["finished"] and record["interrupted"] is None
    assert record["rows_written"] == n and record["rows_failed"] == 0
    assert "_failing" in record["traceback"] and "ValueError" in record["traceback"]
    assert manifest["rows"] == n and manifest["complete"] is False
    rows = committed(out)
    assert (BAD, 0) not in rows
    assert all(r["error"] is None and r == reference[k] for k, r in rows.items())
    assert not (out / ".lock").exists()
    status = pipeline("status", out, "--verify")
    assert status.returncode == 0, status.stderr
    assert f"rows: {n} done (0 failed), {ROWS - n} pending" in status.stdout
    return n


def check_resumed(job: Path, out: Path, n: int, reference: dict, *args) -> None:
    """The same command without the hook: the rows not committed are made, each once, as before (on Ray, a
    unit an actor wrote after the stop, before the cluster closed, is adopted: one of the earlier runs')."""
    done = pipeline("run", job, "--no-progress", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    m = re.search(r"(\d+) rows written \(0 failed, (\d+) from earlier runs\)", done.stdout)
    assert m and int(m.group(1)) + int(m.group(2)) == ROWS and int(m.group(2)) >= n, done.stdout
    if "adopted" not in done.stdout:
        assert int(m.group(2)) == n, done.stdout
    assert committed(out) == reference


def test_a_row_raising_stops_the_run_and_the_next_run_resumes(tiny_model, prompts, tmp_path, hook_env, reference):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out)
    proc = pipeline("run", job, "--no-progress", env=hook_env)
    n = check_stopped(proc, out, reference[1])
    assert n == 6  # rows 0-5: one shard of 4, then the 2 finished before row-06, committed when it stopped
    assert [s["rows"] for s in json.loads((out / "manifest.json").read_text())["shards"]] == [4, 2]
    check_resumed(job, out, n, reference[1])


def test_batched_a_row_raising_names_the_rows_in_flight(tiny_model, prompts, tmp_path, hook_env, reference):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out, engine={"batch_size": 2})
    proc = pipeline("run", job, "--no-progress", env=hook_env)
    # row-06's prefill fails as it takes a free slot: named first, then the rows started whose results had not
    # come back (the other slot's, and one finished in the same step as row-06 was admitted)
    n = check_stopped(proc, out, reference[2], sample=r"0(?:; batched with 'row-0[0-5]'(?:, 'row-0[0-5]')?)?")
    assert 4 <= n <= 6
    check_resumed(job, out, n, reference[2])


def test_on_ray_a_row_raising_in_an_actor_stops_the_run(tiny_model, prompts, tmp_path, hook_env, reference):
    """The actor's GenerationError reaches the driver as itself; the units committed before it stay."""
    pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_model, prompts, out, executor="ray",
                    ray={"actors": 1, "unit_rows": 2})
    proc = pipeline("run", job, "--ray", "local", "--no-progress", env=hook_env)
    n = check_stopped(proc, out, reference[1])
    assert n in (0, 2, 4, 6)  # whole units: those before row-06's whose records reached the driver first
    check_resumed(job, out, n, reference[1], "--ray", "local")


def test_a_commit_failing_after_the_stop_keeps_the_row_error_as_its_cause(tiny_model, prompts, tmp_path, monkeypatch):
    """The row's error stops the run; committing the rows finished before it then fails with an I/O error that is
    not a full disk (EIO, which no file system here can be made to raise on demand: ``ShardStore.commit`` raises
    it). The I/O error propagates with the row's ``GenerationError`` as its cause, not in its place."""
    import errno

    import mlx.core as mx

    import pipeline.models.llama as llama
    from pipeline.jobspec import load_job
    from pipeline.run.control import run_job
    from pipeline.run.local import GenerationError
    from pipeline.shards import ShardStore

    forward = llama.Model.__call__

    def failing(self, inputs, *args, **kwargs):
        if inputs.shape[-1] >= FAIL_AT:
            mx.zeros((2, 3)) @ mx.zeros((4, 5))
        return forward(self, inputs, *args, **kwargs)

    def commit(self, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(llama.Model, "__call__", failing)
    monkeypatch.setattr(ShardStore, "commit", commit)
    job = load_job(write_job(tmp_path / "job.yaml", tiny_model, prompts, tmp_path / "out",
                             output={"dir": str(tmp_path / "out"), "shard_size": 100}))
    with pytest.raises(OSError) as e:
        run_job(job, progress=False, echo=lambda *_: None)
    assert e.value.errno == errno.EIO
    cause = e.value.__cause__
    assert isinstance(cause, GenerationError) and f"'{BAD}'" in str(cause) and MLX_ERROR in str(cause), repr(cause)
