"""Damaged committed shards through the real CLI on a tiny random-weight model and real Parquet files: a
deleted shard, and same-size byte flips in a data page and in the footer, seen by status / report / validate /
export / run (one clean `error:` line naming the shard, exit 2), and `run --redo-corrupt` regenerating
exactly the rows of the damaged shards while every other committed row stays byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from test_job_end_to_end import run_cli
from tiny_model import write_tiny_model

from pipeline.shards import check_shards, write_shard

ROWS = 6
HINT = "pipeline run JOB --redo-corrupt"
# Columns that regenerating a row must reproduce (per-row seeds); timing and memory columns differ.
COMPARED = ["id", "sample_index", "prompt", "completion", "finish_reason", "stop_reason", "stop_token_id",
            "completion_tokens", "prompt_tokens", "seed", "error"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def write_job(d: Path, model: Path, data: Path) -> Path:
    job = {
        "model": str(model),
        "input": {"path": str(data), "id_column": "id", "prompt_column": "prompt"},
        "generation": {"max_tokens": 3, "temperature": 0.7, "seed": 3},
        "output": {"dir": str(d / "out"), "shard_size": 2},
    }
    path = d / "job.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory) -> Path:
    """A committed output of two runs: part-00000 and part-00001 by run 1 (rows r0-r3), part-00002 by run 2
    (r4, r5); plus its export, ``baseline.parquet``."""
    d = tmp_path_factory.mktemp("base")
    data = d / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(ROWS)],
                             "prompt": [f"Say {i} words about cats." for i in range(ROWS)]}), data)
    job = write_job(d, tiny, data)
    run_cli("run", str(job), "--no-progress", "--limit", "4")
    run_cli("run", str(job), "--no-progress")
    m = manifest(d / "out")
    assert [(s["file"], s["rows"], s["run"]) for s in m["shards"]] == [
        ("part-00000.parquet", 2, 1), ("part-00001.parquet", 2, 1), ("part-00002.parquet", 2, 2)]
    run_cli("export", str(d / "out"), "--to", str(d / "baseline.parquet"))
    return d


@pytest.fixture
def case(base, tiny, tmp_path) -> tuple[Path, Path]:
    """A copy of ``base``'s output dir and a job file writing into it: (job, out)."""
    shutil.copytree(base / "out", tmp_path / "out")
    return write_job(tmp_path, tiny, base / "in.parquet"), tmp_path / "out"


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def flip(path: Path, offset: int, n: int = 2) -> None:
    """Invert ``n`` bytes of ``path`` at ``offset`` (negative: from the end), keeping its size."""
    data = bytearray(path.read_bytes())
    start = offset % len(data)
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    path.write_bytes(bytes(data))


def data_page_end(path: Path, column: str = "completion") -> int:
    """The offset just past the ``column`` chunk of row group 0: the end of its last data page."""
    md = pq.read_metadata(path)
    chunks = [md.row_group(0).column(j) for j in range(md.num_columns)]
    c = next(c for c in chunks if c.path_in_schema == column)
    start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
    return start + c.total_compressed_size


def footer_start(path: Path) -> int:
    """The offset of the Thrift-encoded file metadata (Parquet spec: metadata, 4-byte length, PAR1)."""
    data = path.read_bytes()
    return len(data) - 8 - int.from_bytes(data[-8:-4], "little")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hash_line(out: Path, name: str) -> str:
    recorded = next(s["sha256"] for s in manifest(out)["shards"] if s["file"] == name)
    return (f"error: {out / name}: committed shard has sha256 {sha256(out / name)[:12]}..., the manifest says "
            f"{recorded[:12]}...; it was changed after commit; {HINT} generates its 2 rows again")


def footer_line(out: Path, name: str) -> re.Pattern:
    return re.compile(re.escape(f"error: {out / name}: committed shard has a damaged Parquet footer (") + r".+"
                      + re.escape(f"); it was changed after commit; {HINT} generates its 2 rows again"))


def fails(*args: str) -> str:
    """Run the CLI, expect exit 2 and exactly one stderr line; return it."""
    proc = run_cli(*args, expect=2)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"pipeline {' '.join(args)}:\n{proc.stderr}"
    return lines[0]


