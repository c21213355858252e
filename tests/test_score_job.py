"""task: score as a job, on a tiny random-weight model: output rows, bad cells, job errors, validate,
resume, the fingerprint, export --pivot, and a SIGKILL mid-run resumed through the real CLI."""

from __future__ import annotations

import json
import signal
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from pipeline.export import export_results
from pipeline.jobspec import JobSpecError, job_from_dict
from pipeline.run import run_job
from pipeline.run.plan import fingerprint
from tiny_model import wait_until

ROWS = 24


pytestmark = pytest.mark.usefixtures("tiny_home")  # the tiny model and a temporary $PIPELINE_HOME (conftest)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    """ROWS questions of 4 choices; q03: null choices, q04: an empty list, q05: a null choice, q06: an empty
    choice after a context without trailing whitespace (no tokens)."""
    choices = [[f" answer {k} to {i}", f" option {k}", " yes", " no"] for i in range(ROWS) for k in [i % 3]]
    choices[3], choices[4], choices[5] = None, [], [" a", None]
    choices[6] = [" fine", ""]
    path = tmp_path_factory.mktemp("input") / "q.parquet"
    pq.write_table(pa.table({"id": [f"q{i:02d}" for i in range(ROWS)],
                             "question": [f"Question {i}: what is {i} plus {i}?" for i in range(ROWS)],
                             "choices": pa.array(choices, pa.list_(pa.string()))}), path)
    return path


def job_dict(model, path, out, **inp) -> dict:
    return {"model": str(model), "task": "score",
            "input": {"path": str(path), "id_column": "id", "template": "{{ question }}\nAnswer:",
                      "choices_column": "choices", "apply_chat_template": False, **inp},
            "output": {"dir": str(out), "shard_size": 8}}


def read(out) -> pa.Table:
    manifest = json.loads((out / "manifest.json").read_text())
    return pa.concat_tables([pq.read_table(out / s["file"]) for s in manifest["shards"]])


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_model, questions):
    out = tmp_path_factory.mktemp("run") / "out"
    summary = run_job(job_from_dict(job_dict(tiny_model, questions, out)), progress=False, echo=lambda _: None)
    return out, summary


def test_one_row_per_choice_and_bad_cells_fail_by_row_and_column(scored):
    out, summary = scored
    t = read(out).to_pylist()
    by = {(r["id"], r["choice_index"]): r for r in t}
    assert len(t) == (ROWS - 3) * 4 - 2 + 3  # q03-q05: one failed row each; q06 has 2 choices
    assert by["q03", 0]["error"] == "input.choices_column 'choices' of row 'q03' must be a non-empty list of strings, got null"
    assert "got an empty list" in by["q04", 0]["error"] and "got a list with a null" in by["q05", 0]["error"]
    assert by["q06", 1]["error"] == "choice 1 ('') encodes to no tokens" and by["q06", 0]["error"] is None
    ok = by["q00", 2]
    assert ok["choice"] == " yes" and ok["num_tokens"] == len(ok["token_logprobs"]) >= 1
    assert ok["logprob_sum"] == pytest.approx(sum(ok["token_logprobs"]), abs=1e-5) and ok["logprob_sum"] < 0
    assert ok["shared_context"] is True and ok["prompt_tokens"] > 0 and ok["error"] is None
    assert summary.rows_failed == 4
    assert summary.line().startswith(f"done: {len(t)} scored choices written (4 failed, 0 from earlier runs)")
    assert "--pivot" in summary.line()


def test_report_refuses_score_outputs(scored):
    from pipeline.report import ReportError, write_report

    with pytest.raises(ReportError, match="task: score results"):
        write_report(scored[0])


def test_export_json_fields_of_score_outputs_is_one_line(scored, tmp_path):
    """--json-fields on a task: score output (no completion column) is one error line, exit 2, nothing written
    (was a KeyError traceback), as --pivot of a generate output."""
    from click.testing import CliRunner

    from pipeline.cli import main

    result = CliRunner().invoke(main, ["export", str(scored[0]), "--to", str(tmp_path / "j.parquet"), "--json-fields"])
    assert (result.exit_code, result.stderr) == (
        2, "error: --json-fields: the output holds no completions (task: score); nothing to parse\n")
    assert list(tmp_path.iterdir()) == []


def test_schema(scored):
    schema = read(scored[0]).schema
    assert {f.name: f.type for f in schema} == {
        "id": pa.string(), "choice_index": pa.int32(), "prompt": pa.string(), "choice": pa.string(),
        "logprob_sum": pa.float64(), "num_tokens": pa.int32(), "is_greedy": pa.bool_(),
        "token_logprobs": pa.list_(pa.float32()), "prompt_tokens": pa.int32(), "ttft_s": pa.float64(),
        "total_s": pa.float64(), "peak_memory_bytes": pa.int64(), "shared_context": pa.bool_(), "error": pa.string()}


def test_resume_gives_the_same_rows(tmp_path, tiny_model, questions, scored):
    job = job_from_dict(job_dict(tiny_model, questions, tmp_path / "out"))
    first = run_job(job, limit=5, progress=False, echo=lambda _: None)
    assert first.rows_written == 4 * 3 + 2
    rest = run_job(job, progress=False, echo=lambda _: None)
    assert rest.rows_skipped == first.rows_written
    cols = ["id", "choice_index", "logprob_sum", "token_logprobs", "is_greedy", "error"]
    key = lambda r: (r["id"], r["choice_index"])  # noqa: E731
    assert sorted(read(tmp_path / "out").select(cols).to_pylist(), key=key) == \
        sorted(read(scored[0]).select(cols).to_pylist(), key=key)
    assert run_job(job, progress=False, echo=lambda _: None).rows_written == 0


def test_fingerprint_holds_the_task_and_the_column(tiny_model, questions, tmp_path):
    score = fingerprint(job_from_dict(job_dict(tiny_model, questions, tmp_path)), {"sha256": "x"})
    assert score["task"] == "score" and score["score"]["choices_column"] == "choices" and "generation" not in score
    gen = job_from_dict({"input": {"path": str(questions)}, "output": {"dir": str(tmp_path)}})
    assert "task" not in fingerprint(gen, {"sha256": "x"})  # generation fingerprints as before
    other = job_dict(tiny_model, questions, tmp_path)
    other["input"] = {**other["input"], "choices_column": None, "continuation_column": "question"}
    assert fingerprint(job_from_dict(other), {"sha256": "x"})["score"] != score["score"]


def test_export_pivot(scored, tmp_path):
    export_results(scored[0], str(tmp_path / "p.parquet"), pivot=True, join_input=True, warn=lambda _: None)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "p.parquet").to_pylist()}
    assert len(rows) == ROWS
    r = rows["q01"]
    assert r["pred"] == max(range(4), key=lambda k: r["logprob_sum"][k])
    assert r["pred_norm"] == max(range(4), key=lambda k: r["logprob_sum"][k] / r["num_tokens"][k])
    assert r["choices"][2] == " yes" and r["question"].startswith("Question 1:")
    assert rows["q03"]["pred"] is None and "q03" in rows["q03"]["error"]


def test_a_shard_never_ends_inside_a_row(tmp_path, tiny_model, questions, scored):
    """4 choices a row, shards of 3 output rows: each row's choices are committed together (a stop between
    commits then leaves no row with some of its choices), and the results are those of shards of 8."""
    out = tmp_path / "out"
    d = job_dict(tiny_model, questions, out)
    d["output"]["shard_size"] = 3
    run_job(job_from_dict(d), progress=False, echo=lambda _: None)
    manifest = json.loads((out / "manifest.json").read_text())
    shard_of = {}
    for s in manifest["shards"]:
        for r in pq.read_table(out / s["file"], columns=["id"]).to_pylist():
            shard_of.setdefault(r["id"], set()).add(s["file"])
    assert len(manifest["shards"]) >= ROWS // 2 and len(shard_of) == ROWS
    assert {k: len(v) for k, v in shard_of.items() if len(v) != 1} == {}
    cols, key = ["id", "choice_index", "logprob_sum", "error"], lambda r: (r["id"], r["choice_index"])  # noqa: E731
    assert sorted(read(out).select(cols).to_pylist(), key=key) == sorted(read(scored[0]).select(cols).to_pylist(),
                                                                         key=key)


def test_a_score_job_reads_no_generation_override_columns(tmp_path, tiny_model):
    """A column named like a generation key is data to a score job: text in ``temperature`` does not stop
    it (a generate job refuses that column's type), and the choices score as without the column."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "question": ["Is it hot?", "Is it cold?"],
                             "choices": [[" yes", " no"], [" yes", " no"]], "temperature": ["hot", "cold"],
                             "n": pa.array([0, -1], pa.int64())}), path)
    run_job(job_from_dict(job_dict(tiny_model, path, tmp_path / "out")), progress=False, echo=lambda _: None)
    got = read(tmp_path / "out").select(["id", "choice_index", "logprob_sum", "error"]).to_pylist()
    pq.write_table(pq.read_table(path).drop_columns(["temperature", "n"]), path)
    run_job(job_from_dict(job_dict(tiny_model, path, tmp_path / "plain")), progress=False, echo=lambda _: None)
    assert len(got) == 4 and all(r["error"] is None for r in got)
    assert got == read(tmp_path / "plain").select(["id", "choice_index", "logprob_sum", "error"]).to_pylist()
    generate = {"input": {"path": str(path), "prompt_column": "question"}, "output": {"dir": "x"}}
    pq.write_table(pa.table({"question": ["q"], "temperature": ["hot"]}), path)
    from pipeline.inputs import InputError, read_rows
    with pytest.raises(InputError, match="per-row override of generation.temperature"):
        read_rows(job_from_dict(generate).input)


