"""Resume policy through the real CLI on a tiny random-weight model: flush_seconds, --retry-failed,
rows added or removed later, leftovers of a crash, a damaged committed shard, --force, a second
Ctrl-C, input.truncate and ``pipeline status``."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from test_job_end_to_end import read_output, run_cli
from tiny_model import write_tiny_model

PROMPTS = ["Say one word.", "Count to three.", "Name a color.", "What is 2+2?", "Spell cat.", "Hello!"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def write_input(path: Path, prompts: list, ids: list | None = None) -> Path:
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string())}), path)
    return path


def write_job(tmp: Path, model: Path, data: Path, name="out", input_extra=None, output_extra=None, **generation):
    job = {
        "model": str(model),
        "input": {"path": str(data), "id_column": "id", "prompt_column": "prompt", **(input_extra or {})},
        "generation": {"max_tokens": 6, "temperature": 0.7, "seed": 3, **generation},
        "output": {"dir": str(tmp / name), "shard_size": 3, **(output_extra or {})},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def keys(out: Path) -> list[tuple]:
    t = read_output(out)
    return sorted(zip(t.column("id").to_pylist(), t.column("sample_index").to_pylist()))


@pytest.mark.parametrize("flush_seconds, shard_rows", [(3600, [3, 3]), (1e-6, [1] * 6)])
def test_shards_flush_at_shard_size_or_flush_seconds(tiny, tmp_path, flush_seconds, shard_rows):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    run_cli("run", str(write_job(tmp_path, tiny, data, output_extra={"flush_seconds": flush_seconds})), "--no-progress")
    assert [s["rows"] for s in manifest(tmp_path / "out")["shards"]] == shard_rows


def test_retry_failed_replaces_only_failed_rows(tiny, tmp_path):
    bad = PROMPTS[:2] + [""] + PROMPTS[3:]
    data = write_input(tmp_path / "in.parquet", bad)
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    proc = run_cli("run", str(job), "--no-progress", expect=3)
    assert "1 row(s) failed" in proc.stderr
    before = {r["id"]: r for r in read_output(out).to_pylist()}
    assert before["r2"]["error"] == "prompt is empty"
    write_input(data, PROMPTS)  # the user fixes the data
    proc = run_cli("run", str(job), "--no-progress", expect=3)
    assert "nothing to do" in proc.stdout and "input files changed" in proc.stdout
    first_shard = out / manifest(out)["shards"][0]["file"]
    proc = run_cli("run", str(job), "--no-progress", "--retry-failed")
    assert "done: 1 row written (0 failed, 5 from earlier runs)" in proc.stdout
    after = {r["id"]: r for r in read_output(out).to_pylist()}
    assert keys(out) == [(f"r{i}", 0) for i in range(6)]
    assert after["r2"]["error"] is None and after["r2"]["completion"]
    assert all(after[i] == before[i] for i in before if i != "r2")
    assert not first_shard.exists()  # the shard that held the failed row was rewritten without it
    assert manifest(out)["rows"] == 6 and manifest(out)["complete"] is True


def test_rows_added_later_are_generated_and_removed_rows_reported(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS[:4])
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress")
    first = {r["id"]: r["completion"] for r in read_output(out).to_pylist()}
    write_input(data, PROMPTS[1:], ids=[f"r{i}" for i in range(1, 6)])  # r0 removed, r4 and r5 added
    proc = run_cli("run", str(job), "--no-progress")
    assert "done: 2 rows written (0 failed, 3 from earlier runs)" in proc.stdout
    assert "1 committed row(s) are no longer in the input (kept in the output): ids r0" in proc.stdout
    rows = {r["id"]: r["completion"] for r in read_output(out).to_pylist()}
    assert sorted(rows) == [f"r{i}" for i in range(6)]
    assert all(rows[i] == first[i] for i in first)


def test_leftovers_of_a_crash_are_removed_and_reported(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress", "--limit", "3")
    (out / "part-00007.parquet").write_bytes(b"PAR1 truncated")  # renamed but never committed
    (out / ".part-00001.parquet.x1y2.tmp").write_bytes(b"half a shard")
    proc = run_cli("run", str(job), "--no-progress")
    assert "removed 1 uncommitted shard file(s) left by an interrupted run (part-00007.parquet)" in proc.stdout
    assert "removed 1 leftover temporary file(s)" in proc.stdout
    assert not (out / "part-00007.parquet").exists() and not list(out.glob(".*.tmp"))
    assert keys(out) == [(f"r{i}", 0) for i in range(6)]
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [s["file"] for s in manifest(out)["shards"]]


def test_damaged_committed_shard_is_refused(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress", "--limit", "3")
    shard = out / manifest(out)["shards"][0]["file"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    proc = run_cli("run", str(job), "--no-progress", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {shard}: committed shard has {size - 10} bytes, the manifest says {size}; "
                                   "it was changed after commit")


def test_force_continues_and_is_recorded(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    out = tmp_path / "out"
    run_cli("run", str(write_job(tmp_path, tiny, data)), "--no-progress", "--limit", "3")
    changed = write_job(tmp_path, tiny, data, temperature=0.9)
    proc = run_cli("run", str(changed), "--no-progress", check=False)
    assert proc.returncode == 2 and "changed: generation.temperature" in proc.stderr
    run_cli("run", str(changed), "--no-progress", "--force")
    m = manifest(out)
    assert m["forced"][0]["changed"] == ["generation.temperature"]
    assert m["fingerprint"]["generation"]["temperature"] == 0.9 and m["rows"] == 6


def test_second_ctrl_c_aborts_at_once_without_corrupting(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS * 5, ids=[f"r{i:02d}" for i in range(30)])
    # long rows (ignore_eos, 400 tokens) so the second Ctrl-C lands while the row in flight still runs
    job = write_job(tmp_path, tiny, data, max_tokens=400, ignore_eos=True, output_extra={"shard_size": 1})
    out = tmp_path / "out"
    proc = subprocess.Popen(["pipeline", "run", str(job), "--no-progress"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ((out / "manifest.json").exists() and manifest(out)["shards"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "press Ctrl-C again to stop at once" in stderr
    assert stdout.startswith("aborted (SIGINT): ") and "run the same command again to resume" in stdout
    m = manifest(out)
    assert 1 <= m["rows"] < 30 and m["runs"][-1]["aborted"] is True
    assert len(keys(out)) == m["rows"]  # every listed shard reads back
    run_cli("run", str(job), "--no-progress")
    assert keys(out) == [(f"r{i:02d}", 0) for i in range(30)]


@pytest.mark.parametrize("policy", ["error", "left", "right"])
def test_prompt_longer_than_context_follows_input_truncate(tiny, tmp_path, policy):
    long = " ".join(f"w{i}" for i in range(600))  # > 512 positions of the tiny model
    data = write_input(tmp_path / "in.parquet", [long, "short prompt"])
    job = write_job(tmp_path, tiny, data, input_extra={"truncate": policy, "apply_chat_template": False},
                    max_tokens=3)
    run_cli("run", str(job), "--no-progress", expect=3 if policy == "error" else 0)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows["r1"]["error"] is None
    if policy == "error":
        assert rows["r0"]["error"].startswith("prompt has ") and \
            rows["r0"]["error"].endswith("tokens; the model's context is 512 (input.truncate: left or right cuts it to fit)")
    else:
        assert rows["r0"]["error"] is None and rows["r0"]["prompt_tokens"] == 511
        assert rows["r0"]["completion_tokens"] == 1  # the one position left


def test_status_reports_progress(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    job = write_job(tmp_path, tiny, data, n=2)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress", "--limit", "2")
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    table = read_output(out)
    assert (st["rows_done"], st["rows_pending"], st["rows_failed"]) == (4, 8, 0)
    assert st["completion_tokens"] == sum(table.column("completion_tokens").to_pylist())
    assert st["eta_s"] > 0 and st["throughput_tps"] > 0 and st["runs"] == 1 and st["complete"] is False
    assert "temperature=0.7" in st["fingerprint"] and "n=2" in st["fingerprint"]
    text = run_cli("status", str(out)).stdout
    assert "rows: 4 done (0 failed), 8 pending" in text
    run_cli("run", str(job), "--no-progress")
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert (st["rows_done"], st["rows_pending"], st["complete"], st["runs"]) == (12, 0, True, 2)
    proc = run_cli("status", str(tmp_path / "nothing"), check=False)
    assert proc.returncode == 2 and "no manifest.json" in proc.stderr
