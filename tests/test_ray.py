"""``executor: ray`` on a local Ray cluster (one per test session: 2 CPUs, a 200 MB object store) with a
tiny random-weight model: two actors give the rows of a local run; an actor that dies mid-unit costs no
row and duplicates none; a driver SIGKILLed mid-run resumes from the manifest; a ``--ray local`` driver
stopped by SIGTERM exits 143 and resumes; a unit shard written but not committed is adopted; an
unreachable address fails at once, touching nothing; asking for more CPUs than the cluster has is a job
problem; the actors' resources are sized for the units; and without Ray the job fails with one line. Each
Ray test has a time limit (their failure mode is a hang)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

import pipeline  # noqa: F401  (OpenBLAS before tiny_model imports mlx.core, as in `pipeline run` and the actors)

# isort: split
from conftest import ROOT
from tiny_model import write_prompts

from pipeline.run.cluster import ResourceError, actor_resources
from pipeline.jobspec import JobSpecError, RaySpec, job_from_dict
from pipeline.run import run_job
from pipeline.shards import keys_digest

ROWS = 48
UNIT = 4
TIME_LIMIT_S = 120
# Every column that must not depend on where a row ran; the timing and memory columns are left out.
COMPARED = ["id", "sample_index", "prompt", "completion", "finish_reason", "stop_reason", "stop_token_id",
            "completion_tokens", "prompt_tokens", "seed", "error", "batch_size"]


@pytest.fixture(autouse=True)
def time_limit():
    """Fail a test that runs longer than TIME_LIMIT_S (SIGALRM raises in the main thread)."""
    def expire(signum, frame):
        raise TimeoutError(f"test ran over {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIME_LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def ray_address():
    """A local Ray cluster for the whole session; its GCS address (drivers in subprocesses connect to it)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, object_store_memory=2e8, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


pytestmark = pytest.mark.usefixtures("tiny_home")  # the tiny model and a temporary $PIPELINE_HOME (conftest)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet", ROWS)


def job_dict(model: Path, prompts: Path, out: Path, executor: str = "ray", batch_size: int | str = 1) -> dict:
    return {
        "model": str(model),
        "input": {"path": str(prompts), "id_column": "id"},
        "generation": {"max_tokens": 16, "temperature": 0.8, "seed": 1234},
        "engine": {"batch_size": batch_size},
        "output": {"dir": str(out), "shard_size": 8},
        "executor": executor,
        "ray": {"actors": 2, "unit_rows": UNIT},
    }


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory, tiny_model, prompts):
    """``local_rows(batch_size)``: the committed rows of a local run of the job, by key (once per size)."""
    done = {}

    def get(batch_size: int | str = 1) -> dict:
        if batch_size not in done:
            out = tmp_path_factory.mktemp(f"local-b{batch_size}") / "out"
            job = job_from_dict(job_dict(tiny_model, prompts, out, "local", batch_size))
            assert run_job(job, progress=False, echo=lambda _: None).complete
            done[batch_size] = committed(out)
        return done[batch_size]

    return get


def committed(out: Path) -> dict[tuple, dict]:
    """The committed rows (COMPARED columns) by ``(id, sample_index)``, read shard by shard as the manifest
    lists them; asserts each shard holds the rows the manifest says and no key appears twice."""
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


