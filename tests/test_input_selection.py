"""JSON Lines / JSON / CSV inputs read through ``datasets``, prompt templates, input.filter,
input.shuffle_seed and input.limit: pipeline.inputs.read_rows on real files, and the hub-dataset error
offline through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import closed_port
from pipeline.inputs import InputError, read_rows
from pipeline.jobspec import JobSpecError, job_from_dict

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "Question: {{ question }}\nAnswer:"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def spec(**inp):
    """A validated InputSpec, as the job file would give it."""
    return job_from_dict({"input": inp, "output": {"dir": "o"}}).input


def questions(n: int) -> list[dict]:
    return [{"qid": f"q{i}", "question": f"What is {i} + {i}?", "lang": ["en", "de", "fr"][i % 3], "level": i % 4}
            for i in range(n)]


def test_jsonl_with_template_and_override_column(tmp_path):
    rows = questions(3)
    rows[1]["max_tokens"] = 7
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    got, id_type = read_rows(spec(path=str(f), id_column="qid", template=TEMPLATE))
    assert id_type == pa.string()
    assert [r.id for r in got] == ["q0", "q1", "q2"]
    assert [r.index for r in got] == [0, 1, 2]
    assert [r.prompt for r in got] == [f"Question: What is {i} + {i}?\nAnswer:" for i in range(3)]
    assert [r.overrides for r in got] == [{}, {"max_tokens": 7}, {}]
    assert all(r.error is None for r in got)


def test_template_reads_several_columns_of_several_types(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"q": "Why?", "choices": ["a", "b"], "k": 2}])
    (row,), _ = read_rows(spec(path=str(f), template="{{ q }} ({{ choices | join('/') }}, k={{ k + 1 }})"))
    assert row.prompt == "Why? (a/b, k=3)"


def test_csv_with_template(tmp_path):
    f = tmp_path / "in.csv"
    f.write_text('id,question,lang\n10,"Hi, there?",en\n11,Bye?,de\n', encoding="utf-8")
    got, id_type = read_rows(spec(path=str(f), id_column="id", template="[{{ lang }}] {{ question }}"))
    assert id_type == pa.int64()
    assert [(r.id, r.prompt) for r in got] == [(10, "[en] Hi, there?"), (11, "[de] Bye?")]


def test_json_array_file(tmp_path):
    f = tmp_path / "in.json"
    f.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]), encoding="utf-8")
    got, _ = read_rows(spec(path=str(f)))
    assert [(r.id, r.prompt) for r in got] == [(0, "a"), (1, "b")]


def test_glob_and_directory_of_jsonl_in_sorted_path_order(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "part-2.jsonl", [{"prompt": "c"}])  # written first: creation order differs from sorted
    write_jsonl(d / "part-1.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    (d / "notes.txt").write_text("not input")
    for path in (str(d / "part-*.jsonl"), str(d)):
        got, _ = read_rows(spec(path=path, template="say {{ prompt }}"))
        assert [(r.index, r.prompt) for r in got] == [(0, "say a"), (1, "say b"), (2, "say c")]


def test_messages_column_from_jsonl(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    f = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p", "messages": msgs}, {"prompt": "q", "messages": None}])
    got, _ = read_rows(spec(path=str(f), messages_column="messages"))
    assert got[0].messages == msgs and got[1].messages is None and got[1].prompt == "q"


def test_mixed_formats_are_an_error(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "a"}])
    pq.write_table(pa.table({"prompt": ["b"]}), tmp_path / "d" / "b.parquet")
    with pytest.raises(InputError, match=r"files mix formats \(JSON, Parquet\)"):
        read_rows(spec(path=str(tmp_path / "d")))


def test_directory_skips_hidden_files_and_directories_as_its_glob_does(tmp_path):
    """A directory's search skips names starting with a dot below it, as ``**`` in a glob does: an editor's or
    a notebook's copies (``.ipynb_checkpoints/``) are not input rows."""
    d = tmp_path / "data"
    write_jsonl(d / "a.jsonl", [{"prompt": "a"}])
    write_jsonl(d / "sub" / "b.jsonl", [{"prompt": "b"}])
    write_jsonl(d / ".hidden.jsonl", [{"prompt": "hidden"}])
    write_jsonl(d / ".ipynb_checkpoints" / "a-checkpoint.jsonl", [{"prompt": "checkpoint"}])
    write_jsonl(d / "sub" / ".cache" / "c.jsonl", [{"prompt": "cache"}])
    for path in (str(d), str(d / "**" / "*.jsonl")):
        got, _ = read_rows(spec(path=path))
        assert [r.prompt for r in got] == ["a", "b"], path


