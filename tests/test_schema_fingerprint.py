"""The shard schema is part of a job's fingerprint (``results.schema_digest``, ``run.plan.fingerprint``): a changed
column refuses to resume an output dir written with the old one, with no version to bump; the id column's
type (the input's) is left out; the schema of output dirs written before the fingerprint held it is recorded
as none, so they resume."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline  # noqa: F401  (OpenBLAS before tiny_model imports mlx.core, as in `pipeline run`)

# isort: split
from tiny_model import write_tiny_model

from pipeline import results
from pipeline.jobspec import job_from_dict
from pipeline.run import fingerprint, run_job
from pipeline.run.plan import UNRECORDED_SCHEMA
from pipeline.shards import OutputError
from pipeline.status import job_status

# The output columns of pipeline 0.2.0 (batch_size was its last new column), as its shards hold them.
SCHEMA_0_2_0 = [
    ("id", pa.string(), False), ("sample_index", pa.int32(), False), ("prompt", pa.string(), True),
    ("completion", pa.string(), True), ("finish_reason", pa.string(), True), ("stop_reason", pa.string(), True),
    ("stop_token_id", pa.int64(), True), ("prompt_tokens", pa.int32(), True), ("completion_tokens", pa.int32(), True),
    ("ttft_s", pa.float64(), True), ("prefill_tps", pa.float64(), True), ("decode_tps", pa.float64(), True),
    ("total_s", pa.float64(), True), ("peak_memory_bytes", pa.int64(), True), ("compiled", pa.bool_(), True),
    ("seed", pa.int64(), False), ("error", pa.string(), True), ("logprobs", pa.list_(pa.float32()), True),
    ("top_token_ids", pa.list_(pa.list_(pa.int32())), True), ("top_logprobs", pa.list_(pa.list_(pa.float32())), True),
    ("batch_size", pa.int32(), True),
]


def _schema(fields) -> pa.Schema:
    return pa.schema([pa.field(name, t, nullable=null) for name, t, null in fields])


def test_the_digest_follows_columns_not_the_id_type():
    assert results.schema_digest() == results.schema_digest(results.result_schema(pa.int64()))
    assert results.schema_digest() == results.schema_digest(results.result_schema(pa.string()))
    assert results.schema_digest(_schema(SCHEMA_0_2_0)) == UNRECORDED_SCHEMA  # what the constant says it is
    for i, (name, t, null) in enumerate(SCHEMA_0_2_0[1:], 1):  # each column's type, nullability, presence
        for changed in ([*SCHEMA_0_2_0[:i], (name, pa.large_string(), null), *SCHEMA_0_2_0[i + 1:]],
                        [*SCHEMA_0_2_0[:i], (name, t, not null), *SCHEMA_0_2_0[i + 1:]],
                        SCHEMA_0_2_0[:i] + SCHEMA_0_2_0[i + 1:]):
            assert results.schema_digest(_schema(changed)) != UNRECORDED_SCHEMA, (name, changed[i:i + 1])


def test_fingerprints_record_a_schema_other_than_the_unrecorded_one(monkeypatch):
    job = job_from_dict({"input": {"path": "x"}, "output": {"dir": "o"}})
    assert ("schema" in fingerprint(job, {"sha256": "x"})) == (results.schema_digest() != UNRECORDED_SCHEMA)
    monkeypatch.setitem(results._TYPES, "batch_size", pa.int64())
    assert fingerprint(job, {"sha256": "x"})["schema"] == results.schema_digest() != UNRECORDED_SCHEMA


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_a_changed_column_refuses_to_resume_an_old_output_dir(tiny, tmp_path, monkeypatch):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "prompt": [f"Say {i} words." for i in range(4)]}), data)
    spec = job_from_dict({"model": str(tiny), "input": {"path": str(data), "id_column": "id"},
                          "generation": {"max_tokens": 4}, "output": {"dir": str(tmp_path / "out"), "shard_size": 2}})
    out: Path = tmp_path / "out"
    quiet = {"progress": False, "echo": lambda _: None}
    assert run_job(spec, limit=2, **quiet).rows_written == 2
    recorded = json.loads((out / "manifest.json").read_text())["fingerprint"]
    assert ("schema" in recorded) == (results.schema_digest() != UNRECORDED_SCHEMA)

    with monkeypatch.context() as mp:  # a later version whose batch_size column is int64
        mp.setitem(results._TYPES, "batch_size", pa.int64())
        with pytest.raises(OutputError) as e:
            run_job(spec, **quiet)
        assert "(changed: schema);" in str(e.value)
        assert job_status(out)["rows_done"] == 2  # status still reads it
    assert run_job(spec, **quiet).rows_written == 2  # the schema it was written with: resumes
    assert job_status(out)["complete"] is True
