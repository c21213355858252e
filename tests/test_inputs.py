"""Reading input rows from Parquet: pipeline.inputs.read_rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs import InputError, InputRow, read_rows
from pipeline.jobspec import InputSpec

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def write(path, columns: dict, schema: pa.Schema | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def test_single_file(tmp_path):
    f = write(tmp_path / "in.parquet", {"prompt": ["a", "b", "c"]})
    rows, id_type = read_rows(InputSpec(path=str(f)))
    assert rows == [
        InputRow(index=0, id=0, prompt="a", messages=None),
        InputRow(index=1, id=1, prompt="b", messages=None),
        InputRow(index=2, id=2, prompt="c", messages=None),
    ]
    assert id_type == pa.int64()


def test_directory_of_files_in_sorted_path_order(tmp_path):
    d = tmp_path / "data"
    # Written in reverse order so that creation order differs from sorted order.
    write(d / "b.parquet", {"prompt": ["b0", "b1"]})
    write(d / "a.parquet", {"prompt": ["a0", "a1", "a2"]})
    (d / "notes.txt").write_text("not parquet")
    rows, _ = read_rows(InputSpec(path=str(d)))
    assert [r.prompt for r in rows] == ["a0", "a1", "a2", "b0", "b1"]
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert [r.id for r in rows] == [0, 1, 2, 3, 4]


def test_directory_is_searched_recursively(tmp_path):
    d = tmp_path / "data"
    write(d / "a.parquet", {"prompt": ["a0"]})
    write(d / "sub" / "b.parquet", {"prompt": ["b0"]})
    rows, _ = read_rows(InputSpec(path=str(d)))
    assert [r.prompt for r in rows] == ["a0", "b0"]


def test_glob(tmp_path):
    write(tmp_path / "part-2.parquet", {"prompt": ["p2"]})
    write(tmp_path / "part-1.parquet", {"prompt": ["p1"]})
    write(tmp_path / "other.parquet", {"prompt": ["other"]})
    rows, _ = read_rows(InputSpec(path=str(tmp_path / "part-*.parquet")))
    assert [r.prompt for r in rows] == ["p1", "p2"]


def test_limit_from_spec_and_argument(tmp_path):
    d = tmp_path / "data"
    write(d / "a.parquet", {"prompt": ["a0", "a1", "a2"]})
    write(d / "b.parquet", {"prompt": ["b0", "b1", "b2"]})
    rows, _ = read_rows(InputSpec(path=str(d), limit=4))
    assert [r.prompt for r in rows] == ["a0", "a1", "a2", "b0"]
    rows, _ = read_rows(InputSpec(path=str(d), limit=4), limit=2)
    assert [r.prompt for r in rows] == ["a0", "a1"]
    rows, _ = read_rows(InputSpec(path=str(d)), limit=100)
    assert len(rows) == 6


def test_limit_applies_before_duplicate_check(tmp_path):
    f = write(tmp_path / "in.parquet", {"id": [1, 2, 1], "prompt": ["a", "b", "c"]})
    rows, _ = read_rows(InputSpec(path=str(f), id_column="id"), limit=2)
    assert [r.id for r in rows] == [1, 2]


@pytest.mark.parametrize("name", ["missing.parquet", "missing_dir", "nomatch-*.parquet"])
def test_missing_path(tmp_path, name):
    with pytest.raises(InputError, match=r"no input files found \(.parquet, .jsonl, .json or .csv\)"):
        read_rows(InputSpec(path=str(tmp_path / name)))


def test_not_parquet(tmp_path):
    f = tmp_path / "junk.parquet"
    f.write_bytes(b"this is not parquet")
    with pytest.raises(InputError, match="not readable as Parquet"):
        read_rows(InputSpec(path=str(f)))


@pytest.mark.parametrize(
    "spec_kwargs, column, key",
    [
        ({"prompt_column": "text"}, "text", "input.prompt_column"),
        ({"id_column": "uid"}, "uid", "input.id_column"),
        ({"messages_column": "conv"}, "conv", "input.messages_column"),
    ],
)
def test_missing_column_names_column_and_key(tmp_path, spec_kwargs, column, key):
    f = write(tmp_path / "in.parquet", {"prompt": ["a"]})
    with pytest.raises(InputError) as ei:
        read_rows(InputSpec(path=str(f), **spec_kwargs))
    msg = str(ei.value)
    assert key in msg
    assert repr(column) in msg
    assert "not found" in msg


def test_missing_column_in_second_file(tmp_path):
    d = tmp_path / "data"
    write(d / "a.parquet", {"prompt": ["a0"]})
    write(d / "b.parquet", {"text": ["b0"]})
    with pytest.raises(InputError) as ei:
        read_rows(InputSpec(path=str(d)))
    msg = str(ei.value)
    assert "input.prompt_column" in msg and "'prompt'" in msg and "b.parquet" in msg


def test_wrong_prompt_column_type(tmp_path):
    f = write(tmp_path / "in.parquet", {"prompt": [1, 2]})
    with pytest.raises(InputError) as ei:
        read_rows(InputSpec(path=str(f)))
    msg = str(ei.value)
    assert "input.prompt_column" in msg and "'prompt'" in msg
    assert "int64" in msg and "expected string" in msg


def test_wrong_id_column_type(tmp_path):
    f = write(tmp_path / "in.parquet", {"id": [0.5, 1.5], "prompt": ["a", "b"]})
    with pytest.raises(InputError, match=r"input\.id_column.*double.*integer or string"):
        read_rows(InputSpec(path=str(f), id_column="id"))


def test_wrong_messages_column_type(tmp_path):
    f = write(tmp_path / "in.parquet", {"prompt": ["a"], "messages": [["hi"]]})
    with pytest.raises(InputError, match=r"input\.messages_column.*'messages'"):
        read_rows(InputSpec(path=str(f), messages_column="messages"))


def test_duplicate_int_ids_are_named(tmp_path):
    f = write(tmp_path / "in.parquet", {"id": [10, 11, 10, 12, 12, 12], "prompt": list("abcdef")})
    with pytest.raises(InputError) as ei:
        read_rows(InputSpec(path=str(f), id_column="id"))
    msg = str(ei.value)
    assert "input.id_column 'id'" in msg
    assert "duplicate ids 10, 12" in msg
    assert "11" not in msg


def test_duplicate_string_ids_across_files_are_named(tmp_path):
    d = tmp_path / "data"
    write(d / "a.parquet", {"id": ["x", "y"], "prompt": ["a", "b"]})
    write(d / "b.parquet", {"id": ["z", "x"], "prompt": ["c", "d"]})
    with pytest.raises(InputError) as ei:
        read_rows(InputSpec(path=str(d), id_column="id"))
    msg = str(ei.value)
    assert "duplicate ids 'x'" in msg
    assert "'y'" not in msg and "'z'" not in msg


def test_null_id_is_an_error(tmp_path):
    f = write(tmp_path / "in.parquet", {"id": ["a", None, "c"], "prompt": ["1", "2", "3"]})
    with pytest.raises(InputError) as ei:
        read_rows(InputSpec(path=str(f), id_column="id"))
    msg = str(ei.value)
    assert "null id" in msg and "row(s) 1" in msg


def test_without_id_column_ids_are_row_indexes(tmp_path):
    f = write(tmp_path / "in.parquet", {"id": ["x", "y"], "prompt": ["a", "b"]})
    rows, id_type = read_rows(InputSpec(path=str(f)))
    assert [r.id for r in rows] == [0, 1]
    assert [r.index for r in rows] == [0, 1]
    assert id_type == pa.int64()


def test_int_id_column(tmp_path):
    schema = pa.schema([("id", pa.int32()), ("prompt", pa.string())])
    f = write(tmp_path / "in.parquet", {"id": [7, 3, 5], "prompt": ["a", "b", "c"]}, schema=schema)
    rows, id_type = read_rows(InputSpec(path=str(f), id_column="id"))
    assert [r.id for r in rows] == [7, 3, 5]
    assert [r.index for r in rows] == [0, 1, 2]
    assert id_type == pa.int64()


def test_string_id_column(tmp_path):
    f = write(tmp_path / "in.parquet", {"id": ["q1", "q2"], "prompt": ["a", "b"]})
    rows, id_type = read_rows(InputSpec(path=str(f), id_column="id"))
    assert [r.id for r in rows] == ["q1", "q2"]
    assert id_type == pa.string()


def test_messages_column_reads_into_dicts(tmp_path):
    conv = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    f = write(
        tmp_path / "in.parquet",
        {"prompt": ["p0", None], "messages": [None, conv]},
        schema=pa.schema([("prompt", pa.string()), ("messages", MESSAGES_TYPE)]),
    )
    rows, _ = read_rows(InputSpec(path=str(f), messages_column="messages"))
    assert rows[0].prompt == "p0" and rows[0].messages is None
    assert rows[1].prompt is None
    assert rows[1].messages == conv
    assert all(isinstance(m, dict) for m in rows[1].messages)


def test_messages_only_input(tmp_path):
    conv = [{"role": "user", "content": "hello"}]
    f = write(tmp_path / "in.parquet", {"messages": [conv]}, schema=pa.schema([("messages", MESSAGES_TYPE)]))
    rows, _ = read_rows(InputSpec(path=str(f), prompt_column=None, messages_column="messages"))
    assert rows == [InputRow(index=0, id=0, prompt=None, messages=conv)]


def test_null_prompt_is_passed_through(tmp_path):
    # A null prompt is a per-row problem (prompts.build_prompt), not an input error.
    f = write(tmp_path / "in.parquet", {"prompt": ["a", None]})
    rows, _ = read_rows(InputSpec(path=str(f)))
    assert [r.prompt for r in rows] == ["a", None]


def test_incompatible_schemas_across_files(tmp_path):
    d = tmp_path / "data"
    write(d / "a.parquet", {"id": [1], "prompt": ["a"]})
    write(d / "b.parquet", {"id": [[1, 2]], "prompt": ["b"]})
    with pytest.raises(InputError, match="incompatible schemas"):
        read_rows(InputSpec(path=str(d), id_column="id"))


def test_id_column_may_double_as_prompt_column(tmp_path):
    path = tmp_path / "same.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    rows, id_type = read_rows(InputSpec(path=str(path), id_column="text", prompt_column="text"))
    assert [(r.id, r.prompt) for r in rows] == [("a", "a"), ("b", "b")] and id_type == pa.string()


def test_an_override_column_in_only_some_parquet_files_is_read_from_those(tmp_path):
    """The first file used to decide the override columns: a max_tokens column only in a later file was
    ignored (its rows silently got the job's max_tokens), and one only in the first file stopped the job."""
    d = tmp_path / "data"
    write(d / "1.parquet", {"id": ["a"], "prompt": ["x"]})
    write(d / "2.parquet", {"id": ["b"], "prompt": ["y"], "max_tokens": [1]})
    rows, _ = read_rows(InputSpec(path=str(d), id_column="id"))
    assert [(r.id, r.overrides) for r in rows] == [("a", {}), ("b", {"max_tokens": 1})]
    e = tmp_path / "other"
    write(e / "1.parquet", {"id": ["a"], "prompt": ["x"], "max_tokens": [1]})
    write(e / "2.parquet", {"id": ["b"], "prompt": ["y"]})
    rows, _ = read_rows(InputSpec(path=str(e), id_column="id"))
    assert [(r.id, r.overrides) for r in rows] == [("a", {"max_tokens": 1}), ("b", {})]


def test_an_id_past_int64_is_an_error_before_the_run(tmp_path):
    """A uint64 id >= 2**63 passed validate and stopped the run at its first commit (OverflowError)."""
    f = write(tmp_path / "in.parquet", {"id": pa.array([1, 2**63 + 5], pa.uint64()), "prompt": ["x", "y"]})
    with pytest.raises(InputError, match=r"^input.id_column 'id': id 9223372036854775813 in row 1 does not fit a "
                                         r"64-bit signed integer"):
        read_rows(InputSpec(path=str(f), id_column="id"))


def test_a_filter_value_past_the_column_type_is_one_line(tmp_path):
    from pipeline.jobspec import FilterSpec

    f = write(tmp_path / "in.parquet", {"n": [1, 2], "prompt": ["x", "y"]})
    with pytest.raises(InputError, match=r"^input.filter.equals: 99999999999999999999 does not match the type of "
                                         r"column 'n' \(int64\)$"):
        read_rows(InputSpec(path=str(f), filter=FilterSpec(column="n", equals=99999999999999999999)))


def test_csv_text_that_pandas_would_read_as_null_stays_text(tmp_path):
    """In the columns read as text (prompt, template, string filters) only an empty cell is null; pandas'
    default also read NA, None, N/A, null, ... as null (a prompt "None" failed its row, a filter on "NA" matched
    nothing). A number column keeps pandas' null spellings: NA there is a missing override, not text that
    would make the column strings and refuse the job."""
    from pipeline.jobspec import FilterSpec

    f = tmp_path / "in.csv"
    f.write_text("id,prompt,country,max_tokens\n1,hello,NA,3\n2,None,US,NA\n3,N/A,null,\n4,,nan,N/A\n",
                 encoding="utf-8")
    rows, _ = read_rows(InputSpec(path=str(f), id_column="id"))
    assert [(r.id, r.prompt, r.overrides) for r in rows] == [
        (1, "hello", {"max_tokens": 3}), (2, "None", {}), (3, "N/A", {}), (4, None, {})]
    rows, _ = read_rows(InputSpec(path=str(f), id_column="id", filter=FilterSpec(column="country", equals="NA")))
    assert [r.id for r in rows] == [1]
    rows, _ = read_rows(InputSpec(path=str(f), id_column="id", template="{{ prompt }} in {{ country }}"))
    assert [r.prompt for r in rows[:3]] == ["hello in NA", "None in US", "N/A in null"]


def test_a_column_only_in_a_later_jsonl_file_is_read(tmp_path):
    """datasets takes the columns of every JSON file from the first one: a max_tokens column only in the second
    file stopped the job with "not readable: Couldn't cast" and no file named."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "1.jsonl").write_text('{"id": "a", "prompt": "x"}\n', encoding="utf-8")
    (d / "2.jsonl").write_text('{"id": "b", "prompt": "y", "max_tokens": 1}\n', encoding="utf-8")
    rows, _ = read_rows(InputSpec(path=str(d), id_column="id"))
    assert [(r.id, r.prompt, r.overrides) for r in rows] == [("a", "x", {}), ("b", "y", {"max_tokens": 1})]
    (d / "1.jsonl").write_text('{"id": "a", "prompt": "x", "extra": "text"}\n', encoding="utf-8")
    (d / "2.jsonl").write_text('{"id": "b", "prompt": "y", "max_tokens": 1, "extra": 5}\n', encoding="utf-8")
    rows, _ = read_rows(InputSpec(path=str(d), id_column="id"))  # a column the job does not read may differ
    assert [(r.id, r.prompt, r.overrides) for r in rows] == [("a", "x", {}), ("b", "y", {"max_tokens": 1})]
    (d / "3.jsonl").write_text('{"id": "c", "prompt": "z", "max_tokens": [1, 2]}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"3.jsonl does not fit the files before it"):
        read_rows(InputSpec(path=str(d), id_column="id"))