def test_suffixes_are_read_in_any_case(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "A.JSONL", [{"prompt": "a"}])
    write_jsonl(d / "b.Jsonl", [{"prompt": "b"}])
    for path in (str(d), str(d / "A.JSONL")):
        got, _ = read_rows(spec(path=path))
        assert [r.prompt for r in got] == (["a", "b"] if path == str(d) else ["a"]), path
    (tmp_path / "C.CSV").write_text("id,prompt\n1,NA\n", encoding="utf-8")
    got, _ = read_rows(spec(path=str(tmp_path / "C.CSV"), id_column="id"))
    assert [(r.id, r.prompt) for r in got] == [(1, "NA")]
    pq.write_table(pa.table({"prompt": ["p"]}), tmp_path / "D.PARQUET")
    assert [r.prompt for r in read_rows(spec(path=str(tmp_path / "D.PARQUET")))[0]] == ["p"]


def test_a_file_of_another_suffix_is_named_with_its_suffix(tmp_path):
    """A suffix that names no format read (a compressed file, a README a glob catches) is said as such, not as
    a file that is not Parquet, or as JSON mixed with Parquet; a file without a suffix is still read as Parquet."""
    import gzip

    d = tmp_path / "d"
    write_jsonl(d / "a.jsonl", [{"prompt": "a"}])
    with gzip.open(d / "c.jsonl.gz", "wt") as fh:
        fh.write('{"prompt": "c"}\n')
    with pytest.raises(InputError) as ei:
        read_rows(spec(path=str(d / "*")))
    assert str(ei.value) == (f"input.path {str(d / '*')!r}: {d / 'c.jsonl.gz'}: suffix '.gz' is none of the formats "
                             "read (.parquet, .jsonl, .json, .csv)")
    with pytest.raises(InputError) as ei:
        read_rows(spec(path=str(d / "c.jsonl.gz")))
    assert str(ei.value).startswith(f"input file {d / 'c.jsonl.gz'}: suffix '.gz' is none of the formats read "
                                    "(.parquet, .jsonl, .json, .csv), and it is not readable as Parquet: ")
    assert "\n" not in str(ei.value)
    e = tmp_path / "e"
    e.mkdir()
    pq.write_table(pa.table({"prompt": ["p"]}), e / "x.parquet")
    (e / "README.md").write_text("# about\n")
    with pytest.raises(InputError, match=r"^input file .*README.md: suffix '.md' is none of the formats read "
                                         r"\(.parquet, .jsonl, .json, .csv\), and it is not readable as Parquet: "):
        read_rows(spec(path=str(e / "*")))
    pq.write_table(pa.table({"prompt": ["q"]}), tmp_path / "nosuffix")
    assert [r.prompt for r in read_rows(spec(path=str(tmp_path / "nosuffix")))[0]] == ["q"]
    (tmp_path / "notes").write_text("not parquet")
    with pytest.raises(InputError, match=r"^input file .*notes: no suffix naming one of the formats read "
                                         r"\(.parquet, .jsonl, .json, .csv\), and it is not readable as Parquet: "):
        read_rows(spec(path=str(tmp_path / "notes")))


