"""``input.template`` rendering (pipeline.row_template, pipeline.inputs): nulls, jinja globals, value text,
through pipeline.inputs.read_rows on small Parquet / CSV files."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs import read_rows
from pipeline.jobspec import job_from_dict


def spec(**inp):
    """A validated InputSpec, as the job file would give it."""
    return job_from_dict({"input": inp, "output": {"dir": "o"}}).input


def render(tmp_path, template: str, table: pa.Table) -> list[tuple[str | None, str | None]]:
    """(prompt, error) per row of ``table`` rendered with ``template``."""
    pq.write_table(table, tmp_path / "in.parquet")
    rows, _ = read_rows(spec(path=str(tmp_path / "in.parquet"), template=template))
    return [(r.prompt, r.error) for r in rows]


def nulls() -> pa.Table:
    """Row 0 has values, row 1 a null q and i (and a struct with a null field)."""
    return pa.table({"q": pa.array(["x", None]), "i": pa.array([3, None], pa.int32()),
                     "st": pa.array([{"k": "v"}, {"k": None}], pa.struct([("k", pa.string())]))})


@pytest.mark.parametrize("template, first", [
    ("{{ q | trim }}", "x"),
    ('{{ "x" ~ q }}', "xx"),
    ("{{ q|string }}", "x"),
    ('{{ [q, "z"]|join(",") }}', "x,z"),
    ('{{ "%s" % q }}', "x"),
    ('{{ "{}".format(q) }}', "x"),
    ("{% set q = q | upper %}{{ q }}", "X"),
    ("{{ q | replace('x', 'y') }}", "y"),
    ("{{ q | e }}", "x"),
    ("{{ q | tojson }}", '"x"'),
    ("{{ q | length }}", "1"),
    ("{{ q.upper() }}", "X"),
    ('{{ q | default("d") }}', "x"),  # without boolean=true a null passes default, as in jinja, and fails printed
])
def test_a_null_used_as_text_fails_its_row_naming_the_column(tmp_path, template, first):
    """A bare None would print "None", "NONE", "null" or 0 through these, a wrong prompt and no error."""
    assert render(tmp_path, template, nulls()) == [
        (first, None), (None, "input.template printed a null value (null in this row: q)")]


def test_a_null_integer_used_as_a_number_fails_its_row(tmp_path):
    assert render(tmp_path, "{{ i | int }}|{{ q }}", nulls())[1] == (
        None, "input.template printed a null value (null in this row: i)")
    assert render(tmp_path, "{{ i + 1 }}", nulls()) == [
        ("4", None), (None, "input.template printed a null value (null in this row: i)")]


@pytest.mark.parametrize("template, second", [
    ("{% if q %}Q: {{ q }}{% endif %}.", "."),
    ("{% if q is none %}none{% else %}{{ q }}{% endif %}", "none"),
    ("{% if q is not none %}{{ q }}{% else %}none{% endif %}", "none"),
    ("{{ q == none }} {{ q is defined }}", "True True"),
    ('{{ q | default("d", true) }}', "d"),
    ('{{ q or "d" }}', "d"),
    ('{{ q if q else "d" }}', "d"),
    ("{{ q is sameas none }} {{ q is iterable }}", "True False"),  # as for None (iterable raised, sameas False)
    ('{{ {"q": q, "i": i} | tojson }}', '{"q": null, "i": null}'),  # in JSON the template builds, a null is null
    ('{{ [q, "z"] | tojson }}', '[null, "z"]'),
])
def test_a_null_tested_as_null_still_works(tmp_path, template, second):
    assert render(tmp_path, template, nulls())[1] == (second, None)


def test_a_printed_null_names_the_column_printed_not_every_null_of_the_row(tmp_path):
    """Row 1 has q and i null; only q is printed. A null struct field is named by its path."""
    assert render(tmp_path, "{{ q }}{% if i %}{{ i }}{% endif %}", nulls())[1] == (
        None, "input.template printed a null value (null in this row: q)")
    assert render(tmp_path, "{{ st.k }}{% if q %}{% endif %}", nulls())[1] == (
        None, "input.template printed a null value (null in this row: st.k)")


def test_tojson_keeps_text_as_chat_templates_do(tmp_path):
    """jinja's own tojson is HTML-safe (\\u003c, \\u0026, \\u0027) and ASCII-only (\\u00e9)."""
    table = pa.table({"d": pa.array([{"a": "x<y & it's é"}])})
    assert render(tmp_path, "{{ d | tojson }}", table) == [("{\"a\": \"x<y & it's é\"}", None)]



