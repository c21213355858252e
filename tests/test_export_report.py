"""A JSON Lines input with a prompt template, a filter and a shuffle through the real CLI on the tiny
random-weight model; then `pipeline export` to each format and `pipeline report`, checked against the
committed shards."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from test_job_end_to_end import read_output, run_cli
from tiny_model import write_tiny_model

TEMPLATE = "Question: {{ question }}\nAnswer ({{ lang }}):"
BAD_ID = "<b>q7</b>"  # a failed row whose id must come out escaped in the report
N_ROWS = 14


def input_rows() -> list[dict]:
    rows = []
    for i in range(N_ROWS):
        rows.append({"qid": BAD_ID if i == 7 else f"q{i}", "question": None if i == 7 else f"What is {i} + {i}?",
                     "lang": ["en", "de", "fr"][i % 3], "prompt": f"raw {i}", "max_tokens": 3 + i % 4})
    return rows


def write_job(tmp: Path, model: Path, data: Path, name: str, **input_extra) -> Path:
    job = {
        "model": str(model),
        "input": {"path": str(data), "id_column": "qid", "template": TEMPLATE,
                  "filter": {"column": "lang", "one_of": ["en", "de"]}, **input_extra},
        "generation": {"max_tokens": 6, "temperature": 0.8, "seed": 1, "n": 2, "logprobs": 2},
        "output": {"dir": str(tmp / name), "shard_size": 3},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-report")
    model = write_tiny_model(tmp / "model")
    data = tmp / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in input_rows()), encoding="utf-8")
    return tmp, model, data


@pytest.fixture(scope="module")
def run(setup):
    tmp, model, data = setup
    proc = run_cli("run", str(write_job(tmp, model, data, "out", shuffle_seed=3)), "--no-progress", expect=3)
    return tmp / "out", proc


def expected_sorted(out: Path) -> pa.Table:
    """The committed rows sorted by their row's position in the input, then sample_index."""
    position = {r["qid"]: i for i, r in enumerate(input_rows())}
    t = read_output(out)
    keys = sorted(range(t.num_rows), key=lambda k: (position[t["id"][k].as_py()], t["sample_index"][k].as_py()))
    return t.take(pa.array(keys))


def test_run_uses_the_filtered_shuffled_rows_and_points_at_report(run):
    out, proc = run
    t = read_output(out)
    kept = [r["qid"] for i, r in enumerate(input_rows()) if i % 3 != 2]
    assert sorted(set(t["id"].to_pylist())) == sorted(kept)
    assert t.num_rows == 2 * len(kept)
    commit_order = list(dict.fromkeys(t["id"].to_pylist()))
    assert commit_order != kept  # shuffled, not in input order
    ok = t.filter(pc.is_null(t["error"]))
    for r in ok.to_pylist():
        i = int(r["id"][1:])
        assert r["prompt"] == f"Question: What is {i} + {i}?\nAnswer ({['en', 'de', 'fr'][i % 3]}):"
        assert r["completion_tokens"] <= 3 + i % 4  # the max_tokens column overrides the job's 6
    bad = t.filter(pc.equal(t["id"], BAD_ID)).to_pylist()
    assert [r["error"] for r in bad] == ["input.template printed a null value (null in this row: question)"] * 2
    assert f"charts and failed rows: pipeline report {out}" in proc.stdout


def test_limited_shuffled_subset_is_the_same_on_two_runs(setup):
    tmp, model, data = setup
    tables = {}
    for name, seed in (("a", 11), ("b", 11), ("c", 12)):
        proc = run_cli("run", str(write_job(tmp, model, data, name, shuffle_seed=seed, limit=4)), "--no-progress",
                       check=False)
        assert proc.returncode in (0, 3), proc.stderr  # 3: the subset holds the row with a null question
        tables[name] = read_output(tmp / name).select(["id", "sample_index", "prompt", "completion", "seed"])
    assert tables["a"].equals(tables["b"])
    assert len(set(tables["a"]["id"].to_pylist())) == 4
    assert set(tables["a"]["id"].to_pylist()) != set(tables["c"]["id"].to_pylist())