def test_malformed_jsonl_is_one_line(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(InputError) as ei:
        read_rows(spec(path=str(f)))
    assert str(ei.value).startswith(f"input.path {str(f)!r} (JSON): not readable: ")
    assert "\n" not in str(ei.value)


def test_template_column_missing_is_an_error_at_start(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", questions(2))
    with pytest.raises(InputError) as ei:
        read_rows(spec(path=str(f), template="{{ question }} {{ contxt }}"))
    assert str(ei.value) == "input.template: column 'contxt' not found in input (columns: qid, question, lang, level)"
    pq.write_table(pa.table({"question": ["a"]}), tmp_path / "in.parquet")
    with pytest.raises(InputError,
                       match=r"^input.template: column 'contxt' not found in .*in.parquet \(columns: question\)$"):
        read_rows(spec(path=str(tmp_path / "in.parquet"), template="{{ contxt }}"))


def test_template_null_value_fails_only_that_row(tmp_path):
    rows = questions(3)
    rows[1]["question"] = None
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    got, _ = read_rows(spec(path=str(f), template=TEMPLATE + "{% if lang %} Hint: {{ lang }}{% endif %}"))
    assert got[1].prompt is None
    assert got[1].error == "input.template printed a null value (null in this row: question)"
    assert got[0].error is None and got[0].prompt.endswith("Hint: en")


def test_template_that_does_not_compile_is_a_job_error():
    with pytest.raises(JobSpecError, match=r"input.template does not compile: .* \(line 1\)"):
        spec(path="x.jsonl", template="{{ question ")


def test_filter_equals_one_of_and_list(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", questions(9))
    base = {"path": str(f), "id_column": "qid", "template": TEMPLATE}
    got, _ = read_rows(spec(**base, filter={"column": "lang", "equals": "de"}))
    assert [r.id for r in got] == ["q1", "q4", "q7"]
    assert [r.index for r in got] == [1, 4, 7]
    got, _ = read_rows(spec(**base, filter={"column": "level", "one_of": [0, 3]}))
    assert [r.id for r in got] == ["q0", "q3", "q4", "q7", "q8"]
    got, _ = read_rows(spec(**base, filter=[{"column": "lang", "one_of": ["en", "de"]},
                                            {"column": "level", "equals": 0}]))
    assert [r.id for r in got] == ["q0", "q4"]


def test_filter_never_matches_null(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "lang": ["en", None, "en"]}), tmp_path / "in.parquet")
    got, _ = read_rows(spec(path=str(tmp_path / "in.parquet"), filter={"column": "lang", "one_of": ["en", "de"]}))
    assert [r.index for r in got] == [0, 2]


@pytest.mark.parametrize("flt, message", [
    ({"column": "level", "equals": "1"}, "input.filter.equals: '1' does not match the type of column 'level' (int64)"),
    ({"column": "level", "equals": 1.5}, "input.filter.equals: 1.5 does not match the type of column 'level' (int64)"),
    ({"column": "lang", "one_of": ["en", 2]},
     "input.filter.one_of: ['en', 2] does not match the type of column 'lang' (string)"),
    ({"column": "lang", "equals": True}, "input.filter.equals: True does not match the type of column 'lang' (string)"),
    ({"column": "langs", "equals": "en"},
     "input.filter: column 'langs' not found in input (columns: qid, question, lang, level)"),
])
def test_filter_errors_name_key_and_column(tmp_path, flt, message):
    f = write_jsonl(tmp_path / "in.jsonl", questions(3))
    with pytest.raises(InputError) as ei:
        read_rows(spec(path=str(f), template=TEMPLATE, filter=flt))
    assert str(ei.value) == message


@pytest.mark.parametrize("flt, message", [
    ({"column": "lang"}, "input.filter on column 'lang': set exactly one of equals or one_of"),
    ({"column": "lang", "equals": "en", "one_of": ["de"]},
     "input.filter on column 'lang': set exactly one of equals or one_of"),
    ({"column": "lang", "one_of": []}, "input.filter on column 'lang': one_of must not be empty"),
    ({"column": "lang", "equal": "en"}, "unknown key 'input.filter.equal' (did you mean 'equals'?)"),
    ([{"column": "lang", "equals": "en"}, {"colum": "x", "equals": 1}],
     "unknown key 'input.filter[1].colum' (did you mean 'column'?)"),
    ({"column": "lang", "equals": ["en"]}, "input.filter.equals must be str or int or float or bool, got list ['en']"),
])
def test_filter_spec_errors(flt, message):
    with pytest.raises(JobSpecError) as ei:
        spec(path="x.jsonl", filter=flt)
    assert message in ei.value.problems


def test_shuffled_subset_is_reproducible_and_follows_filter_shuffle_limit(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", questions(60))
    sel = {"path": str(f), "id_column": "qid", "template": TEMPLATE, "limit": 10,
           "filter": {"column": "lang", "one_of": ["en", "de"]}}
    first, _ = read_rows(spec(**sel, shuffle_seed=1))
    again, _ = read_rows(spec(**sel, shuffle_seed=1))
    other, _ = read_rows(spec(**sel, shuffle_seed=2))
    assert first == again
    assert [r.id for r in first] != [r.id for r in other]
    assert len(first) == 10 and all(r.id in {f"q{i}" for i in range(60) if i % 3 != 2} for r in first)
    # limit takes the first rows of the whole filtered, shuffled order
    whole, _ = read_rows(spec(**{**sel, "limit": None}, shuffle_seed=1))
    assert len(whole) == 40 and whole[:10] == first
    assert [r.id for r in whole] != sorted((r.id for r in whole), key=lambda i: int(i[1:]))
    # ids and indices stay those of the input, whatever the selection
    assert all(r.id == f"q{r.index}" for r in whole)


def test_run_limit_caps_within_the_jobs_selection(tmp_path):
    """``pipeline run --limit N`` (read_rows' limit) takes the first N of the job's selection: with
    ``input.limit`` set, never more rows than the job selects."""
    f = write_jsonl(tmp_path / "in.jsonl", questions(60))
    sel = spec(path=str(f), id_column="qid", template=TEMPLATE, limit=3, shuffle_seed=3,
               filter={"column": "lang", "equals": "en"})
    job_rows, _ = read_rows(sel)
    assert len(job_rows) == 3
    assert read_rows(sel, 10)[0] == job_rows
    assert read_rows(sel, 2)[0] == job_rows[:2]
    assert len(read_rows(spec(path=str(f), id_column="qid", template=TEMPLATE), 10)[0]) == 10


def test_shuffle_without_id_column_keys_rows_by_input_position(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", questions(20))
    got, _ = read_rows(spec(path=str(f), template=TEMPLATE, shuffle_seed=5, filter={"column": "level", "equals": 1}))
    assert sorted(r.id for r in got) == [1, 5, 9, 13, 17]
    assert all(r.id == r.index and r.prompt == f"Question: What is {r.id} + {r.id}?\nAnswer:" for r in got)
    # rows appended to the input later do not move the rows already there relative to each other
    write_jsonl(f, questions(40))
    more, _ = read_rows(spec(path=str(f), template=TEMPLATE, shuffle_seed=5, filter={"column": "level", "equals": 1}))
    assert [r.id for r in more if r.id < 20] == [r.id for r in got]


def _validate_hub_job(tmp_path, env: dict) -> subprocess.CompletedProcess:
    """``pipeline validate`` of a job reading hub dataset someone/some-dataset, in environment ``env``."""
    job = {"model": "smollm2-135m-instruct", "output": {"dir": str(tmp_path / "out")},
           "input": {"dataset": {"name": "someone/some-dataset", "split": "test"}, "template": TEMPLATE}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    exe = Path(sys.executable).with_name("pipeline")
    return subprocess.run([str(exe), "validate", str(tmp_path / "job.yaml")], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_hub_dataset_offline_is_one_error_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = _validate_hub_job(tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: input.dataset 'someone/some-dataset' split 'test': cannot reach the Hugging Face hub "
        "(Couldn't reach 'someone/some-dataset' on the Hub (OfflineModeIsEnabled)); offline, use input.path "
        "with local files"]


def test_hub_dataset_unreachable_is_one_error_line_without_the_librarys_retries(tmp_path):
    """Not offline, but nothing answers at the hub's address: the connection check names it at once
    (huggingface_hub would retry 5 times over ~24 s, then datasets reports a LocalEntryNotFoundError)."""
    port = closed_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
    proc = _validate_hub_job(tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: input.dataset 'someone/some-dataset' split 'test': cannot reach the Hugging Face hub "
        f"(127.0.0.1:{port}: Connection refused); offline, use input.path with local files"]
    assert not (tmp_path / "out").exists()


def test_local_dataset_directory_reads_as_input_path_does(tmp_path):
    """A local ``input.dataset`` directory's split is read from the files ``datasets`` picks for it, in its order,
    by the reader ``input.path`` uses: a JSON string "5" stays a string beside a number, a CSV prompt "NA" stays
    text and an id 007 keeps its text (``datasets.load_dataset`` on the directory reads 5, null and 7)."""
    import datasets

    j = tmp_path / "jds"
    write_jsonl(j / "train.jsonl", [{"id": 1, "prompt": "Hi"}, {"id": 2, "prompt": "5"}, {"id": 3, "prompt": 5},
                                    {"id": 4, "prompt": "true"}, {"id": 5, "prompt": "null"}])
    got, _ = read_rows(spec(dataset={"name": str(j)}, id_column="id"))
    assert [(r.prompt, r.error) for r in got] == [
        ("Hi", None), ("5", None),
        (None, "input.prompt_column: column 'prompt' holds an integer (5), expected a string"), ("true", None),
        ("null", None)]
    assert got == read_rows(spec(path=str(j), id_column="id"))[0]
    c = tmp_path / "cds"
    (c / "data").mkdir(parents=True)
    (c / "data" / "train.csv").write_text("id,prompt\n007,NA\n8,None\n9,null\n", encoding="utf-8")
    (c / "data" / "test.csv").write_text("id,prompt\n1,N/A\n", encoding="utf-8")
    got, id_type = read_rows(spec(dataset={"name": str(c)}, id_column="id"))
    assert (id_type, [(r.id, r.prompt) for r in got]) == (pa.string(), [("007", "NA"), ("8", "None"), ("9", "null")])
    assert got == read_rows(spec(path=str(c / "data" / "train.csv"), id_column="id"))[0]
    got, _ = read_rows(spec(dataset={"name": str(c), "split": "test"}, id_column="id"))
    assert [(r.id, r.prompt) for r in got] == [(1, "N/A")]
    with pytest.raises(InputError) as ei:
        read_rows(spec(dataset={"name": str(c), "split": "validation"}))
    assert str(ei.value) == f"input.dataset {str(c)!r} split 'validation': no such split (splits: train, test)"
    o = tmp_path / "ods"  # rows in the order datasets reads the files
    write_jsonl(o / "x.jsonl", [{"prompt": "x0"}, {"prompt": "x1"}])
    write_jsonl(o / "sub" / "y.jsonl", [{"prompt": "y0"}])
    expected = [r["prompt"] for r in datasets.load_dataset(str(o), split="train", streaming=True)]
    assert [r.prompt for r in read_rows(spec(dataset={"name": str(o)}))[0]] == expected
    t = tmp_path / "tds"  # read by a builder option (sep) input.path has not: by datasets, as before
    t.mkdir()
    (t / "x.tsv").write_text("prompt\tn\nhi there\t1\n", encoding="utf-8")
    assert [r.prompt for r in read_rows(spec(dataset={"name": str(t)}))[0]] == ["hi there"]


def test_path_and_dataset_are_exclusive():
    with pytest.raises(JobSpecError, match="input: set path or dataset, not both"):
        spec(path="x.jsonl", dataset={"name": "a/b"})
    with pytest.raises(JobSpecError, match=r"unknown key 'input.dataset.splitt' \(did you mean 'split'\?\)"):
        spec(dataset={"name": "a/b", "splitt": "test"})


def test_template_failing_on_one_row_fails_only_that_row(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", questions(3))  # level 0, 1, 2
    got, _ = read_rows(spec(path=str(f), template="{{ question }} x{{ 12 // level }}"))
    assert got[0].prompt is None and got[0].error.startswith("input.template failed: ZeroDivisionError: ")
    assert [r.prompt for r in got[1:]] == ["What is 1 + 1? x12", "What is 2 + 2? x6"]


def test_template_raising_on_every_row_is_a_job_error(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", questions(3))
    with pytest.raises(InputError) as ei:
        read_rows(spec(path=str(f), template="{{ question + level }}"))
    assert str(ei.value).startswith("input.template raised on every row (3); row 0: TypeError: ")
    assert "\n" not in str(ei.value)


def test_template_printing_null_on_every_row_fails_rows_not_the_job(tmp_path):
    rows = questions(2)
    for r in rows:
        r["lang"] = None
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    got, _ = read_rows(spec(path=str(f), template="{{ question }} {{ lang }}"))
    assert [r.error for r in got] == ["input.template printed a null value (null in this row: lang)"] * 2


def test_rows_with_messages_do_not_use_the_template(tmp_path):
    rows = questions(3)
    for r in rows:
        r["question"] = None
        r["msgs"] = [{"role": "user", "content": "hi"}]
    rows[2]["question"], rows[2]["msgs"] = "What?", None
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    got, _ = read_rows(spec(path=str(f), template="{{ question }}", messages_column="msgs"))
    assert [r.error for r in got] == [None, None, None]
    assert got[2].prompt == "What?" and got[0].messages == [{"role": "user", "content": "hi"}]
    # the template raises on rows that use messages, and on no row that uses it: not a job error
    got, _ = read_rows(spec(path=str(f), template="{{ question.upper() }}", messages_column="msgs"))
    assert [r.error for r in got] == [None, None, None] and got[2].prompt == "WHAT?"
