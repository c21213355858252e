"""Readers of an output directory (status, export, report, and the store that a run opens) against what a
running job does to it, and against manifests and shards damaged by hand: real Parquet shards committed by
``ShardStore`` (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_job_end_to_end import run_cli
from test_shard_integrity import data_page_end, flip

from pipeline import export, status
from pipeline.shards import OutputError, ShardStore, read_manifest

FP = {"model": {"spec": "m"}, "generation": {"max_tokens": 4}}


def rows(ids: list[str], errors: list[str | None] | None = None) -> pa.Table:
    n = len(ids)
    return pa.table({"id": ids, "sample_index": [0] * n, "completion": [f"text of {i}" for i in ids],
                     "error": pa.array(errors or [None] * n, pa.string()), "completion_tokens": [3] * n, "prompt_tokens": [5] * n,
                     "cached_prompt_tokens": [0] * n, "total_s": [0.1] * n, "decode_tps": [30.0] * n})


@pytest.fixture
def out(tmp_path) -> Path:
    """Two shards of run 1: part-00000 (a, b; b failed) and part-00001 (c)."""
    store = ShardStore(tmp_path / "out", FP)
    store.add_run({"started": "then"})
    store.commit(rows(["a", "b"], [None, "boom"]))
    store.commit(rows(["c"]))
    return tmp_path / "out"


def retry_b(out: Path) -> None:
    """What ``run --retry-failed`` commits for row b: b's new row (part-00002) and part-00000 rewritten without
    it (part-00003), in one manifest replacement; then part-00000 is deleted."""
    store = ShardStore(out, FP)
    store.add_run({"started": "now", "retry_failed": True})
    store.commit(rows(["b"]), replaces={("b", 0)})


def commit_once_first(monkeypatch, module, name: str, out: Path) -> list:
    """Make ``module.name`` commit ``retry_b`` right before its first call: a reader that read the manifest
    before that commit then meets the deleted part-00000. Returns the list of calls made."""
    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        if not calls:
            retry_b(out)
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_status_reads_the_new_manifest_when_a_retry_commits_during_the_read(out, monkeypatch):
    calls = commit_once_first(monkeypatch, status, "check_shards", out)
    st = status.job_status(out)
    assert len(calls) == 2  # the first manifest's shards (part-00000 gone), then the new manifest's
    assert (st["rows_done"], st["rows_failed"], st["shards"]) == (3, 0, 3)


def test_export_reads_the_new_manifest_when_a_retry_commits_during_the_read(out, monkeypatch):
    calls = commit_once_first(monkeypatch, export, "read_shard_verified", out)
    manifest, table = export.read_committed(out)
    assert [s["file"] for s in manifest["shards"]] == ["part-00003.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert sorted(table.column("id").to_pylist()) == ["a", "b", "c"]
    assert table.column("error").null_count == 3
    assert len(calls) == 1 + 3


def test_a_shard_missing_from_an_unchanged_manifest_is_still_an_error(out):
    (out / "part-00001.parquet").unlink()
    with pytest.raises(OutputError, match="part-00001.parquet: committed shard is missing"):
        status.job_status(out)
    with pytest.raises(OutputError, match="part-00001.parquet: committed shard is missing"):
        export.read_committed(out)


def test_a_shard_rewritten_by_a_retry_is_hashed_when_the_store_opens(out):
    retry_b(out)
    m = read_manifest(out)
    rewritten = next(s for s in m["shards"] if s["file"] == "part-00003.parquet")
    assert (rewritten["run"], rewritten["rewritten"]) == (1, 2)  # its rows by run 1, its file by run 2
    shard = out / "part-00003.parquet"
    flip(shard, data_page_end(shard) - 2)  # same size, footer intact: only the sha256 can tell
    with pytest.raises(OutputError, match="part-00003.parquet: committed shard has sha256"):
        ShardStore(out, FP)


def test_status_names_a_shard_damaged_in_the_prefix_columns(out):
    shard = out / "part-00000.parquet"
    flip(shard, data_page_end(shard, "cached_prompt_tokens") - 6, n=6)
    with pytest.raises(OutputError, match=r"part-00000.parquet: committed shard is not readable as Parquet"):
        status.job_status(out)


GARBLED = {
    "entry-without-rows": (lambda m: m["shards"][0].pop("rows"), "shards[0].rows is None, not a row count"),
    "entry-without-file": (lambda m: m["shards"][0].pop("file"), "shards[0].file is None, not a file name"),
    "file-is-a-number": (lambda m: m["shards"][0].update(file=5), "shards[0].file is 5, not a file name"),
    "file-outside-the-dir": (lambda m: m["shards"][0].update(file="../x.parquet"), "not a file name"),
    "entry-is-a-string": (lambda m: m["shards"].__setitem__(0, "part-00000.parquet"), "shards[0] is 'part-00000"),
    "entry-is-null": (lambda m: m["shards"].__setitem__(0, None), "shards[0] is None, not an object"),
    "runs-null": (lambda m: m.update(runs=None), "runs is None, not a list"),
    "fingerprint-null": (lambda m: m.update(fingerprint=None), "fingerprint is None, not an object"),
    "run-is-a-number": (lambda m: m["runs"].__setitem__(0, 1), "runs[0] is 1, not an object"),
}


@pytest.mark.parametrize("garble", GARBLED, ids=list(GARBLED))
def test_a_garbled_manifest_is_one_line_in_every_command(out, tmp_path, garble):
    change, problem = GARBLED[garble]
    m = json.loads((out / "manifest.json").read_text())
    change(m)
    (out / "manifest.json").write_text(json.dumps(m))
    for args in (["status", str(out)], ["export", str(out), "--to", str(tmp_path / "x.parquet")],
                 ["report", str(out)]):
        lines = run_cli(*args, expect=2).stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {out / 'manifest.json'}: unreadable manifest ("), args
        assert problem in lines[0], args
    with pytest.raises(OutputError, match="unreadable manifest"):
        ShardStore(out, FP)
