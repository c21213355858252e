"""Bad input files: a CSV row with an extra field, JSON values of mixed types, empty inputs and selections,
CSV ids with an empty cell, and the one error line the CLI prints for them (no library log lines).
``pipeline.inputs.read_rows`` on real files, and ``pipeline validate`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.inputs import InputError, read_rows
from pipeline.prompts import row_messages
from pipeline.errors import RowError

from test_input_selection import spec, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def error_of(**inp) -> str:
    with pytest.raises(InputError) as ei:
        read_rows(spec(**inp))
    assert "\n" not in str(ei.value)
    return str(ei.value)


def validate(tmp_path: Path, inp: dict) -> subprocess.CompletedProcess:
    job = {"model": "smollm2-135m-instruct", "input": inp, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    exe = Path(sys.executable).with_name("pipeline")
    return subprocess.run([str(exe), "validate", "job.yaml"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)


# --- CSV rows with more fields than the header ----------------------------------------------------------


def test_csv_first_row_with_an_extra_field_is_an_error_not_shifted_columns(tmp_path):
    f = tmp_path / "comma.csv"
    f.write_text("id,prompt\np1,Hello, how are you?\np2,Tell me a joke\n", encoding="utf-8")
    assert error_of(path=str(f), id_column="id") == (
        f"input.path {str(f)!r} (CSV): not readable: {f}: Expected 2 fields in line 2, saw 3")
    # a later row: pandas' own error, the same words
    f.write_text("id,prompt\np1,Hello\np2,Tell me, a joke\n", encoding="utf-8")
    assert error_of(path=str(f), id_column="id").endswith("Expected 2 fields in line 3, saw 3")


def test_csv_first_row_check_names_the_file_and_skips_blank_lines(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.csv").write_text("id,prompt\np1,Hi\n", encoding="utf-8")
    (d / "b.csv").write_text("\nid,prompt\n\np2,Hi,\"there\"\n", encoding="utf-8")
    assert error_of(path=str(d), id_column="id") == (
        f"input.path {str(d)!r} (CSV): not readable: {d / 'b.csv'}: Expected 2 fields in line 4, saw 3")


def test_csv_trailing_commas_still_read(tmp_path):
    f = tmp_path / "in.csv"
    f.write_text('id,prompt\np1,"Hi, you",\np2,Yo,\n', encoding="utf-8")
    rows, id_type = read_rows(spec(path=str(f), id_column="id"))
    assert id_type == pa.string()
    assert [(r.id, r.prompt) for r in rows] == [("p1", "Hi, you"), ("p2", "Yo")]


# --- JSON values of mixed types -------------------------------------------------------------------------


def test_jsonl_messages_that_are_not_a_list_fail_their_row(tmp_path):
    ok = [{"role": "user", "content": "x"}]
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi", "messages": ok},
                                             {"id": "b", "prompt": "Yo", "messages": "notalist"},
                                             {"id": "c", "prompt": "Ho", "messages": None}])
    rows, _ = read_rows(spec(path=str(f), id_column="id", messages_column="messages"))
    assert [(r.id, r.messages, r.error) for r in rows] == [
        ("a", ok, None),
        ("b", None, 'input.messages_column: column \'messages\' holds a string ("notalist"), expected a list of '
                    'messages'),
        ("c", None, None)]
    assert rows[1].prompt is None and rows[2].prompt == "Ho"


def test_jsonl_message_with_a_non_string_content_fails_its_row(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "x"}]},
                                             {"id": "b", "messages": [{"role": "user", "content": 5}]},
                                             {"id": "c", "messages": [{"role": "user"}]}])
    s = spec(path=str(f), id_column="id", prompt_column=None, messages_column="messages")
    rows, _ = read_rows(s)
    assert all(r.error is None for r in rows)
    assert row_messages(rows[0], s) == ("x", [{"role": "user", "content": "x"}])
    for row, message in [(rows[1], "messages[0] needs string 'role' and 'content'; 'content' is an integer (5)"),
                         (rows[2], "messages[0] needs string 'role' and 'content'")]:
        with pytest.raises(RowError) as ei:
            row_messages(row, s)
        assert str(ei.value) == f"input column 'messages': {message}"


def test_jsonl_prompt_of_another_type_fails_its_row(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi"}, {"id": "b", "prompt": 5},
                                             {"id": "c", "prompt": None}, {"id": "d", "prompt": ["x"]}])
    rows, _ = read_rows(spec(path=str(f), id_column="id"))
    assert [(r.id, r.prompt, r.error) for r in rows] == [
        ("a", "Hi", None),
        ("b", None, "input.prompt_column: column 'prompt' holds an integer (5), expected a string"),
        ("c", None, None),  # null: prompts.build_prompt says so
        ("d", None, 'input.prompt_column: column \'prompt\' holds a list (["x"]), expected a string')]


def test_a_row_with_messages_does_not_use_its_bad_prompt(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"prompt": 5, "messages": [{"role": "user", "content": "x"}]},
                                             {"prompt": "Hi", "messages": None}])
    rows, _ = read_rows(spec(path=str(f), messages_column="messages"))
    assert [r.error for r in rows] == [None, None]
    assert rows[0].messages == [{"role": "user", "content": "x"}] and rows[1].prompt == "Hi"


def test_column_wholly_of_another_type_still_stops_the_job(tmp_path):
    f = write_jsonl(tmp_path / "ints.jsonl", [{"prompt": 1}, {"prompt": 2}])
    assert error_of(path=str(f)) == "input.prompt_column: column 'prompt' has type int64, expected string"
    f = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": 1}, {"prompt": [2]}])  # mixed, but no string
    assert error_of(path=str(f)) == "input.prompt_column: column 'prompt' holds integers and lists, expected a string"
    f = write_jsonl(tmp_path / "msgs.jsonl", [{"messages": "a"}, {"messages": 3}])
    assert error_of(path=str(f), prompt_column=None, messages_column="messages") == (
        "input.messages_column: column 'messages' holds strings and integers, expected a list of messages")
    pq.write_table(pa.table({"prompt": [1, 2]}), tmp_path / "in.parquet")
    assert error_of(path=str(tmp_path / "in.parquet")) == (
        "input.prompt_column: column 'prompt' has type int64, expected string")


def test_jsonl_ids_of_two_kinds_are_a_job_error(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi"}, {"id": 2, "prompt": "Yo"}])
    assert error_of(path=str(f), id_column="id") == (
        "input.id_column: column 'id' holds strings and integers, expected integer or string (the same in every row)")


def test_template_and_filter_read_mixed_json_values_decoded(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"q": "Why?", "tag": "a"}, {"q": 5, "tag": 1}, {"q": [1], "tag": "a"}])
    rows, _ = read_rows(spec(path=str(f), template="Q: {{ q }}"))
    assert [r.prompt for r in rows] == ["Q: Why?", "Q: 5", "Q: [1]"]
    rows, _ = read_rows(spec(path=str(f), template="Q: {{ q }}", filter={"column": "tag", "equals": "a"}))
    assert [r.index for r in rows] == [0, 2]
    rows, _ = read_rows(spec(path=str(f), template="Q: {{ q }}", filter={"column": "tag", "one_of": [1, "b"]}))
    assert [r.index for r in rows] == [1]


def test_strings_that_read_as_json_keep_their_type_beside_other_types(tmp_path):
    """``datasets`` writes a string that is itself JSON text (``"5"``, ``"true"``, ``"null"``) unquoted in a
    mixed-type column, as the number, boolean or null: the values are taken from the file as ``json`` reads it,
    so ``"5"`` stays a string (a prompt, a template's text, a message's content) and only the real 5 fails."""
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Hi", "ans": "true"}, {"id": 2, "prompt": "5", "ans": 5},
                                             {"id": 3, "prompt": 5, "ans": "null"}, {"id": 4, "prompt": "true", "ans": "1.50"}])
    rows, _ = read_rows(spec(path=str(f), id_column="id"))
    assert [(r.prompt, r.error) for r in rows] == [
        ("Hi", None), ("5", None),
        (None, "input.prompt_column: column 'prompt' holds an integer (5), expected a string"), ("true", None)]
    rows, _ = read_rows(spec(path=str(f), id_column="id", template="A: {{ ans }}"))
    assert [r.prompt for r in rows] == ["A: true", "A: 5", "A: null", "A: 1.50"]
    chat = [{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "42"}]},
            {"id": "b", "messages": [{"role": "user", "content": 5}]}]
    f = write_jsonl(tmp_path / "chat.jsonl", chat)
    s = spec(path=str(f), id_column="id", prompt_column=None, messages_column="messages")
    rows, _ = read_rows(s)
    assert row_messages(rows[0], s) == ("x", chat[0]["messages"])
    with pytest.raises(RowError, match=r"'content' is an integer \(5\)"):
        row_messages(rows[1], s)
    f.unlink()
    (tmp_path / "chat.json").write_text(json.dumps(chat))  # one JSON array: the same
    rows, _ = read_rows(spec(path=str(tmp_path / "chat.json"), id_column="id", prompt_column=None,
                             messages_column="messages"))
    assert row_messages(rows[0], s) == ("x", chat[0]["messages"])


# --- empty inputs and selections ------------------------------------------------------------------------


@pytest.mark.parametrize("name, write", [
    ("empty.parquet", lambda p: pq.write_table(pa.table({"id": pa.array([], pa.string()),
                                                         "prompt": pa.array([], pa.string())}), p)),
    ("empty.jsonl", lambda p: p.write_text("")),
    ("blank.jsonl", lambda p: p.write_text("\n\n")),
    ("empty.csv", lambda p: p.write_text("")),
    ("headeronly.csv", lambda p: p.write_text("id,prompt\n")),
    ("empty.json", lambda p: p.write_text("[]")),
])
def test_an_input_with_no_rows_is_an_error(tmp_path, name, write):
    write(tmp_path / name)
    assert error_of(path=str(tmp_path / name), id_column="id") == f"input.path {str(tmp_path / name)!r}: no rows"


def test_a_filter_matching_no_row_is_an_error(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"], "lang": ["en", "en", "de"]}),
                   tmp_path / "in.parquet")
    assert error_of(path=str(tmp_path / "in.parquet"), id_column="id", filter={"column": "lang", "equals": "fr"}) == (
        "input.filter: no row matches (of 3 rows)")


def test_run_on_an_empty_input_exits_2_before_writing(tmp_path):
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}),
                   tmp_path / "in.parquet")
    job = {"model": "smollm2-135m-instruct", "input": {"path": "in.parquet", "id_column": "id"},
           "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    exe = Path(sys.executable).with_name("pipeline")
    proc = subprocess.run([str(exe), "run", "job.yaml", "--no-progress"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "error: input.path 'in.parquet': no rows\n")
    assert not (tmp_path / "out").exists()


# --- CSV ids with an empty cell -------------------------------------------------------------------------


def test_csv_integer_ids_with_an_empty_cell_are_a_null_id(tmp_path):
    f = tmp_path / "in.csv"
    f.write_text("id,prompt,lang\n1,Hi,en\n2,Yo,en\n,Ho,de\n", encoding="utf-8")
    assert error_of(path=str(f), id_column="id") == "input.id_column 'id': null id in row(s) 2"
    rows, id_type = read_rows(spec(path=str(f), id_column="id", filter={"column": "lang", "equals": "en"}))
    assert id_type == pa.int64() and [r.id for r in rows] == [1, 2]
    f.write_text("id,prompt\n1.5,Hi\n,Yo\n", encoding="utf-8")  # not integers: string ids, one null
    assert error_of(path=str(f), id_column="id") == "input.id_column 'id': null id in row(s) 1"


def test_csv_ids_keep_their_text_unless_every_one_is_a_plain_integer(tmp_path):
    """pandas reads 007 as 7 (the output's id would not be the input's, and 007 and 7 would be one id): ids are
    read as written, and are integers only where every id is one as written (7, -12)."""
    f = tmp_path / "in.csv"
    for text, id_type, ids in (("id,prompt\n007,Hi\n8,Yo\n", pa.string(), ["007", "8"]),
                               ("id,prompt\n1.5,Hi\n2,Yo\n", pa.string(), ["1.5", "2"]),
                               ("id,prompt\n7,Hi\n-12,Yo\n", pa.int64(), [7, -12])):
        f.write_text(text, encoding="utf-8")
        rows, got = read_rows(spec(path=str(f), id_column="id"))
        assert (got, [r.id for r in rows]) == (id_type, ids), text
    f.write_text("id,prompt\n007,Hi\n7,Yo\n", encoding="utf-8")
    assert [r.id for r in read_rows(spec(path=str(f), id_column="id"))[0]] == ["007", "7"]  # two ids, not one
    f.write_text("id,prompt,lang\n007,Hi,en\nNA,Yo,de\n", encoding="utf-8")  # a null spelling beside it
    rows, got = read_rows(spec(path=str(f), id_column="id", filter={"column": "lang", "equals": "en"}))
    assert (got, [r.id for r in rows]) == (pa.string(), ["007"])
    f.write_text("id,prompt,lang\n7,Hi,en\nNA,Yo,de\n", encoding="utf-8")
    rows, got = read_rows(spec(path=str(f), id_column="id", filter={"column": "lang", "equals": "en"}))
    assert (got, [r.id for r in rows]) == (pa.int64(), [7])
    assert error_of(path=str(f), id_column="id") == "input.id_column 'id': null id in row(s) 1"


# --- one error line, library log records once -----------------------------------------------------------


@pytest.mark.parametrize("name, text, line", [
    ("bad.jsonl", '{"id": "a", "prompt": "x"}\n{not json\n',
     "error: input.path 'bad.jsonl' (JSON): not readable: JSON parse error: Missing a name for object member. "
     "in row 1"),
    ("comma.csv", "id,prompt\np1,Hello, how are you?\n", "error: input.path 'comma.csv' (CSV): not readable: "
     "comma.csv: Expected 2 fields in line 2, saw 3"),
    ("later.csv", "id,prompt\np1,Hello\np2,Hello, you\n", "error: input.path 'later.csv' (CSV): not readable: "
     "Error tokenizing data. C error: Expected 2 fields in line 3, saw 3"),
])
def test_cli_prints_one_error_line_for_unreadable_input(tmp_path, name, text, line):
    (tmp_path / name).write_text(text, encoding="utf-8")
    proc = validate(tmp_path, {"path": name, "id_column": "id"})
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [line])


def test_cli_library_log_records_print_once(tmp_path):
    """datasets and huggingface_hub have handlers of their own: a record must not also reach the root's."""
    script = ("import logging\nfrom pipeline.cli import main\nmain.callback()\n"
              "import datasets, huggingface_hub\n"
              "logging.getLogger('datasets.builder').warning('from datasets')\n"
              "logging.getLogger('huggingface_hub.utils._http').warning('from the hub')\n"
              "logging.getLogger('pipeline').warning('from us')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["from datasets", "from the hub", "WARNING: from us"]


def test_mixed_json_values_are_reread_only_as_far_as_the_rows_read(tmp_path):
    """`--limit` reads the first rows of a JSON Lines file; re-reading its mixed columns stops there too (the
    rest of a large file is not parsed: here it is not even JSON)."""
    from pipeline.inputs import _raw_json_rows

    f = tmp_path / "in.jsonl"
    f.write_text('{"p": "5"}\n{"p": 5}\nnot json at all\n', encoding="utf-8")
    assert _raw_json_rows([f], 2) == [{"p": "5"}, {"p": 5}]
    assert _raw_json_rows([f], 3) is None
    (tmp_path / "arr.json").write_text('[\n {"p": "5"},\n {"p": 5}\n]\n', encoding="utf-8")  # one array
    assert _raw_json_rows([tmp_path / "arr.json"], 1) == [{"p": "5"}, {"p": 5}]