def redo_and_compare(base: Path, job: Path, out: Path, damaged: list[str]) -> str:
    """``run --redo-corrupt``: exactly the rows of ``damaged`` are generated again, equal to the baseline's;
    every other shard file is untouched; the final export has every row once. Returns run's stdout."""
    kept = {s["file"]: (out / s["file"]).read_bytes() for s in manifest(out)["shards"] if s["file"] not in damaged}
    redone = sum(s["rows"] for s in manifest(out)["shards"] if s["file"] in damaged)
    proc = run_cli("run", str(job), "--no-progress", "--redo-corrupt")
    assert f"done: {redone} rows written (0 failed, {ROWS - redone} from earlier runs)" in proc.stdout
    m = manifest(out)
    assert [d["file"] for d in m["dropped"]] == damaged and all(d["problem"] and d["dropped"] for d in m["dropped"])
    assert {f: (out / f).read_bytes() for f in kept} == kept
    assert [s["file"] for s in m["shards"]][:len(kept)] == list(kept)
    assert not any((out / f).exists() for f in damaged) and m["rows"] == ROWS and m["complete"] is True
    assert m["runs"][-1]["redo_corrupt"] is True

    run_cli("export", str(out), "--to", str(out.parent / "after.parquet"))
    before, after = pq.read_table(base / "baseline.parquet"), pq.read_table(out.parent / "after.parquet")
    assert after.column("id").to_pylist() == [f"r{i}" for i in range(ROWS)]  # every row exactly once
    assert after.select(COMPARED).to_pylist() == before.select(COMPARED).to_pylist()
    kept_ids = set(pa.concat_tables([pq.read_table(pa.BufferReader(b)) for b in kept.values()])
                   .column("id").to_pylist())
    assert [r for r in after.to_pylist() if r["id"] in kept_ids] == [
        r for r in before.to_pylist() if r["id"] in kept_ids]  # timing columns too: the same bytes
    assert run_cli("status", str(out), "--verify").stdout.endswith(
        f"verified: all {len(m['shards'])} committed shard(s) match their sha256\n")
    run_cli("run", str(job), "--no-progress")  # intact now: nothing to do
    return proc.stdout


def test_a_missing_shard_is_one_clean_line_in_every_command(base, case):
    job, out = case
    (out / "part-00001.parquet").unlink()
    line = (f"error: {out / 'part-00001.parquet'}: committed shard is missing (2 rows); restore it, or {HINT} "
            "generates them again")
    assert fails("status", str(out)) == line
    assert fails("status", str(out), "--verify") == line
    assert fails("report", str(out)) == line
    assert fails("validate", str(job)) == line
    assert fails("export", str(out), "--to", str(out.parent / "x.parquet")) == line
    assert not (out.parent / "x.parquet").exists() and not (out / "report").exists()
    assert fails("run", str(job), "--no-progress") == line
    stdout = redo_and_compare(base, job, out, ["part-00001.parquet"])
    assert ("--redo-corrupt: dropped 1 damaged shard(s) from the manifest (part-00001.parquet is missing); "
            "their 2 rows are generated again") in stdout


def test_a_flip_in_a_data_page_of_the_last_run_is_refused_and_redone(base, case):
    job, out = case
    shard = out / "part-00002.parquet"  # written by run 2, the newest: run hashes it on resume
    size = shard.stat().st_size
    flip(shard, data_page_end(shard) - 3)
    assert shard.stat().st_size == size
    line = hash_line(out, shard.name)
    assert fails("status", str(out), "--verify") == line
    assert fails("export", str(out), "--to", str(out.parent / "x.parquet")) == line
    assert not (out.parent / "x.parquet").exists()
    assert fails("run", str(job), "--no-progress") == line
    redo_and_compare(base, job, out, [shard.name])


def test_a_flip_in_the_footer_of_an_older_shard_is_refused_and_redone(base, case):
    job, out = case
    shard = out / "part-00000.parquet"  # written by run 1: not hashed on resume, its footer is checked
    flip(shard, footer_start(shard), 1)
    assert footer_line(out, shard.name).fullmatch(fails("status", str(out), "--verify"))
    assert fails("export", str(out), "--to", str(out.parent / "x.parquet")) == hash_line(out, shard.name)
    assert footer_line(out, shard.name).fullmatch(fails("run", str(job), "--no-progress"))
    redo_and_compare(base, job, out, [shard.name])