def test_pivot_of_a_row_committed_in_part_has_no_pred():
    from pipeline.export import pivot_choices
    t = pa.table({"id": ["a", "a", "b", "b", "b"], "choice_index": pa.array([0, 2, 0, 1, 2], pa.int32()),
                  "prompt": ["p"] * 5, "choice": [" x", " z", " x", " y", " z"],
                  "logprob_sum": [-3.0, -1.0, -3.0, -2.0, -1.0], "num_tokens": pa.array([1] * 5, pa.int32()),
                  "is_greedy": [False] * 5, "error": pa.array([None] * 5, pa.string())})
    rows = {r["id"]: r for r in pivot_choices(t).to_pylist()}
    assert rows["a"]["pred"] is None and rows["a"]["pred_norm"] is None
    assert rows["a"]["error"] == "choice_index 1 not committed (resume the run)"
    assert rows["b"]["pred"] == 2 and rows["b"]["error"] is None


@pytest.mark.parametrize("change, problem", [
    ({"choices_column": None}, "task: score needs exactly one of input.choices_column"),
    ({"continuation_column": "question"}, "task: score needs exactly one of"),
])
def test_job_errors(tiny_model, questions, tmp_path, change, problem):
    d = job_dict(tiny_model, questions, tmp_path)
    d["input"].update(change)
    with pytest.raises(JobSpecError, match=problem):
        job_from_dict(d)
    with pytest.raises(JobSpecError, match="input.choices_column is for task: score"):
        job_from_dict({"input": {"path": str(questions), "choices_column": "choices"}, "output": {"dir": "x"}})
    with pytest.raises(JobSpecError, match="batch_size must be 1 with task: score"):
        job_from_dict({**job_dict(tiny_model, questions, tmp_path), "engine": {"batch_size": 4}})


def cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["pipeline", *args], capture_output=True, text=True, cwd=ROOT, **kw)


def test_missing_column_is_one_line_before_the_model_loads(tmp_path, tiny_model, questions):
    job = job_dict(tiny_model, questions, tmp_path / "out", choices_column="options")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    for cmd in ("run", "validate"):
        proc = cli(cmd, str(tmp_path / "job.yaml"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            "error: input.choices_column: column 'options' not found in "), proc.stderr
        assert "loaded" not in proc.stderr and not (tmp_path / "out").exists()


def test_validate_counts_choices(tmp_path, tiny_model, questions):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_dict(tiny_model, questions, tmp_path / "out")))
    proc = cli("validate", str(tmp_path / "job.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert f"{ROWS} input rows ({(ROWS - 3) * 4 - 2 + 3} output rows, task: score, one per choice)" in proc.stdout


def test_sigkill_mid_run_then_resume(tmp_path, tiny_model, questions, scored):
    out = tmp_path / "out"
    job = job_dict(tiny_model, questions, out)
    job["output"]["shard_size"] = 4
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = ["pipeline", "run", str(tmp_path / "job.yaml"), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def committed() -> int:
        try:
            return json.loads((out / "manifest.json").read_text())["rows"]
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    wait_until(lambda: committed() > 0, proc, what="the first commit")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr  # the bad cells
    cols = ["id", "choice_index", "logprob_sum", "token_logprobs", "is_greedy", "num_tokens", "error"]
    rows = read(out).select(cols).to_pylist()
    assert len({(r["id"], r["choice_index"]) for r in rows}) == len(rows)
    key = lambda r: (r["id"], r["choice_index"])  # noqa: E731
    assert sorted(rows, key=key) == sorted(read(scored[0]).select(cols).to_pylist(), key=key)


def test_a_continuation_cell_that_is_not_a_string_says_what_it_is(tiny_model, questions, tmp_path):
    from pipeline.inputs import InputRow
    from pipeline.run.plan import row_choices
    d = job_dict(tiny_model, questions, tmp_path)
    d["input"] = {**d["input"], "choices_column": None, "continuation_column": "answer"}
    job = job_from_dict(d)
    row = lambda cell: InputRow(index=0, id="r1", prompt="p", messages=None, overrides={}, choices=cell)  # noqa: E731
    assert row_choices(job, row(" yes")) == [" yes"]
    assert row_choices(job, row(None)) == "input.continuation_column 'answer' of row 'r1' is null"
    assert row_choices(job, row(5)) == "input.continuation_column 'answer' of row 'r1' must be a string, got int"


def test_a_choices_cell_with_a_non_string_says_which(tiny_model, questions, tmp_path):
    from pipeline.inputs import InputRow
    from pipeline.run.plan import row_choices
    job = job_from_dict(job_dict(tiny_model, questions, tmp_path))
    row = lambda cell: InputRow(index=0, id="r1", prompt="p", messages=None, overrides={}, choices=cell)  # noqa: E731
    where = "input.choices_column 'choices' of row 'r1' must be a non-empty list of strings, got "
    assert row_choices(job, row([1, 2])) == where + "a list with a int (1)"
    assert row_choices(job, row(["a", 3.5])) == where + "a list with a float (3.5)"
    assert row_choices(job, row(["a", None])) == where + "a list with a null"


def test_an_empty_context_is_scored_after_the_prefix_token(tiny_model, tmp_path):
    """lm-eval's ``loglikelihood`` with ``context == ""`` (``acc_mutual_info``'s unconditional requests) scores
    the continuation after ``prefix_token_id`` (BOS, else EOS): the row is scored, with that one context
    token, as step-by-step decoding from it gives; a context of only whitespace the same, its whitespace moved
    to the continuation."""
    import mlx.core as mx

    from pipeline import load_model

    path = tmp_path / "ctx.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "ctx": ["", "  ", "Hello"], "cont": [" world", "x", " world"]}), path)
    out = tmp_path / "out"
    job = job_from_dict({"model": str(tiny_model), "task": "score", "output": {"dir": str(out)},
                         "input": {"path": str(path), "id_column": "id", "prompt_column": "ctx",
                                   "continuation_column": "cont", "apply_chat_template": False}})
    run_job(job, progress=False, echo=lambda _: None)
    rows = {r["id"]: r for r in read(out).to_pylist()}
    assert [rows[i]["error"] for i in (1, 2, 3)] == [None, None, None]
    lm = load_model(path=tiny_model)
    tok, engine = lm.tokenizer, lm.engine
    assert tok.prefix_token_id == tok.bos_token_id is not None
    for i, cont in ((1, " world"), (2, "  x")):
        ids = tok.encode(cont)
        assert rows[i]["prompt_tokens"] == 1 and rows[i]["num_tokens"] == len(ids)
        engine.reset()
        logits = engine.prefill(mx.array([tok.prefix_token_id], dtype=mx.uint32))
        want = []
        for t in ids:
            x = logits[0].astype(mx.float32)
            want.append((x[t] - mx.logsumexp(x)).item())
            logits = engine.model(mx.array([[t]], dtype=mx.int32), engine.cache)[:, -1, :]
        assert rows[i]["token_logprobs"] == pytest.approx(want, abs=2e-5)


def test_a_choice_that_joins_the_contexts_last_token_says_so(tiny_model, tmp_path):
    path = tmp_path / "merge.parquet"
    pq.write_table(pa.table({"id": [1], "ctx": ["Hello wor"], "cont": ["ld"]}), path)
    out = tmp_path / "out"
    job = job_from_dict({"model": str(tiny_model), "task": "score", "output": {"dir": str(out)},
                         "input": {"path": str(path), "id_column": "id", "prompt_column": "ctx",
                                   "continuation_column": "cont", "apply_chat_template": False}})
    run_job(job, progress=False, echo=lambda _: None)
    [row] = read(out).to_pylist()
    assert row["error"] == ("choice 0 ('ld') adds no tokens to the context: context + choice encode to as many "
                            "tokens as the context alone (the choice's text joins the context's last token)")


def test_keys_a_score_job_does_not_read_leave_its_fingerprint_alone(tiny_model, questions, tmp_path):
    """``input.truncate`` and ``input.row_overrides`` apply to generation only: changing them resumes a score
    output dir (its fingerprint records their defaults, as output dirs written before held)."""
    base = job_dict(tiny_model, questions, tmp_path)
    fp = fingerprint(job_from_dict(base), {"sha256": "x"})
    assert fp["prompt"]["truncate"] == "error" and fp["prompt"]["row_overrides"] is True
    other = {**base, "input": {**base["input"], "truncate": "left", "row_overrides": False}}
    assert fingerprint(job_from_dict(other), {"sha256": "x"}) == fp
