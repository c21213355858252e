"""`pipeline export --to` and `pipeline report --out` at destinations that cannot be written (a parent that is a
file, /proc, a read-only file system, a full one) and bad command lines: one `error:` line naming the option,
exit 2 (1 for no space left), and nothing left at the destination, on real file systems."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import datasets
import pytest
from click.testing import CliRunner

from test_job_end_to_end import run_cli
from tiny_model import write_prompts

from pipeline.cli import main
from pipeline.export import ExportError, export_results
from pipeline.jobspec import job_from_dict
from pipeline.run import run_job

pytestmark = pytest.mark.usefixtures("tiny_home")  # the tiny model and a temporary $PIPELINE_HOME (conftest)

FORMATS = {"parquet": "x.parquet", "jsonl": "x.jsonl", "hf-dir": "ds"}


@pytest.fixture(scope="module")
def out(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-dest")
    prompts = write_prompts(tmp / "prompts.parquet", 4)
    job = job_from_dict({"model": str(tiny_model), "input": {"path": str(prompts), "id_column": "id"},
                         "generation": {"max_tokens": 3}, "output": {"dir": str(tmp / "out")}})
    run_job(job, progress=False, echo=lambda *a: None)
    return tmp / "out"


def cli(*args) -> tuple[int, list[str]]:
    """Run the CLI in this process: (exit code, stderr lines); an exception that escaped fails the test."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"pipeline {' '.join(map(str, args))} raised {result.exception!r}")
    return result.exit_code, result.stderr.splitlines()


def listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


@pytest.fixture
def afile(tmp_path) -> Path:
    f = tmp_path / "afile"
    f.write_text("not a directory")
    return f


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_under_a_file_is_one_line_exit_2(out, afile, fmt):
    for to in (afile / FORMATS[fmt], afile / "sub" / FORMATS[fmt]):
        code, err = cli("export", out, "--to", to)
        assert (code, err) == (2, [f"error: --to {to}: cannot write it: {afile} is a file, not a directory"])
    assert afile.read_text() == "not a directory"


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_into_proc_is_one_line_exit_2(out, fmt):
    to = Path("/proc") / FORMATS[fmt]
    code, err = cli("export", out, "--to", to)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --to {to}: cannot write it: "), err
    assert not to.exists()


def test_the_cli_process_prints_no_traceback(out, afile):
    proc = run_cli("export", str(out), "--to", str(afile / "x.parquet"), expect=2)
    assert proc.stderr == f"error: --to {afile / 'x.parquet'}: cannot write it: {afile} is a file, not a directory\n"
    proc = run_cli("report", str(out), "--out", "/proc/r.html", expect=2)
    assert proc.stderr.startswith("error: --out /proc/r.html: cannot write it: ") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("where", ["file", "proc"])
def test_report_at_a_destination_that_cannot_be_written(out, afile, where):
    page = afile / "r.html" if where == "file" else Path("/proc/r.html")
    code, err = cli("report", out, "--out", page)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --out {page}: cannot write it: "), err
    if where == "file":
        assert err[0].endswith(f"{afile} is a file, not a directory")


def test_bad_command_lines_exit_2(out, tmp_path):
    dest = tmp_path / "r.parquet"
    assert cli("export", out, "--to", dest)[0] == 0
    cases = [
        (["--to", tmp_path / "x.csv"], "unknown format '.csv'"),
        (["--to", dest], "exists; pass --overwrite to replace it"),
        (["--to", out / "x.parquet"], "inside the output dir"),
        (["--to", tmp_path / "p.parquet", "--pivot"], "--pivot: the output holds no scored choices"),
        (["--to", tmp_path / "p.parquet", "--pivot", "--json-fields"], "--json-fields parses completions"),
    ]
    for args, message in cases:
        code, err = cli("export", out, *args)
        assert code == 2 and len(err) == 1 and message in err[0], (args, code, err)
    assert not (out / "x.parquet").exists() and not (tmp_path / "p.parquet").exists()