def test_a_float32_prints_its_shortest_text_and_a_float64_is_unchanged(tmp_path):
    table = pa.table({"f": pa.array([0.1, 1e20, 2.5], pa.float32()),
                      "fl": pa.array([[0.1], [], None], pa.list_(pa.float32())),
                      "st": pa.array([{"w": 0.1}] * 3, pa.struct([("w", pa.float32())])),
                      "d": pa.array([0.1, 0.10000000149011612, 3.0], pa.float64())})
    got = render(tmp_path, "{{ f }} {{ fl }} {{ st.w }} {{ d }}", table)
    assert got == [("0.1 [0.1] 0.1 0.1", None), ("1e+20 [] 0.1 0.10000000149011612", None),
                   (None, "input.template printed a null value (null in this row: fl)")]


def test_a_column_named_like_a_jinja_global_is_read_as_the_column(tmp_path):
    """It was never read: the template printed the global, ``<function safe_range at 0x...>``."""
    table = pa.table({"range": ["1-5", "6-9"], "namespace": ["a", "b"], "dict": ["d", "e"]})
    assert render(tmp_path, "{{ range }} {{ namespace }} {{ dict }}", table) == [("1-5 a d", None), ("6-9 b e", None)]


def test_a_printed_function_fails_not_its_address(tmp_path):
    from pipeline.inputs import InputError

    table = pa.table({"q": ["x", "y"]})
    with pytest.raises(InputError, match=r"^input.template raised on every row \(2\); row 0: TypeError: printed "
                                         r"the function 'safe_range', not a value \(the jinja global 'range': it is "
                                         r"read as a column only when the input has a column 'range'\)$"):
        render(tmp_path, "{{ q }} {{ range }}", table)
    with pytest.raises(InputError, match=r"printed the function 'upper', not a value$"):
        render(tmp_path, "{{ q.upper }}", table)
    # a global used as one still works without such a column
    assert render(tmp_path, "{% for k in range(2) %}{{ q }}{{ k }}{% endfor %}", table) == [
        ("x0x1", None), ("y0y1", None)]


def test_a_csv_override_column_the_template_prints_stays_typed(tmp_path):
    """It was read as text (a template column), and its override refused: 'has type string, expected
    integer', exit 2. ``NA`` is a null there (the job's value), as in any other number column."""
    f = tmp_path / "in.csv"
    f.write_text("id,q,max_tokens\n1,a,NA\n2,b,3\n")
    template = "{{ q }}{% if max_tokens %} in {{ max_tokens }} tokens{% endif %}"
    rows, _ = read_rows(spec(path=str(f), id_column="id", template=template))
    assert [(r.prompt, r.overrides, r.error) for r in rows] == [("a", {}, None),
                                                                ("b in 3 tokens", {"max_tokens": 3}, None)]
    # without row_overrides it is any template column: text as written
    rows, _ = read_rows(spec(path=str(f), id_column="id", template=template, row_overrides=False))
    assert [(r.prompt, r.overrides) for r in rows] == [("a in NA tokens", {}), ("b in 3 tokens", {})]


@pytest.mark.parametrize("template", ["", "{# nothing #}", "{% if false %}x{% endif %}"])
def test_a_template_that_renders_empty_is_a_job_error_when_generating(template):
    """Every row failed with "input.template's prompt is empty"; a score job scores an empty context."""
    from pipeline.jobspec import JobSpecError

    with pytest.raises(JobSpecError) as e:
        spec(path="x.parquet", template=template)
    assert e.value.problems == ["input.template is empty: every row's prompt would be empty (an empty context is "
                                "for task: score)"]
    job_from_dict({"task": "score", "input": {"path": "x", "template": template, "continuation_column": "c"},
                   "output": {"dir": "o"}, "engine": {"batch_size": 1}})
    for fine in (" ", "{{ q }}", "{% if q %}{% endif %}"):
        spec(path="x.parquet", template=fine)
