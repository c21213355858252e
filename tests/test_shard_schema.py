"""Every shard carries the full explicit schema, so a shard of failed rows only (nearly every column
null) reads back together with normal shards in pyarrow.dataset, pandas, datasets and duckdb, none of
which we wrote. The output comes from a real ``pipeline run`` on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from pipeline.results import result_schema
from tiny_model import write_tiny_model

SHARD = 2
# Rows 0 and 1 (shard 0, the one every reader sees first) have null prompts, so that shard holds only
# failed rows: null in every column but id, sample_index, total_s, seed and error.
IDS = ["a", "b", "c", "d", "e", "f"]
PROMPTS = [None, None, "Hello there", "Name a colour", "Count to three", "Say hi"]
FAILED = {"a", "b"}
TOP_K = 2
MAX_TOKENS = 3
# Columns that are null in a failed row.
NULL_WHEN_FAILED = ["prompt", "completion", "finish_reason", "stop_reason", "stop_token_id", "prompt_tokens",
                    "completion_tokens", "ttft_s", "prefill_tps", "decode_tps", "peak_memory_bytes", "compiled",
                    "logprobs", "top_token_ids", "top_logprobs"]


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    """The output dir of a real run, and its shard files in manifest order."""
    tmp = tmp_path_factory.mktemp("schema")
    pq.write_table(pa.table({"id": IDS, "prompt": pa.array(PROMPTS, pa.string())}), tmp / "prompts.parquet")
    out = tmp / "out"
    job = {
        "model": str(write_tiny_model(tmp / "model")),
        "input": {"path": str(tmp / "prompts.parquet"), "id_column": "id"},
        # logprobs: the list columns hold values in normal rows and nulls in failed ones
        "generation": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": TOP_K},
        "output": {"dir": str(out), "shard_size": SHARD},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    env = {**os.environ, "PIPELINE_HOME": str(tmp / "pipeline-home")}  # its model-hash cache
    proc = subprocess.run(["pipeline", "run", str(tmp / "job.yaml"), "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    # issue 6: exit code 3 when some rows failed
    assert proc.returncode == 3, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    manifest = json.loads((out / "manifest.json").read_text())
    files = [out / s["file"] for s in manifest["shards"]]
    assert [s["rows"] for s in manifest["shards"]] == [SHARD] * (len(IDS) // SHARD)
    return out, files


def check_rows(rows: list[dict]) -> None:
    """The rows read back by some reader: every id once, failed rows null where they should be, normal
    rows with completions and per-token logprobs."""
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == len(by_id) and sorted(by_id) == IDS
    for i, r in by_id.items():
        if i in FAILED:
            assert r["error"] == "input column 'prompt' is null", r
            for c in NULL_WHEN_FAILED:
                assert r[c] is None, (c, r)
        else:
            assert r["error"] is None and isinstance(r["completion"], str), r
            assert 1 <= r["completion_tokens"] <= MAX_TOKENS and r["finish_reason"] in ("stop", "length")
            assert len(r["logprobs"]) == len(r["top_token_ids"]) == len(r["top_logprobs"]) == r["completion_tokens"]
            assert all(len(top) == TOP_K for top in r["top_token_ids"] + r["top_logprobs"])
            assert all(isinstance(x, float) for x in r["logprobs"])
        assert isinstance(r["seed"], int) and r["sample_index"] == 0


def test_first_shard_holds_only_failed_rows(output):
    _, files = output
    first = pq.read_table(files[0])
    assert sorted(first.column("id").to_pylist()) == sorted(FAILED)
    for c in NULL_WHEN_FAILED:
        assert first.column(c).null_count == first.num_rows, c


def test_every_shard_has_the_full_explicit_schema(output):
    _, files = output
    expected = result_schema(pa.string())
    for f in files:
        schema = pq.read_schema(f).remove_metadata()
        assert schema.equals(expected), f"{f.name}:\n{schema}"
        assert not [x.name for x in schema if pa.types.is_null(x.type)]


def test_pyarrow_dataset_reads_all_shards(output):
    _, files = output
    dataset = pads.dataset([str(f) for f in files], format="parquet")  # schema from the first (all-null) shard
    table = dataset.to_table()
    assert table.schema.remove_metadata().equals(result_schema(pa.string()))
    check_rows(table.to_pylist())


def test_pyarrow_reads_the_directory_as_documented(output):
    out, _ = output
    check_rows(pq.read_table(out, ignore_prefixes=[".", "manifest"]).to_pylist())


def _pandas_rows(df) -> list[dict]:
    """pandas rows with its missing-value markers (NaN, NA, NaT) as None and numpy arrays as lists."""
    import numpy as np
    import pandas as pd

    def plain(v):
        if isinstance(v, np.ndarray):
            return [plain(x) for x in v]
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if v is None or (np.isscalar(v) and pd.isna(v)) or v is pd.NA:
            return None
        return v.item() if isinstance(v, np.generic) else v

    return [{k: plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def test_pandas_reads_files_and_directory(output):
    pd = pytest.importorskip("pandas")
    out, files = output
    check_rows(_pandas_rows(pd.read_parquet([str(f) for f in files])))
    check_rows(_pandas_rows(pd.read_parquet(out, ignore_prefixes=[".", "manifest"])))
    df = pd.read_parquet([str(f) for f in files], dtype_backend="pyarrow")
    assert str(df["completion_tokens"].dtype) == "int32[pyarrow]" and str(df["compiled"].dtype) == "bool[pyarrow]"


def test_datasets_load_dataset_reads_all_shards(output, tmp_path):
    from datasets import load_dataset

    _, files = output
    ds = load_dataset("parquet", data_files=[str(f) for f in files], split="train", cache_dir=str(tmp_path))
    assert ds.features["completion_tokens"].dtype == "int32" and ds.features["completion"].dtype == "string"
    assert ds.features["logprobs"].feature.dtype == "float32"
    check_rows(ds.to_list())


def test_duckdb_reads_all_shards(output):
    duckdb = pytest.importorskip("duckdb")
    _, files = output
    con = duckdb.connect()
    cur = con.execute("SELECT * FROM read_parquet(?)", [[str(f) for f in files]])
    names = [d[0] for d in cur.description]
    check_rows([dict(zip(names, row)) for row in cur.fetchall()])
    types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM read_parquet(?))",
                             [[str(f) for f in files]]).fetchall())
    assert types["completion_tokens"] == "INTEGER" and types["logprobs"] == "FLOAT[]"
