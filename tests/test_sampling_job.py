"""Sampling through the full ``pipeline run`` path on the real default model: seed reproducibility,
``n`` samples per row, per-row override columns, stop strings and logprob columns."""

import json

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from test_job_end_to_end import SAMPLES, read_output, run_cli

LIMIT, MAX_TOKENS = 3, 8
OPEN_ENDED = ["p07", "p08", "p09"]


def job_file(tmp, name, input_path=SAMPLES, **generation):
    job = {
        "model": "smollm2-135m-instruct",
        "input": {"path": str(input_path), "id_column": "id", "prompt_column": "prompt", "limit": LIMIT},
        "generation": {"max_tokens": MAX_TOKENS, **generation},
        "output": {"dir": str(tmp / name), "shard_size": 4},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def rows_of(out):
    return {(r["id"], r["sample_index"]): r for r in read_output(out).to_pylist()}


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """Three runs at temperature 0.8 with n=3 over three open-ended sample prompts (a poem, a story, a
    list): seed 7 twice, seed 8 once."""
    tmp = tmp_path_factory.mktemp("sampled")
    table = pq.read_table(SAMPLES, columns=["id", "prompt"])
    pq.write_table(table.filter(pa.compute.is_in(table["id"], pa.array(OPEN_ENDED))), tmp / "open.parquet")
    outs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        job = job_file(tmp, name, tmp / "open.parquet", temperature=0.8, top_p=0.95, n=3, seed=seed)
        run_cli("run", str(job), "--no-progress")
        outs[name] = rows_of(tmp / name)
    return outs


def test_same_seed_gives_identical_rows(sampled):
    a, b = sampled["a"], sampled["b"]
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key]["completion"], a[key]["seed"], a[key]["completion_tokens"]) == \
               (b[key]["completion"], b[key]["seed"], b[key]["completion_tokens"])


def test_n_gives_n_distinct_rows_per_input_row(sampled):
    a = sampled["a"]
    ids = OPEN_ENDED
    assert sorted(a) == sorted((i, k) for i in ids for k in range(3))
    for i in ids:
        samples = [a[(i, k)] for k in range(3)]
        assert len({s["seed"] for s in samples}) == 3
        assert len({s["completion"] for s in samples}) == 3, samples


def test_changed_seed_changes_completions(sampled):
    a, c = sampled["a"], sampled["c"]
    assert a.keys() == c.keys()
    assert sum(a[k]["completion"] != c[k]["completion"] for k in a) >= len(a) - 1


def test_row_override_columns(tmp_path):
    table = pa.table({
        "id": ["short", "bad", "two", "stopper", "huge"],
        "prompt": ["Name three colors.", "Say hello.", "Count to five.", "Count from one to ten, separated by commas.",
                   "Say hello."],
        "max_tokens": pa.array([2, None, None, 40, None], pa.int64()),
        "temperature": pa.array([None, -1.0, 0.9, None, 0.9], pa.float64()),
        "n": pa.array([None, None, 2, None, None], pa.int64()),
        "stop": pa.array([None, None, None, ["4", "four"], None], pa.list_(pa.string())),
        "top_k": pa.array([None, None, None, None, 10**19], pa.uint64()),  # past int64: the row fails alone
    })
    data = tmp_path / "overrides.parquet"
    pq.write_table(table, data)
    job = job_file(tmp_path, "out", input_path=data)
    job_dict = yaml.safe_load(job.read_text())
    job_dict["input"]["limit"] = None
    job.write_text(yaml.safe_dump(job_dict))
    proc = run_cli("run", str(job), "--no-progress", check=False)
    rows = rows_of(tmp_path / "out")
    assert proc.returncode == 3, proc.stderr
    assert sorted(rows) == [("bad", 0), ("huge", 0), ("short", 0), ("stopper", 0), ("two", 0), ("two", 1)], proc.stderr
    assert rows[("huge", 0)]["error"] == "input column 'top_k' must be < 2**31, got 10000000000000000000"
    assert rows[("short", 0)]["completion_tokens"] == 2 and rows[("short", 0)]["finish_reason"] == "length"
    assert rows[("bad", 0)]["error"] == "input column 'temperature' must be a finite number >= 0, got -1.0"
    assert rows[("bad", 0)]["completion"] is None
    assert rows[("two", 0)]["completion"] != rows[("two", 1)]["completion"]
    stopper = rows[("stopper", 0)]
    assert stopper["finish_reason"] == "stop" and stopper["stop_reason"] in ("4", "four"), stopper
    assert stopper["stop_reason"] not in stopper["completion"]
    assert stopper["stop_token_id"] is None


def test_logprob_columns(tmp_path):
    run_cli("run", str(job_file(tmp_path, "lp", logprobs=2, stop=["zzz-never"])), "--no-progress")
    for r in rows_of(tmp_path / "lp").values():
        assert len(r["logprobs"]) == r["completion_tokens"] == len(r["top_token_ids"]) == len(r["top_logprobs"])
        assert all(len(t) == 2 for t in r["top_token_ids"])
        assert all(lp <= 0 for lp in r["logprobs"])
        assert all(t[0] >= t[1] for t in r["top_logprobs"])
        assert r["finish_reason"] == "length" or r["stop_token_id"] is not None
    manifest = json.loads((tmp_path / "lp" / "manifest.json").read_text())
    assert manifest["info"]["job"]["generation"]["logprobs"] == 2


def test_synthesis_job_is_valid():
    proc = run_cli("validate", str(ROOT / "jobs" / "synthesis.yaml"))
    assert proc.stdout.startswith("ok: ")
    spec = yaml.safe_load((ROOT / "jobs" / "synthesis.yaml").read_text())["generation"]
    assert spec["n"] == 4 and spec["temperature"] == 0.9 and spec["top_p"] == 0.95 and spec["stop"]