def write_job(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


def pipeline_cmd(*args) -> list[str]:
    return [str(Path(sys.executable).with_name("pipeline")), *map(str, args)]


def rows_committed(out: Path) -> int:
    try:
        return json.loads((out / "manifest.json").read_text())["rows"]
    except (FileNotFoundError, ValueError):
        return 0


def assert_clean(out: Path) -> None:
    """The job is complete and the directory holds exactly the committed shards and the manifest."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert sorted(p.name for p in out.iterdir()) == sorted([s["file"] for s in manifest["shards"]] + ["manifest.json"])


@pytest.mark.parametrize("batch_size", [1, 4, "auto"], ids=["sequential", "batched", "auto"])
def test_two_actors_give_the_rows_of_a_local_run(ray_address, tiny_model, prompts, local_rows, tmp_path, batch_size):
    out = tmp_path / "out"
    summary = run_job(job_from_dict(job_dict(tiny_model, prompts, out, batch_size=batch_size)), progress=False,
                      echo=lambda _: None)
    assert summary.complete and summary.rows_written == ROWS
    assert len(summary.workers) == 2
    assert committed(out) == local_rows(batch_size)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] != [] and all(s["file"].startswith("unit-") for s in manifest["shards"])
    assert manifest["plan"]["units"] == {}  # every planned unit committed
    workers = manifest["runs"][-1]["workers"]
    assert len(workers) == 2 and all(w["warmup_s"] > 0 for w in workers.values())  # each actor warmed up once
    if batch_size == "auto":  # resolved once, in the capacity task, for every actor: the local run's size
        from pipeline.run.local import auto_batch_cap

        assert summary.batch_size == manifest["runs"][-1]["batch_size"] == auto_batch_cap()
    assert_clean(out)


def test_an_actor_that_dies_mid_unit_costs_no_row(ray_address, tiny_model, prompts, local_rows, tmp_path,
                                                  monkeypatch):
    out, marker = tmp_path / "out", tmp_path / "crashed"
    monkeypatch.setenv("PIPELINE_TEST_CRASH_UNIT", f"unit-00003.parquet:{marker}")
    summary = run_job(job_from_dict(job_dict(tiny_model, prompts, out)), progress=False, echo=lambda _: None)
    assert marker.exists(), "the actor did not reach the crash point"
    assert summary.complete and summary.rows_written == ROWS
    assert len(summary.workers) == 3, summary.workers  # two actors, then the one Ray started in place of the dead one
    assert committed(out) == local_rows()
    assert_clean(out)


def test_driver_sigkilled_mid_run_resumes_from_the_manifest(ray_address, tiny_model, prompts, tmp_path):
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    spec = job_dict(tiny_model, prompts, out)
    spec["generation"]["max_tokens"] = 48  # long enough to kill it mid-run
    job.write_text(yaml.safe_dump(spec), encoding="utf-8")
    cmd = [str(Path(sys.executable).with_name("pipeline")), "run", str(job), "--ray", ray_address, "--no-progress"]

    def rows_committed() -> int:
        try:
            return json.loads((out / "manifest.json").read_text())["rows"]
        except (FileNotFoundError, ValueError):
            return 0

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while rows_committed() < 2 * UNIT:
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.communicate()}"
        time.sleep(0.005)
    proc.kill()
    proc.communicate(timeout=60)
    before = committed(out)
    assert 2 * UNIT <= len(before) < ROWS, "the run was not killed mid-run"
    local = {**spec, "executor": "local", "output": {**spec["output"], "dir": str(tmp_path / "local")}}
    assert run_job(job_from_dict(local), progress=False, echo=lambda _: None).complete
    reference = committed(tmp_path / "local")
    assert all(before[k] == reference[k] for k in before)

    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIME_LIMIT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    earlier = int(re.search(r"(\d+) from earlier runs", done.stdout).group(1))
    assert earlier >= len(before)  # more if a unit in flight at the kill had renamed its shard (adopted)
    assert f"{ROWS - earlier} rows written" in done.stdout
    assert committed(out) == reference
    assert_clean(out)


def test_a_unit_shard_written_but_not_committed_is_adopted(ray_address, tiny_model, prompts, local_rows, tmp_path):
    """As if the driver died after two units were renamed into place and before they were committed: one
    shard is whole, one was damaged since; a third, unplanned, name is left over too. The next run adopts the
    whole one, removes the other two, and generates only the damaged unit's rows."""
    out = tmp_path / "out"
    job = job_from_dict(job_dict(tiny_model, prompts, out))
    assert run_job(job, progress=False, echo=lambda _: None).complete
    manifest = json.loads((out / "manifest.json").read_text())
    whole, damaged = manifest["shards"][-2:]
    manifest["shards"] = manifest["shards"][:-2]
    manifest["rows"] -= whole["rows"] + damaged["rows"]
    plan = {}
    for s in (whole, damaged):
        t = pq.read_table(out / s["file"], columns=["id", "sample_index"])
        plan[s["file"]] = {"rows": t.num_rows, "keys": keys_digest(zip(*(t.column(c).to_pylist() for c in t.column_names)))}
    manifest["plan"] = {"unit_rows": UNIT, "units": plan}
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    data = (out / damaged["file"]).read_bytes()
    (out / damaged["file"]).write_bytes(data[: len(data) // 2])
    (out / "unit-09999.parquet").write_bytes((out / whole["file"]).read_bytes())

    said = []
    summary = run_job(job, progress=False, echo=said.append)
    assert any("adopted 1 complete unit shard" in line and whole["file"] in line for line in said), said
    assert any("removed 2 uncommitted shard file(s)" in line for line in said), said
    assert summary.rows_skipped == ROWS - damaged["rows"] and summary.rows_written == damaged["rows"]
    assert committed(out) == local_rows()
    assert_clean(out)


def test_sigterm_stops_a_ray_local_driver_with_143_and_it_resumes(ray_address, tiny_model, prompts, tmp_path):
    """``ray.init`` installs its own SIGTERM handler (exit 15, a crash dump); the driver's must win."""
    out = tmp_path / "out"
    spec = job_dict(tiny_model, prompts, out)
    spec["generation"]["max_tokens"] = 48  # long enough to stop it mid-run
    job = write_job(tmp_path / "job.yaml", spec)
    proc = subprocess.Popen(pipeline_cmd("run", job, "--ray", "local", "--no-progress"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while rows_committed(out) < UNIT:  # the first unit committed
            assert proc.poll() is None, f"the run ended before it could be stopped:\n{proc.communicate()}"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr[-3000:]
    assert "SIGTERM: stopping; the units committed so far are kept" in stderr, stderr[-3000:]
    assert "SIGTERM received" not in stderr  # Ray's crash dump
    assert re.search(r"aborted \(SIGTERM\): \d+/48 rows committed", stdout), stdout
    before = committed(out)  # each committed row once
    assert UNIT <= len(before) < ROWS, "the run was not stopped mid-run"
    record = json.loads((out / "manifest.json").read_text())["runs"][-1]
    assert record["interrupted"] == "SIGTERM" and record["rows_written"] == len(before)

    assert run_job(job_from_dict(spec), progress=False, echo=lambda _: None).complete  # on the session's cluster
    after = committed(out)
    assert sorted(after) == sorted((f"row-{i:02d}", 0) for i in range(ROWS))  # every row, once
    assert all(after[k] == before[k] for k in before)
    assert_clean(out)


def test_an_unreachable_address_fails_at_once_touching_nothing(tiny_model, prompts, tmp_path):
    pytest.importorskip("ray.data")
    out = tmp_path / "out"
    spec = job_dict(tiny_model, prompts, out)
    local = job_from_dict({**spec, "executor": "local"})
    assert run_job(local, limit=8, progress=False, echo=lambda _: None).rows_written == 8
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(pipeline_cmd("run", write_job(tmp_path / "job.yaml", spec), "--ray", f"127.0.0.1:{port}",
                                       "--no-progress"), cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [(f"error: ray.address / --ray '127.0.0.1:{port}': nothing accepts connections at "
                       f"127.0.0.1:{port} (Connection refused); start the cluster there (ray start --head) or fix "
                       "the address")], done.stderr
    assert "RAY_AUTH_MODE" not in done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no run record, no shard touched


def test_a_model_that_does_not_load_in_the_actors_ends_the_run_record(ray_address, tiny_model, prompts, tmp_path):
    """kv_group_size 32 does not divide the tiny model's head_dim of 16: the actors' model load fails. The error
    reaches the driver as itself and the run record ends with it, so status does not call the run killed (the
    record was left open, as if the driver had been killed)."""
    from pipeline.engine.cache import CacheConfigError
    from pipeline.status import format_status, job_status

    out = tmp_path / "out"
    spec = job_dict(tiny_model, prompts, out)
    assert run_job(job_from_dict({**spec, "executor": "local"}), limit=4, progress=False, echo=lambda _: None).complete
    bad = job_from_dict({**spec, "cache": {"kv_bits": 8, "kv_group_size": 32}})
    with pytest.raises(CacheConfigError):
        run_job(bad, force=True, progress=False, echo=lambda _: None)
    last = json.loads((out / "manifest.json").read_text())["runs"][-1]
    assert "kv_group_size" in last["stopped"], last
    assert last["rows_written"] == 0 and "finished" in last
    st = job_status(out)
    assert (st["runs"], st["runs_unrecorded"]) == (2, 0) and "unrecorded" not in format_status(st)


def test_more_cpus_than_the_cluster_has_is_a_job_problem(ray_address, tiny_model, prompts, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    spec = job_dict(tiny_model, prompts, tmp_path / "out")
    spec["ray"]["num_cpus"] = 64
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", spec)), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.stderr == ("error: ray: 2 actor(s) x 64 CPU need 128 CPU(s), the cluster has 2; lower ray.actors or "
                             "ray.num_cpus\n")
    assert not (tmp_path / "out" / "manifest.json").exists()  # refused before the run is recorded


def test_actor_resources_are_sized_for_the_actors_that_run():
    two_cpus = {"CPU": 2.0}
    assert actor_resources(RaySpec(), two_cpus, units=12) == actor_resources(RaySpec(), two_cpus)
    res = actor_resources(RaySpec(), two_cpus, units=12)
    assert (res.actors, res.num_cpus, res.num_gpus, res.threads) == (2, 0.75, 0.0, 1)
    res = actor_resources(RaySpec(), two_cpus, units=1)  # one unit: one actor with the CPUs of two
    assert (res.actors, res.num_cpus, res.num_gpus, res.threads) == (1, 1.5, 0.0, 2)
    res = actor_resources(RaySpec(actors=2), two_cpus, units=1)
    assert (res.actors, res.num_cpus, res.threads) == (1, 1.5, 2)
    res = actor_resources(RaySpec(num_cpus=0.5), two_cpus, units=1)  # set in the job: kept
    assert (res.actors, res.num_cpus, res.threads) == (1, 0.5, 2)
    res = actor_resources(RaySpec(), {"CPU": 16.0, "GPU": 4.0}, units=3)
    assert (res.actors, res.num_cpus, res.num_gpus, res.threads) == (3, 1.0, 1.0, 1)
    with pytest.raises(ResourceError, match=r"^ray: 1 actor\(s\) x 1 GPU need 1 GPU\(s\), the cluster has 0; lower "
                                            r"ray.actors or ray.num_gpus$") as e:
        actor_resources(RaySpec(num_gpus=1), two_cpus, units=1)
    assert isinstance(e.value, JobSpecError)  # the CLI's exit 2


def test_executor_ray_without_ray_is_one_error_line(tmp_path, tiny_model, prompts, monkeypatch):
    from click.testing import CliRunner

    from pipeline.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_model, prompts, tmp_path / "out")), encoding="utf-8")
    result = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert result.exit_code == 1
    assert result.stderr == (f'error: executor: ray needs Ray Data: pip install -e "{ROOT}[ray]" (the ray extra of '
                             'this checkout)\n')
    assert not (tmp_path / "out").exists()


def test_validate_reports_missing_ray(tmp_path, tiny_model, prompts, monkeypatch):
    from click.testing import CliRunner

    from pipeline.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_model, prompts, tmp_path / "out")), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2
    assert "executor: ray needs Ray Data" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_stop_during_a_units_commit_waits_for_its_counting():
    """A SIGTERM that arrives while a unit is committed and counted (``_Signals.holding``) stops the run
    after that step, so the run record never misses rows the manifest already has."""
    import os
    import signal as sig

    from pipeline.run.control import Aborted, _Signals

    said, counted = [], []
    with _Signals(said.append, "units") as signals:
        with pytest.raises(Aborted, match="SIGTERM"):
            with signals.holding():
                os.kill(os.getpid(), sig.SIGTERM)  # delivered here, at the next bytecode
                counted.append("committed")
                counted.append("counted")
        assert counted == ["committed", "counted"] and signals.first == "SIGTERM"
        with pytest.raises(Aborted, match="SIGINT"):  # outside a hold: at once
            os.kill(os.getpid(), sig.SIGINT)
            counted.append("never")
    assert "never" not in counted and len(said) == 2