def _same(a, b) -> bool:
    """Equal values, floats to within JSON Lines' 15 decimal places."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _types(schema: pa.Schema) -> list[tuple[str, str]]:
    return [(f.name, str(f.type).replace("element:", "item:")) for f in schema]


@pytest.mark.parametrize("target", ["results.parquet", "results.jsonl", "results"])
def test_export_round_trip_equals_the_shards(run, tmp_path, target):
    out, _ = run
    dest = tmp_path / target
    proc = run_cli("export", str(out), "--to", str(dest))
    expected = expected_sorted(out)
    assert f"wrote {expected.num_rows} rows x {expected.num_columns} columns to {dest}" in proc.stdout
    if target.endswith(".parquet"):
        got = pq.read_table(dest)
        assert got.schema.equals(expected.schema) and got.equals(expected)
        got = datasets.load_dataset("parquet", data_files=str(dest), split="train", cache_dir=str(tmp_path / "c"))
        assert got.to_list() == expected.to_pylist()
    elif target.endswith(".jsonl"):
        got = datasets.load_dataset("json", data_files=str(dest), split="train", cache_dir=str(tmp_path / "c"))
        assert got.column_names == expected.column_names
        rows, want = got.to_list(), expected.to_pylist()
        assert len(rows) == len(want)
        for r, w in zip(rows, want):
            bad = [c for c in w if not _same(r[c], w[c])]
            assert not bad, (w["id"], w["sample_index"], bad)
    else:
        got = datasets.load_from_disk(str(dest))
        table = got.with_format("arrow")[:]
        # datasets keeps the types but not the not-null flags or the list item names
        assert _types(table.schema) == _types(expected.schema)
        assert table.to_pylist() == expected.to_pylist()
    assert expected["id"].to_pylist()[:4] == ["q0", "q0", "q1", "q1"]  # input order, sample_index second


def test_export_join_input_and_overwrite(run, tmp_path):
    out, _ = run
    dest = tmp_path / "joined.parquet"
    run_cli("export", str(out), "--to", str(dest), "--join-input")
    got = pq.read_table(dest)
    expected = expected_sorted(out)
    assert got.column_names == expected.column_names + ["question", "lang", "input_prompt", "max_tokens"]
    assert got.select(expected.column_names).equals(expected)
    by_id = {r["qid"]: r for r in input_rows()}
    for r in got.to_pylist():
        src = by_id[r["id"]]
        assert (r["question"], r["lang"], r["input_prompt"], r["max_tokens"]) == (
            src["question"], src["lang"], src["prompt"], src["max_tokens"])
    proc = run_cli("export", str(out), "--to", str(dest), expect=2)
    assert proc.stderr.strip() == f"error: --to {dest}: exists; pass --overwrite to replace it"
    assert pq.read_table(dest).num_columns == got.num_columns  # left as it was
    run_cli("export", str(out), "--to", str(dest), "--overwrite")
    assert pq.read_table(dest).equals(expected)
    proc = run_cli("export", str(out), "--to", str(out / "x.parquet"), expect=2)
    assert "inside the output dir" in proc.stderr and not (out / "x.parquet").exists()


class _Page(HTMLParser):
    """Collects the report's tables and images and checks that every element is closed."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.images, self.summary, self.tables, self.pre = [], [], {}, {}, []
        self._table = self._row = self._cell = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag == "img":
            self.images.append(a["src"])
        elif tag == "table":
            self._table = self.tables.setdefault(a.get("id"), [])
        elif tag == "tr":
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th"):
            self._cell = [a.get("data-value")]
            self._row.append(self._cell)
        if tag == "tr" and self._table is self.tables.get("summary"):
            self._key = a["data-key"]

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> does not close the open element"
        if tag in ("td", "th"):
            self._cell = None
        if tag == "tr" and self._table is self.tables.get("summary"):
            self.summary[self._key] = self._row[1][0]

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "pre":
            self.pre.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _text(cell) -> str:
    return "".join(cell[1:])


