"""The main job end to end on the real default model and the sample prompts, through the real CLI."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT

SAMPLES = ROOT / "data_samples" / "prompts.parquet"
MAX_TOKENS = 8
EMPTY_ID, NULL_ID = "p20", "p21"


def write_job(tmp: Path, out: Path, **generation) -> Path:
    job = {
        "model": "smollm2-135m-instruct",
        "input": {"path": str(SAMPLES), "id_column": "id", "prompt_column": "prompt", "messages_column": "messages"},
        "generation": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0, **generation},
        "output": {"dir": str(out), "shard_size": 4},
    }
    path = tmp / f"job-{out.name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def pipeline_cmd(*args) -> list[str]:
    return ["pipeline", *args]


def run_cli(*args, check=True, expect=0) -> subprocess.CompletedProcess:
    """Run the CLI; with ``check``, fail unless it exits with ``expect`` (3: done, some rows failed)."""
    proc = subprocess.run(pipeline_cmd(*args), capture_output=True, text=True, cwd=ROOT)
    if check and proc.returncode != expect:
        raise AssertionError(f"pipeline {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def read_output(out: Path) -> pa.Table:
    manifest = json.loads((out / "manifest.json").read_text())
    return pa.concat_tables([pq.read_table(out / s["file"]) for s in manifest["shards"]])


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    out = tmp / "out"
    proc = run_cli("run", str(write_job(tmp, out)), "--no-progress", expect=3)  # p20 and p21 fail
    return out, proc


def test_every_input_row_written_once(full_run):
    out, proc = full_run
    table = read_output(out)
    input_ids = pq.read_table(SAMPLES, columns=["id"]).column("id").to_pylist()
    assert sorted(table.column("id").to_pylist()) == sorted(input_ids)
    assert table.column("sample_index").to_pylist() == [0] * len(input_ids)
    assert "done:" in proc.stdout and f"{len(input_ids)} rows written (2 failed" in proc.stdout
    assert "2 row(s) failed" in proc.stderr and "--retry-failed" in proc.stderr


def test_output_schema_is_explicit_and_flat(full_run):
    out, _ = full_run
    schema = read_output(out).schema
    expected = {
        "id": pa.string(), "sample_index": pa.int32(), "prompt": pa.string(), "completion": pa.string(),
        "finish_reason": pa.string(), "stop_reason": pa.string(), "stop_token_id": pa.int64(),
        "prompt_tokens": pa.int32(), "cached_prompt_tokens": pa.int32(), "completion_tokens": pa.int32(),
        "ttft_s": pa.float64(), "prefill_tps": pa.float64(), "decode_tps": pa.float64(), "total_s": pa.float64(),
        "peak_memory_bytes": pa.int64(), "compiled": pa.bool_(), "seed": pa.int64(), "error": pa.string(),
        "logprobs": pa.list_(pa.float32()), "top_token_ids": pa.list_(pa.list_(pa.int32())),
        "top_logprobs": pa.list_(pa.list_(pa.float32())), "batch_size": pa.int32(),
    }
    assert {f.name: f.type for f in schema} == expected


def test_rows_have_completions_or_errors(full_run):
    out, _ = full_run
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert rows[EMPTY_ID]["error"] == "input column 'prompt' is empty and 'messages' is null" and rows[EMPTY_ID]["completion"] is None
    assert rows[NULL_ID]["error"] == "input columns 'prompt' and 'messages' are null" and rows[NULL_ID]["completion"] is None
    valid = [r for i, r in rows.items() if i not in (EMPTY_ID, NULL_ID)]
    for r in valid:
        assert r["error"] is None, r
        assert r["completion"], r
        assert r["finish_reason"] in ("stop", "length")
        assert 1 <= r["completion_tokens"] <= MAX_TOKENS
        assert r["finish_reason"] == "stop" or r["completion_tokens"] == MAX_TOKENS
        assert r["prompt_tokens"] > 0 and r["ttft_s"] > 0 and r["prefill_tps"] > 0 and r["total_s"] >= r["ttft_s"]
        assert r["peak_memory_bytes"] > 0
    # conversations: the prompt column holds the last user turn
    assert rows["p26"]["prompt"] == "And what is 56 divided by 4?"


def test_completion_matches_library_generation(full_run, default_model):
    out, _ = full_run
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    prompt = pq.read_table(SAMPLES).to_pylist()[0]["prompt"]
    assert rows["p00"]["completion"] == default_model.generate(prompt, max_tokens=MAX_TOKENS)


def test_shards_readable_by_datasets(full_run):
    from datasets import load_dataset

    out, _ = full_run
    files = sorted(str(p) for p in out.glob("part-*.parquet"))
    ds = load_dataset("parquet", data_files=files, split="train")
    assert ds.num_rows == pq.read_table(SAMPLES).num_rows
    assert set(ds.column_names) >= {"id", "completion", "finish_reason", "error"}


def test_finished_job_says_so(full_run):
    out, _ = full_run
    before = json.loads((out / "manifest.json").read_text())
    proc = run_cli("run", str(next(out.parent.glob("job-*.yaml"))), "--no-progress", expect=3)
    assert "nothing to do" in proc.stdout
    after = json.loads((out / "manifest.json").read_text())
    assert after["shards"] == before["shards"] and after["complete"] is True


def completions(table: pa.Table) -> dict:
    return {r["id"]: (r["completion"], r["finish_reason"], r["error"], r["seed"]) for r in table.to_pylist()}


def test_resume_after_limit_equals_uninterrupted_run(full_run, tmp_path):
    full_out, _ = full_run
    out = tmp_path / "resumed"
    job = write_job(tmp_path, out)
    run_cli("run", str(job), "--limit", "4", "--no-progress")
    first = json.loads((out / "manifest.json").read_text())
    assert [s["rows"] for s in first["shards"]] == [4] and first["complete"] is True
    run_cli("run", str(job), "--limit", "10", "--no-progress")
    table = read_output(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 10
    reference = completions(read_output(full_out))
    assert completions(table) == {i: reference[i] for i in ids}


def test_changed_settings_refuse_to_resume(full_run, tmp_path):
    full_out, _ = full_run
    job = write_job(tmp_path, full_out, max_tokens=MAX_TOKENS + 1)
    proc = run_cli("run", str(job), "--no-progress", check=False)
    assert proc.returncode == 2
    assert "generation.max_tokens" in proc.stderr and proc.stderr.startswith("error:")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_killed_run_resumes_without_loss_or_duplicates(full_run, tmp_path, sig, code):
    full_out, _ = full_run
    out = tmp_path / "killed"
    job = write_job(tmp_path, out)
    proc = subprocess.Popen(pipeline_cmd("run", str(job), "--no-progress"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text())["shards"]:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, sig)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == code
    if sig == signal.SIGINT:
        assert "run the same command again to resume" in stdout
    partial = read_output(out).column("id").to_pylist()
    assert 4 <= len(partial) < 32 and len(partial) == len(set(partial))
    run_cli("run", str(job), "--no-progress", expect=3)
    table = read_output(out)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 32
    assert completions(table) == completions(read_output(full_out))
    assert not list(out.glob(".*.tmp"))


def test_run_record_has_the_warm_up(full_run):
    """The model is warmed up once before the first row (kernel compilation out of the rows' stats) and
    the run record says how long that took."""
    out, _ = full_run
    run = json.loads((out / "manifest.json").read_text())["runs"][0]
    assert isinstance(run["warmup_s"], float) and 0 < run["warmup_s"] < run["elapsed_s"] + 60
