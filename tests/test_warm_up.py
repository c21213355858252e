"""The warm-up generation after a model loads (``LoadedModel.warm_up``) shows no warnings of its own and
leaves the once-per-engine ones to the rows: a tiny random-weight model with ``cache.max_kv_size: 1``,
where every prompt is longer than the attention window."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline  # noqa: F401  (OpenBLAS before tiny_model imports mlx.core, as in `pipeline run`)

# isort: split
from tiny_model import write_tiny_model

from pipeline.engine import GenerateParams
from pipeline.jobspec import job_from_dict
from pipeline.run import load_job_model, run_job

PROMPTS = ["Say one word.", "Say two words about the weather today, please."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def window_job(tiny, tmp):
    data = tmp / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": PROMPTS}), data)
    return job_from_dict({
        "model": str(tiny),
        "input": {"path": str(data), "id_column": "id"},
        "generation": {"max_tokens": 3, "ignore_eos": True},
        "cache": {"max_kv_size": 1},
        "output": {"dir": str(tmp / "out")},
    })


def window_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline" and "max_kv_size" in r.getMessage()]


def expected(n: int) -> str:
    return (f"a prompt of {n} tokens is longer than cache.max_kv_size 1: its first tokens (the system turn, say) "
            "are out of the attention window")


def test_warm_up_is_silent_and_the_first_row_gets_the_warning(tiny, tmp_path, caplog):
    lm = load_job_model(window_job(tiny, tmp_path), tiny)
    with caplog.at_level(logging.WARNING):
        lm.warm_up()
        assert caplog.records == []  # its 8-token prompt is nobody's
        prompt = lm.tokenizer.encode(PROMPTS[1])
        assert len(prompt) != 8
        lm.engine.generate(prompt, GenerateParams(max_tokens=2))
        lm.engine.generate(prompt[:3], GenerateParams(max_tokens=2))  # once per engine
    assert window_warnings(caplog) == [expected(len(prompt))]


def test_run_warns_once_with_the_first_rows_prompt_length(tiny, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        summary = run_job(window_job(tiny, tmp_path), progress=False, echo=lambda m: None)
    assert summary.rows_written == 2
    rows = [r for f in sorted((tmp_path / "out").glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    first = next(r for r in rows if r["id"] == "a")  # rows run in input order
    assert first["prompt_tokens"] != 8 and first["error"] is None
    assert window_warnings(caplog) == [expected(first["prompt_tokens"])]


def test_summary_and_run_record_report_the_warm_up(tiny, tmp_path):
    """The warm-up's seconds are in the summary (and its line) and the run record, kept out of elapsed_s;
    the run record also says the batch size the rows ran with (1: sequential)."""
    import json

    summary = run_job(window_job(tiny, tmp_path), progress=False, echo=lambda m: None)
    run = json.loads((tmp_path / "out" / "manifest.json").read_text())["runs"][-1]
    assert summary.warmup_s is not None and summary.warmup_s > 0 and run["warmup_s"] == summary.warmup_s
    assert f" after a {summary.warmup_s:.1f} s warm-up" in summary.line()
    assert summary.batch_size == run["batch_size"] == 1 and "batch size" not in summary.line()