@pytest.mark.parametrize("name", [".parquet", ".jsonl", ".csv"])
def test_a_name_that_is_only_a_suffix_is_refused(out, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    for to in (name, f"sub/{name}"):
        code, err = cli("export", out, "--to", to)
        assert code == 2 and err == [f"error: --to {to}: {name!r} is only a suffix, not a file name; name the file "
                                     f"(e.g. results{name if name != '.csv' else '.parquet'}), or end a directory's "
                                     f"name with / (--to {to}/)"]
    assert listing(tmp_path) == []


def test_an_empty_destination_is_refused_as_such(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for to in ("", " "):
        for extra in ((), ("--overwrite",)):
            assert cli("export", out, "--to", to, *extra) == (2, [f"error: --to must name a file or directory, got {to!r}"])
    assert listing(tmp_path) == []


def test_a_hidden_dataset_directory_with_a_trailing_slash(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli("export", out, "--to", ".data/")[0] == 0
    assert datasets.load_from_disk(str(tmp_path / ".data")).num_rows == 4


def test_hf_dir_over_an_existing_file_is_refused(out, tmp_path):
    f = tmp_path / "plain"
    f.write_text("keep me")
    code, err = cli("export", out, "--to", f, "--overwrite")
    assert code == 2 and err == [f"error: --to {f}: a file, not a directory; not replacing it with a dataset directory"]
    assert f.read_text() == "keep me"


def test_a_directory_named_like_a_file_is_refused(out, tmp_path):
    """An existing directory named x.parquet or x.jsonl (empty, or a saved dataset) is refused as --to, with
    --overwrite too: the suffix names a file (it was written as a datasets directory); a trailing / writes one."""
    (tmp_path / "x.parquet").mkdir()
    assert cli("export", out, "--to", f"{tmp_path / 'x.jsonl'}/")[0] == 0
    saved = files(tmp_path / "x.jsonl")
    for name, fmt in (("x.parquet", "parquet"), ("x.jsonl", "jsonl")):
        to = tmp_path / name
        for extra in ([], ["--overwrite"]):
            assert cli("export", out, "--to", to, *extra) == (2, [
                f"error: --to {to}: a directory, not a {fmt} file; not replacing it (--to {to}/ writes a datasets "
                "directory)"])
    assert listing(tmp_path / "x.parquet") == [] and files(tmp_path / "x.jsonl") == saved
    assert cli("export", out, "--to", f"{tmp_path / 'x.parquet'}/", "--overwrite")[0] == 0
    assert datasets.load_from_disk(str(tmp_path / "x.parquet")).num_rows == 4


# --- real read-only and full file systems ---------------------------------------------------------------------


def test_a_read_only_file_system(out, tmpfs):
    ro = tmpfs("ro,size=1m")
    for name in (*FORMATS.values(), "sub/x.parquet"):
        code, err = cli("export", out, "--to", ro / name)
        assert (code, err) == (2, [f"error: --to {ro / name}: cannot write it: Read-only file system"])
    code, err = cli("report", out, "--out", ro / "r.html")
    assert (code, err) == (2, [f"error: --out {ro / 'r.html'}: cannot write it: Read-only file system"])
    assert listing(ro) == []


def test_no_space_left_leaves_nothing_behind(out, tmpfs):
    """No space left: exit 1 (as for a run), one line, and neither the destination
    nor a temporary file is left; an earlier export at the destination stays as it was."""
    full = tmpfs("size=1m")
    keep = full / "keep.parquet"
    run_cli("export", str(out), "--to", str(keep))
    before = keep.read_bytes()
    st = os.statvfs(full)
    (full / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize))  # no page left
    for name in FORMATS.values():
        code, err = cli("export", out, "--to", full / name)
        assert (code, err) == (1, [f"error: --to {full / name}: cannot write it: No space left on device"])
        assert listing(full) == ["filler", "keep.parquet"]
    code, err = cli("export", out, "--to", keep, "--overwrite")
    assert code == 1 and keep.read_bytes() == before and listing(full) == ["filler", "keep.parquet"]
    code, err = cli("report", out, "--out", full / "r.html")
    assert (code, err) == (1, [f"error: --out {full / 'r.html'}: cannot write it: No space left on device"])
    assert listing(full) == ["filler", "keep.parquet"]
    page = full / "new" / "sub" / "r.html"  # the directories made for it are removed again
    assert cli("report", out, "--out", page) == (1, [f"error: --out {page}: cannot write it: No space left on device"])
    assert listing(full) == ["filler", "keep.parquet"]


def test_export_results_raises_export_error(out, afile):
    with pytest.raises(ExportError, match="is a file, not a directory") as e:
        export_results(out, str(afile / "x.jsonl"))
    assert e.value.exit_code == 2


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_report_out_in_the_output_dir_itself_is_refused(out, tmp_path):
    """An --out whose directory is OUT_DIR (through a symlink too), or that names its manifest, a shard or the
    lock file, is one line naming --out, exit 2, and OUT_DIR is unchanged (the page replaced manifest.json or
    a shard, the charts landed beside them; exit 0); a subdirectory of OUT_DIR is fine, as the default's."""
    (tmp_path / "link").symlink_to(out)
    before = files(out)
    for page in (out / "manifest.json", out / "part-00000.parquet", out / ".lock", out / "r.html",
                 tmp_path / "link" / "r.html", out / "report" / ".." / "r.html"):
        code, err = cli("report", out, "--out", page)
        assert code == 2 and len(err) == 1, (page, code, err)
        assert err[0].startswith(f"error: --out {page}: in the output dir {out} itself"), err
    assert files(out) == before
    page = tmp_path / "copy" / "sub" / "r.html"
    shutil.copytree(out, tmp_path / "copy")
    page.parent.mkdir()
    (page.parent / "decode_tps.png").symlink_to(tmp_path / "copy" / "manifest.json")  # a chart's path
    assert cli("report", tmp_path / "copy", "--out", page) == (2, [
        f"error: --out {page}: would replace {page.parent / 'decode_tps.png'}, a file of the output dir "
        f"{tmp_path / 'copy'}; write the report elsewhere"])
    (page.parent / "decode_tps.png").unlink()
    assert cli("report", tmp_path / "copy", "--out", page)[0] == 0
    assert sorted(p.name for p in page.parent.iterdir()) == ["completion_tokens.png", "decode_tps.png",
                                                             "finish_reason.png", "r.html", "ttft_vs_prompt.png"]


def test_export_onto_a_directory_holding_the_output_dir_is_refused(out, tmp_path):
    """--to D --overwrite, D a saved dataset that holds OUT_DIR (directly, deeper, or through a symlink to D), is
    one line, exit 2, and OUT_DIR is kept (D was deleted, OUT_DIR with it)."""
    ds = tmp_path / "ds"
    assert cli("export", out, "--to", ds)[0] == 0
    shutil.copytree(out, ds / "runs" / "out")
    (tmp_path / "link").symlink_to(ds)
    before = files(ds)
    for inner, to in ((ds / "runs" / "out", ds), (ds / "runs" / "out", tmp_path / "link"),
                      (tmp_path / "link" / "runs" / "out", ds)):
        code, err = cli("export", inner, "--to", to, "--overwrite")
        assert (code, err) == (2, [f"error: --to {to}: holds the output dir {inner} (replacing it would delete the "
                                   "results); write it elsewhere"])
    assert files(ds) == before


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ""])
def test_a_file_name_too_long_is_one_line(out, tmp_path, suffix):
    to = tmp_path / ("x" * 260 + suffix)
    assert cli("export", out, "--to", to) == (2, [f"error: --to {to}: cannot write it: File name too long"])
    assert listing(tmp_path) == []