def test_report_renders_with_numbers_from_the_shards(run):
    out, _ = run
    proc = run_cli("report", str(out))
    page = out / "report" / "report.html"
    assert proc.stdout.strip() == f"wrote {page}"
    html = page.read_text(encoding="utf-8")
    p = _Page()
    p.feed(html)
    p.close()
    assert p.stack == [] and html.startswith("<!DOCTYPE html>")

    import matplotlib.image

    assert sorted(p.images) == ["completion_tokens.png", "decode_tps.png", "finish_reason.png", "ttft_vs_prompt.png"]
    for name in p.images:
        png = page.parent / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(png)
        assert img.shape[0] > 200 and img.shape[1] > 500 and img.std() > 0.01  # not blank

    t = read_output(out)
    manifest = json.loads((out / "manifest.json").read_text())
    rows = t.to_pylist()
    ok = [r for r in rows if r["error"] is None]
    expect = {
        "rows": len(rows),
        "failed": len(rows) - len(ok),
        "pending": 0,
        "completion_tokens": sum(r["completion_tokens"] for r in ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "mean_decode_tps": statistics.fmean(r["decode_tps"] for r in ok),
        "row_seconds": math.fsum(r["total_s"] for r in rows),
        "generation_seconds": math.fsum(r["elapsed_s"] for r in manifest["runs"]),
    }
    expect["throughput_tps"] = expect["completion_tokens"] / expect["generation_seconds"]
    assert expect["failed"] == 2 and expect["rows"] == 20
    for key, value in expect.items():
        assert float(p.summary[key]) == pytest.approx(value, rel=1e-9), key

    finish = {_text(r[0]): int(r[1][0]) for r in p.tables["finish-reasons"][1:]}
    want = {"failed": expect["failed"]}
    for r in ok:
        want[r["finish_reason"]] = want.get(r["finish_reason"], 0) + 1
    assert finish == want

    failed = [(_text(r[0]), int(_text(r[1])), _text(r[2])) for r in p.tables["failed"][1:]]
    assert sorted(failed) == sorted((r["id"], r["sample_index"], r["error"]) for r in rows if r["error"])
    assert BAD_ID not in html and "&lt;b&gt;q7&lt;/b&gt;" in html  # escaped, not markup
    assert json.loads("".join(p.pre)) == manifest["fingerprint"]  # the whole fingerprint, template and filter too
    assert manifest["fingerprint"]["prompt"]["shuffle_seed"] == 3


def test_report_out_path_and_missing_matplotlib(run, tmp_path):
    out, _ = run
    page = tmp_path / "site" / "r.html"
    run_cli("report", str(out), "--out", str(page))
    assert page.is_file() and (tmp_path / "site" / "decode_tps.png").is_file()
    code = "import sys; sys.modules['matplotlib'] = None; from pipeline.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "report", str(out), "--out", str(tmp_path / "x.html")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ('error: pipeline report needs matplotlib, a dependency of pipeline that is '
                                   'missing here: pip install "matplotlib>=3.7"')
    assert not (tmp_path / "x.html").exists()


def test_export_when_the_input_is_gone(run, tmp_path):
    out, _ = run
    moved = tmp_path / "out"
    shutil.copytree(out, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["info"]["job"]["input"]["path"] = str(tmp_path / "gone.jsonl")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("export", str(moved), "--to", str(tmp_path / "r.parquet"))
    assert proc.stderr.startswith("note: rows sorted by id and sample_index, not input order: input.path ")
    got = pq.read_table(tmp_path / "r.parquet")
    keys = list(zip(got["id"].to_pylist(), got["sample_index"].to_pylist()))
    assert keys == sorted(keys) and len(keys) == read_output(out).num_rows
    proc = run_cli("export", str(moved), "--to", str(tmp_path / "j.parquet"), "--join-input", expect=2)
    assert proc.stderr.startswith("error: --join-input: input.path ") and not (tmp_path / "j.parquet").exists()