def test_a_flip_in_a_data_page_of_an_older_shard_is_found_by_verify_and_redone(base, case):
    """Resume hashes only the newest run's shards; an older shard's data pages are checked by status --verify,
    export and --redo-corrupt, which hash every shard."""
    job, out = case
    flip(out / "part-00001.parquet", data_page_end(out / "part-00001.parquet") - 3)
    assert "nothing to do" in run_cli("run", str(job), "--no-progress").stdout
    assert fails("status", str(out), "--verify") == hash_line(out, "part-00001.parquet")
    redo_and_compare(base, job, out, ["part-00001.parquet"])


def test_several_damaged_shards_are_one_line_each_and_redone_together(base, case):
    job, out = case
    (out / "part-00000.parquet").unlink()
    flip(out / "part-00002.parquet", data_page_end(out / "part-00002.parquet") - 3)
    proc = run_cli("run", str(job), "--no-progress", expect=2)
    assert proc.stderr.splitlines() == [
        f"error: {out / 'part-00000.parquet'}: committed shard is missing (2 rows); restore it, or {HINT} "
        "generates them again", hash_line(out, "part-00002.parquet")]
    redo_and_compare(base, job, out, ["part-00000.parquet", "part-00002.parquet"])


def test_redo_corrupt_on_an_intact_dir_changes_no_row(case):
    job, out = case
    before = manifest(out)["shards"]
    proc = run_cli("run", str(job), "--no-progress", "--redo-corrupt")
    assert "--redo-corrupt: no damaged shard (3 committed shard(s) match their sha256)" in proc.stdout
    assert "nothing to do" in proc.stdout
    assert manifest(out)["shards"] == before and "dropped" not in manifest(out)


def test_an_old_manifest_without_sha256_or_run_still_works(case):
    """Entries of older manifests record neither sha256 nor run: what cannot be checked is skipped, and
    status --verify says so."""
    job, out = case
    m = manifest(out)
    for s in m["shards"]:
        del s["sha256"], s["run"]
    (out / "manifest.json").write_text(json.dumps(m))
    proc = run_cli("status", str(out), "--verify")
    assert proc.stdout.endswith(
        "verified: 3 (part-00000.parquet, part-00001.parquet, part-00002.parquet) record no sha256 (an older "
        "manifest): only their size and Parquet footer were checked\n")
    assert "nothing to do" in run_cli("run", str(job), "--no-progress").stdout
    proc = run_cli("export", str(out), "--to", str(out.parent / "x.parquet"))
    assert "note: 3 committed shard(s) record no sha256 (an older manifest), so their bytes were not verified" \
        in proc.stderr
    flip(out / "part-00001.parquet", footer_start(out / "part-00001.parquet"), 1)  # the footer check still applies
    assert footer_line(out, "part-00001.parquet").fullmatch(fails("run", str(job), "--no-progress"))


def _shard(tmp_path: Path) -> tuple[Path, dict]:
    entry = write_shard(tmp_path, "part-00000.parquet", pa.table({
        "id": [f"r{i}" for i in range(50)], "sample_index": [0] * 50, "completion": ["some text"] * 50}))
    return tmp_path / entry["file"], entry


@pytest.mark.parametrize("where", ["thrift", "length", "magic", "head"])
def test_the_footer_check_sees_same_size_damage(tmp_path, where):
    path, entry = _shard(tmp_path)
    assert check_shards(tmp_path, [entry]).bad == []
    offset = {"thrift": footer_start(path), "length": -8, "magic": -4, "head": 0}[where]
    flip(path, offset, 1)
    ((bad, problem),) = check_shards(tmp_path, [entry]).bad
    assert bad is entry and problem.startswith("has a damaged Parquet footer (")


def test_a_data_page_flip_passes_the_footer_check_and_fails_the_hash(tmp_path):
    path, entry = _shard(tmp_path)
    flip(path, data_page_end(path) - 3)
    assert check_shards(tmp_path, [entry]).bad == []  # the cheap check reads no data page
    check = check_shards(tmp_path, [entry], digest=lambda e: True)
    assert [p for _, p in check.bad] == [f"has sha256 {sha256(path)[:12]}..., the manifest says "
                                         f"{entry['sha256'][:12]}..."]
