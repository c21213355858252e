"""Crash safety through the real CLI in subprocesses, on a tiny random-weight model: SIGKILL at random
moments, SIGINT / SIGTERM mid-run, and resume each time, compared row for row with an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from tiny_model import wait_until, write_prompts

ROWS = 60
SHARD = 4
N_KILLS = 6
# Every column that must not depend on interruptions; the timing and memory columns are left out.
COMPARED = ["id", "sample_index", "prompt", "completion", "finish_reason", "stop_reason", "stop_token_id",
            "completion_tokens", "prompt_tokens", "seed", "error"]


pytestmark = pytest.mark.usefixtures("tiny_home")  # the tiny model and a temporary $PIPELINE_HOME (conftest)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet", ROWS)


def write_job(tmp: Path, model: Path, prompts: Path, n: int, batch_size: int = 1) -> Path:
    job = {
        "model": str(model),
        "input": {"path": str(prompts), "id_column": "id", "prompt_column": "prompt",
                  "limit": ROWS // n},  # ROWS output rows either way
        "generation": {"max_tokens": 16, "temperature": 0.8, "seed": 1234, "n": n},
        "output": {"dir": str(tmp / "unused"), "shard_size": SHARD},
        "engine": {"batch_size": batch_size},
    }
    path = tmp / f"job-n{n}-b{batch_size}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def start(job: Path, out: Path) -> subprocess.Popen:
    """``pipeline run`` on ``job`` into ``out``: the same command every time."""
    return subprocess.Popen(["pipeline", "run", str(job), "--output-dir", str(out), "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"pipeline run exited {proc.returncode}:\n{stdout}\n{stderr[-3000:]}"
    return stdout, stderr


def manifest_rows(out: Path) -> int:
    """Rows the manifest lists as committed (0 before the first manifest exists)."""
    try:
        return json.loads((out / "manifest.json").read_text())["rows"]
    except FileNotFoundError:
        return 0


def committed(out: Path) -> list[dict]:
    """The committed rows (COMPARED columns), read shard by shard as the manifest lists them.

    Asserts that every listed shard is readable and holds the row count the manifest records, and
    that no (id, sample_index) appears twice.
    """
    path = out / "manifest.json"
    if not path.exists():
        return []
    manifest = json.loads(path.read_text())
    rows = []
    for s in manifest["shards"]:
        table = pq.read_table(out / s["file"])
        assert table.num_rows == s["rows"], s
        rows += table.select(COMPARED).to_pylist()
    assert sum(s["rows"] for s in manifest["shards"]) == manifest["rows"]
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicate (id, sample_index) among committed rows"
    return rows


def by_key(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["id"], r["sample_index"]): r for r in rows}


@dataclass
class Reference:
    rows: dict[tuple, dict]
    startup_s: float  # process start to the first generated row: imports, model load, compile
    row_s: float  # seconds per output row


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, prompts):
    """``reference(n, batch_size)``: the job file with ``n`` samples per row decoded ``batch_size`` rows at
    a time, and its uninterrupted run (once per pair)."""
    done = {}

    def get(n: int, batch_size: int = 1) -> tuple[Path, Reference]:
        if (n, batch_size) not in done:
            done[n, batch_size] = _reference_run(tmp_path_factory.mktemp(f"reference-n{n}-b{batch_size}"),
                                                 tiny_model, prompts, n, batch_size)
        return done[n, batch_size]

    return get


def _reference_run(tmp: Path, model: Path, prompts: Path, n: int, batch_size: int) -> tuple[Path, Reference]:
    job = write_job(tmp, model, prompts, n, batch_size)
    t0 = time.monotonic()
    stdout, _ = finish(start(job, tmp / "out"))
    wall = time.monotonic() - t0
    m = re.search(r" in ([0-9.]+) s,", stdout)
    gen_s = float(m.group(1)) if m else 0.7 * wall
    rows = committed(tmp / "out")
    ids = [f"row-{i:02d}" for i in range(ROWS // n)]
    assert sorted(by_key(rows)) == sorted((i, k) for i in ids for k in range(n))
    assert all(r["error"] is None and r["completion_tokens"] >= 1 for r in rows)
    if n == 2:  # the samples of a row have their own seeds, so they differ (random weights, temperature 0.8)
        ref = by_key(rows)
        assert sum(ref[(i, 0)]["completion"] != ref[(i, 1)]["completion"] for i in ids) >= len(ids) - 1
    return job, Reference(by_key(rows), startup_s=wall - gen_s, row_s=gen_s / ROWS)


def assert_consistent(out: Path, ref: Reference) -> int:
    """Committed rows are valid and equal the reference's; returns how many there are."""
    rows = committed(out)
    for r in rows:
        assert r == ref.rows[(r["id"], r["sample_index"])]
    return len(rows)


