"""Prefix caching through ``pipeline run`` (tiny random model, in-process): the ``cached_prompt_tokens`` column,
the hit rate in the summary line, ``pipeline status`` and the run record, ``input.order: prefix`` (same rows,
same export order), rows equal whatever the prefix cache's size (so its size is not in the fingerprint, and a
run resumes across a change of it), and ``prefix_cache_gb: 0`` refused on resume (other prefill chunks)."""

import json

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_job_end_to_end import read_output
from tiny_model import write_tiny_model

from pipeline.jobspec import JobSpecError, job_from_dict
from pipeline.run import run_job
from pipeline.shards import OutputError
from pipeline.status import format_status, job_status

SYSTEM = ("You are a careful grader. Answer each question with one word. " * 6).strip()
QUESTIONS = [f"Question {i}: what is {i} plus {i % 3}?" for i in range(6)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    data = tmp / "in.parquet"
    ids = [f"q{i}" for i in (3, 0, 5, 1, 4, 2)]  # input order is not id order
    pq.write_table(pa.table({"id": ids, "prompt": [QUESTIONS[int(i[1:])] for i in ids]}), data)
    return write_tiny_model(tmp / "tiny"), data


def job(inputs, out, *, n=2, batch_size=1, order="input", **cache):
    model, data = inputs
    return job_from_dict({
        "model": str(model),
        "input": {"path": str(data), "id_column": "id", "system_prompt": SYSTEM, "order": order},
        "generation": {"max_tokens": 5, "n": n, "temperature": 0.8, "seed": 3, "logprobs": 1},
        "engine": {"batch_size": batch_size}, "cache": cache, "output": {"dir": str(out), "shard_size": 4},
    })


def rows(out) -> dict:
    return {(r["id"], r["sample_index"]): r for r in read_output(out).to_pylist()}


def quiet(j, **kw):
    return run_job(j, progress=False, echo=lambda _m: None, **kw)


def test_reuse_is_reported_and_changes_no_row(inputs, tmp_path):
    on = quiet(job(inputs, tmp_path / "on"))
    none_fits = quiet(job(inputs, tmp_path / "tiny", prefix_cache_gb=1e-9))  # no block fits: only n reuses
    a, b = rows(tmp_path / "on"), rows(tmp_path / "tiny")
    assert a.keys() == b.keys() and len(a) == 12
    for k in a:
        assert (a[k]["completion"], a[k]["logprobs"], a[k]["top_logprobs"]) == \
            (b[k]["completion"], b[k]["logprobs"], b[k]["top_logprobs"])
    n_prompt = a[("q3", 0)]["prompt_tokens"]
    assert all(r["prompt_tokens"] == n_prompt for r in a.values())  # one prompt length for every question here
    shared = n_prompt - 20  # the questions differ in their last ~20 tokens
    assert [a[(i, 1)]["cached_prompt_tokens"] for i in ("q3", "q0")] == [n_prompt] * 2  # sample 1: all reused
    assert a[("q3", 0)]["cached_prompt_tokens"] == 0
    assert all(shared - 32 < a[(i, 0)]["cached_prompt_tokens"] <= shared for i in ("q0", "q5", "q1", "q4", "q2"))
    assert all(b[(i, 0)]["cached_prompt_tokens"] == 0 for i in ("q0", "q5"))
    schema = pq.read_schema(next((tmp_path / "on").glob("part-*.parquet")))
    assert schema.field("cached_prompt_tokens").type == pa.int32()

    cached = sum(r["cached_prompt_tokens"] for r in a.values())
    assert (on.cached_prompt_tokens, on.prompt_tokens) == (cached, 12 * n_prompt)
    rate = f"prefix cache hit rate {100 * cached / (12 * n_prompt):.1f}% ({cached} of {12 * n_prompt} prompt tokens)"
    assert rate in on.line() and "prefix cache hit rate" in none_fits.line()
    st = job_status(tmp_path / "on")
    assert (st["cached_prompt_tokens"], st["hit_prompt_tokens"]) == (cached, 12 * n_prompt)
    assert f"prefix cache: {100 * cached / (12 * n_prompt):.1f}% of prompt tokens reused" in format_status(st)
    run = json.loads((tmp_path / "on" / "manifest.json").read_text())["runs"][-1]
    assert (run["prompt_tokens"], run["cached_prompt_tokens"]) == (12 * n_prompt, cached)


def test_prefix_cache_off_reports_nothing_and_is_a_different_job(inputs, tmp_path):
    off = quiet(job(inputs, tmp_path / "off", prefix_cache_gb=0))
    assert "prefix cache" not in off.line()
    assert {r["cached_prompt_tokens"] for r in rows(tmp_path / "off").values()} == {0}
    with pytest.raises(OutputError, match="cache"):
        quiet(job(inputs, tmp_path / "off"))  # prefill chunks differ: not the same job


def test_order_prefix_keeps_rows_and_resumes(inputs, tmp_path):
    quiet(job(inputs, tmp_path / "ref"))
    ref = rows(tmp_path / "ref")
    first = quiet(job(inputs, tmp_path / "sorted", order="prefix"), limit=3)  # a stopped run, then resumed
    assert first.rows_written == 6
    quiet(job(inputs, tmp_path / "sorted", order="prefix", prefix_cache_gb=0.5))  # size not in the fingerprint
    got = rows(tmp_path / "sorted")
    assert got.keys() == ref.keys()
    for k in ref:
        assert (got[k]["completion"], got[k]["logprobs"]) == (ref[k]["completion"], ref[k]["logprobs"])
    from pipeline.export import export_results

    exported = tmp_path / "sorted.parquet"
    export_results(tmp_path / "sorted", str(exported))
    assert pq.read_table(exported).column("id").to_pylist()[::2] == ["q3", "q0", "q5", "q1", "q4", "q2"]


def test_batched_job_reuses_prefixes(inputs, tmp_path):
    s = quiet(job(inputs, tmp_path / "b", batch_size=3, order="prefix"))
    got = rows(tmp_path / "b")
    assert s.cached_prompt_tokens > s.prompt_tokens / 2 and len(got) == 12
    quiet(job(inputs, tmp_path / "b1", batch_size=3, order="prefix", prefix_cache_gb=1e-9))
    alone = rows(tmp_path / "b1")
    for k in got:
        assert (got[k]["completion"], got[k]["logprobs"]) == (alone[k]["completion"], alone[k]["logprobs"])


def test_bad_order_and_prefix_settings_are_refused():
    base = {"model": "m", "input": {"path": "x.parquet"}, "output": {"dir": "o"}}
    with pytest.raises(JobSpecError) as e:
        job_from_dict({**base, "input": {"path": "x.parquet", "order": "length"},
                       "cache": {"prefix_cache_gb": -1, "prefix_block_size": 0}})
    text = str(e.value)
    assert "input.order must be input or prefix" in text and "cache.prefix_cache_gb must be a number >= 0" in text
    assert "cache.prefix_block_size must be in [1, 4096]" in text