def assert_final(out: Path, ref: Reference) -> None:
    rows = committed(out)
    assert len(rows) == len(ref.rows)
    assert by_key(rows) == ref.rows
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    listed = {s["file"] for s in manifest["shards"]}
    assert {p.name for p in out.glob("part-*.parquet")} == listed, "shard files not listed in the manifest"


def plant_crash_leftovers(out: Path) -> None:
    """Add what a kill inside a commit can leave besides what the random kills happened to leave: a
    temporary file of an unfinished atomic write, and a truncated shard under the name the next commit
    will use, renamed into place but not yet listed in the manifest. Neither may be read as results."""
    manifest = json.loads((out / "manifest.json").read_text())
    data = (out / manifest["shards"][0]["file"]).read_bytes()
    (out / f".part-99999.parquet.{os.getpid()}.tmp").write_bytes(data[: len(data) // 3])
    name = f"part-{manifest.get('next_shard', len(manifest['shards'])):05d}.parquet"
    assert name not in {s["file"] for s in manifest["shards"]}
    (out / name).write_bytes(data[: len(data) // 2])




@pytest.mark.parametrize("n, batch_size", [(1, 1), (2, 1), (1, 4)], ids=["n1", "n2", "n1-batched"])
def test_sigkill_at_random_moments_then_resume_equals_uninterrupted_run(reference, tmp_path, n, batch_size):
    """SIGKILL N_KILLS times at moments drawn from a seeded RNG, resuming with the same command each time.

    Even-numbered kills land at a random moment of the run (startup included), a fraction of the
    run's expected duration (measured by the reference run, for the rows still pending). Odd-numbered
    kills land a random time after this run committed its first shard, so they hit mid-run with
    finished rows not yet committed. A run is killed early anyway once fewer than (kills to come + 1)
    shards of work are left, so no run completes the job. Before the final run, the leftovers of a kill
    inside a commit are added (``plant_crash_leftovers``). With n=2 the samples of a row, keyed
    (id, 0) and (id, 1), may land in different shards and runs. With ``engine.batch_size: 4`` rows finish
    out of input order and each resumed run batches a different set of rows together, so this also
    checks that a row's tokens do not depend on its neighbours.
    """
    job, ref = reference(n, batch_size)
    total = len(ref.rows)
    rng = random.Random(20240611)
    out = tmp_path / "out"
    kills = []
    for i in range(N_KILLS):
        before = manifest_rows(out)
        reserve = total - SHARD * (N_KILLS - i + 1)

        def enough():  # leave work for the kills still to come
            return manifest_rows(out) >= reserve

        proc = start(job, out)
        t0 = time.monotonic()
        if i % 2 == 0:
            delay = rng.uniform(0.0, 0.7) * (ref.startup_s + (total - before) * ref.row_s)
            wait_until(lambda: time.monotonic() - t0 >= delay or enough(), proc)
        else:
            wait_until(lambda: manifest_rows(out) > before, proc)
            t1, delay = time.monotonic(), rng.uniform(0.0, 2 * SHARD * ref.row_s)
            wait_until(lambda: time.monotonic() - t1 >= delay or enough(), proc)
        at = time.monotonic() - t0
        proc.kill()
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        after = assert_consistent(out, ref)
        assert after >= before
        kills.append({"at_s": round(at, 3), "committed_before": before, "committed_after": after})

    print("kills:", kills)
    assert len(kills) >= 5
    assert sum(k["committed_after"] > k["committed_before"] for k in kills) >= N_KILLS // 2, kills
    assert kills[-1]["committed_after"] < total, "the job was complete before the last kill"
    plant_crash_leftovers(out)
    stdout, _ = finish(start(job, out))
    assert f"{kills[-1]['committed_after']} from earlier runs" in stdout
    assert_final(out, ref)


@pytest.mark.parametrize("sig, code, batch_size", [(signal.SIGINT, 130, 1), (signal.SIGTERM, 143, 1),
                                                   (signal.SIGINT, 130, 4)], ids=["SIGINT", "SIGTERM", "SIGINT-batched"])
def test_signal_mid_run_commits_and_exits_then_resume_completes(reference, tmp_path, sig, code, batch_size):
    job, ref = reference(1, batch_size)
    rng = random.Random(int(sig))
    out = tmp_path / "out"
    proc = start(job, out)
    wait_until(lambda: manifest_rows(out) > 0, proc)
    time.sleep(rng.uniform(0.0, 2 * SHARD * ref.row_s))
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, f"{stdout}\n{stderr[-3000:]}"
    assert "run the same command again to resume" in stdout
    n_committed = assert_consistent(out, ref)
    assert f"{n_committed}/{len(ref.rows)} rows committed" in stdout
    assert SHARD <= n_committed < len(ref.rows)
    assert not list(out.glob(".*.tmp")), "a graceful stop left temporary files"
    stdout, _ = finish(start(job, out))
    assert f"{n_committed} from earlier runs" in stdout
    assert_final(out, ref)
