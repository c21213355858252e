"""Bad jobs and bad data through the real CLI.

Each table case runs `pipeline validate` and/or `pipeline run` in a subprocess and asserts the exact
`error:` lines on stderr and exit status 2 (a problem with the job or its inputs, found before the model
loads), and that an output dir it points at is left byte for byte as it was. Per-row problems are not
job errors: one small run checks that each bad row gets its own error and the other rows are generated.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

DELETE = object()  # in a job patch: remove the key
BASE_JOB = {
    "model": "smollm2-135m-instruct",
    "input": {"path": "in.parquet", "id_column": "id", "prompt_column": "prompt"},
    "generation": {"max_tokens": 2},
    "output": {"dir": "out"},
}
ALIAS_ERROR = ("is not a built-in alias (smollm2-135m-instruct), an existing .gguf file or model directory, "
               "or a Hugging Face repo id")
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def pipeline(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("pipeline")
    exe = str(exe) if exe.is_file() else shutil.which("pipeline")
    assert exe, "the `pipeline` console script is not installed"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def merged(base: dict, patch: dict) -> dict:
    out = dict(base)
    for k, v in patch.items():
        if v is DELETE:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merged(out[k], v)
        else:
            out[k] = v
    return out


def write_job(d: Path, job: dict | str | None = None) -> None:
    text = job if isinstance(job, str) else yaml.safe_dump(merged(BASE_JOB, job or {}), sort_keys=False)
    (d / "job.yaml").write_text(text, encoding="utf-8")


def snapshot(out: Path) -> dict[str, bytes] | None:
    """Every file of ``out`` (shards, manifest.json, anything else) with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())} if out.is_dir() else None


# --- input data -------------------------------------------------------------------------------------


def table(**columns) -> Callable[[Path], None]:
    """A data writer: ``in.parquet`` holding ``columns`` (values, or pyarrow arrays)."""
    def write(d: Path) -> None:
        pq.write_table(pa.table(columns), d / "in.parquet")
    return write


good_rows = table(id=[1, 2], prompt=["Say hi.", "Count to three."])


def with_files(*names: str, data: Callable[[Path], None] = good_rows) -> Callable[[Path], None]:
    """``data`` plus the named extra files (``dir/`` makes an empty directory)."""
    def write(d: Path) -> None:
        data(d)
        for name in names:
            p = d / name
            if name.endswith("/"):
                p.mkdir(parents=True, exist_ok=True)
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("not a Parquet file\n")
    return write


def no_data(d: Path) -> None:
    pass


# --- the table --------------------------------------------------------------------------------------


@dataclass
class Case:
    """One bad input.

    Attributes:
        name: test id.
        lines: the expected stderr lines, without the "error: " prefix.
        job: a patch of ``BASE_JOB`` (``DELETE`` removes a key), or the job file's whole text.
        data: writes the input data (and any other files) into the working directory.
        commands: which CLI commands run the job.
        run_lines: what `run` prints when it differs from `validate` (run stops at its first failing stage).
        committed: the output dir starts as a copy of a committed run of ``BASE_JOB``.
    """

    name: str
    lines: list[str]
    job: dict | str | None = None
    data: Callable[[Path], None] = good_rows
    commands: tuple[str, ...] = ("validate", "run")
    run_lines: list[str] | None = None
    committed: bool = False


J = "job.yaml: "  # job-file problems start with the job file's path
VALIDATE = ("validate",)
CASES = [
    # the job file itself
    Case("not-yaml", [J + "invalid YAML at line 2, column 7: expected ',' or ']', but got ':'"], "input: [unclosed\noutput:\n  dir: out\n"),
    Case("not-a-mapping", [J + "job must be a mapping, got list"], "- input\n- output\n"),
    Case("a-plain-string", [J + "job must be a mapping, got str"], "just some text\n", commands=VALIDATE),
    Case("empty-job-file", [J + "missing required key 'input'", J + "missing required key 'output'"], "",
         commands=VALIDATE),
    # unknown keys at every level
    Case("unknown-top-key", [J + "unknown key 'modle' (did you mean 'model'?)"], {"modle": "x"}),
    Case("unknown-generation-key", [J + "unknown key 'generation.temprature' (did you mean 'temperature'?)"],
         {"generation": {"temprature": 0.5}}, committed=True),
    Case("unknown-input-key", [J + "unknown key 'input.prompt_colum' (did you mean 'prompt_column'?)"],
         {"input": {"prompt_colum": "prompt"}}),
    Case("unknown-cache-key", [J + "unknown key 'cache.kv_bit' (did you mean 'kv_bits'?)"], {"cache": {"kv_bit": 8}},
         commands=VALIDATE),
    Case("unknown-output-key-no-match",
         [J + "unknown key 'output.zzzzzz' (known: dir, shard_size, flush_seconds)"], {"output": {"zzzzzz": 1}},
         commands=VALIDATE),
    # wrong types
    Case("section-not-a-mapping", [J + "generation must be a mapping, got list"], {"generation": [1, 2]},
         commands=VALIDATE),
    Case("max-tokens-string", [J + "generation.max_tokens must be int, got str '10'"],
         {"generation": {"max_tokens": "10"}}, commands=VALIDATE),
    Case("temperature-string", [J + "generation.temperature must be float, got str 'hot'"],
         {"generation": {"temperature": "hot"}}),
    Case("input-path-int", [J + "input.path must be str, got int 5"],  # not again as "set path ... or dataset"
         {"input": {"path": 5}}, commands=VALIDATE),
    Case("output-dir-null", [J + "output.dir must be str, got null"], {"output": {"dir": None}},
         commands=VALIDATE),
    Case("stop-token-id-string", [J + "generation.stop_token_ids[1] must be int, got str 'x'"],
         {"generation": {"stop_token_ids": [2, "x"]}}, commands=VALIDATE),
    Case("kv-bits-float", [J + "cache.kv_bits must be int, got float 4.5"], {"cache": {"kv_bits": 4.5}},
         commands=VALIDATE),
    Case("missing-input-path", [J + "input: set path (a file, directory or glob) or dataset"],
         {"input": {"path": DELETE}},
         commands=VALIDATE),
    # out-of-range values
    Case("temperature-negative", [J + "generation.temperature must be a finite number >= 0, got -0.5"],
         {"generation": {"temperature": -0.5}}, commands=VALIDATE),
    Case("top-p-above-1", [J + "generation.top_p must be in (0, 1], got 1.5"], {"generation": {"top_p": 1.5}}),
    Case("top-p-zero", [J + "generation.top_p must be in (0, 1], got 0.0"], {"generation": {"top_p": 0}},
         commands=VALIDATE),
    Case("top-k", [J + "generation.top_k must be -1, 0 (off) or >= 1, got -2"], {"generation": {"top_k": -2}},
         commands=VALIDATE),
    Case("top-k-past-int32", [J + "generation.top_k must be < 2**31, got 100000000000000000000000"],
         {"generation": {"top_k": 10**23}}),
    Case("min-p", [J + "generation.min_p must be in [0, 1], got 1.5"], {"generation": {"min_p": 1.5}},
         commands=VALIDATE),
    Case("repetition-penalty", [J + "generation.repetition_penalty must be a finite number > 0, got 0.0"],
         {"generation": {"repetition_penalty": 0}}, commands=VALIDATE),
    Case("presence-penalty", [J + "generation.presence_penalty must be in [-2, 2], got 3.0"],
         {"generation": {"presence_penalty": 3}}, commands=VALIDATE),
    Case("frequency-penalty", [J + "generation.frequency_penalty must be in [-2, 2], got -2.5"],
         {"generation": {"frequency_penalty": -2.5}}, commands=VALIDATE),
    Case("min-tokens-above-max", [J + "generation.min_tokens must be >= 0 and <= max_tokens (2), got 5"],
         {"generation": {"min_tokens": 5}}, commands=VALIDATE),
    Case("logprobs", [J + "generation.logprobs must be null or in [0, 20], got 21"], {"generation": {"logprobs": 21}},
         commands=VALIDATE),
    Case("empty-stop-string", [J + "generation.stop[0] must be a non-empty string, got ''"],
         {"generation": {"stop": [""]}}, commands=VALIDATE),
    Case("kv-bits", [J + "cache.kv_bits must be 4 or 8, got 3"], {"cache": {"kv_bits": 3}}),
    Case("kv-group-size", [J + "cache.kv_group_size must be 32, 64 or 128, got 48"], {"cache": {"kv_group_size": 48}},
         commands=VALIDATE),
    Case("shard-size", [J + "output.shard_size must be >= 1, got 0"], {"output": {"shard_size": 0}},
         commands=VALIDATE),
    Case("flush-seconds", [J + "output.flush_seconds must be a number > 0, got 0.0"],
         {"output": {"flush_seconds": 0}}, commands=VALIDATE),
    Case("truncate", [J + "input.truncate must be error, left or right, got 'middle'"],
         {"input": {"truncate": "middle"}}, commands=VALIDATE),
    Case("dtype", [J + "engine.dtype must be auto, float32, float16 or bfloat16, got 'int8'"],
         {"engine": {"dtype": "int8"}}, commands=VALIDATE),
    Case("messages-without-template", [J + "input.messages_column needs input.apply_chat_template: true"],
         {"input": {"messages_column": "messages", "apply_chat_template": False}}, commands=VALIDATE),
    Case("empty-template", [J + "input.template is empty: every row's prompt would be empty (an empty context is "
                               "for task: score)"], {"input": {"template": ""}}),
    # executor: ray and its section
    Case("unknown-executor", [J + "executor must be local or ray, got 'spark'"], {"executor": "spark"}),
    Case("unknown-ray-key", [J + "unknown key 'ray.actor' (did you mean 'actors'?)"], {"ray": {"actor": 2}},
         commands=VALIDATE),
    Case("ray-values", [J + "ray.actors must be >= 1, got 0", J + "ray.num_cpus must be a number > 0, got -1.0"],
         {"ray": {"actors": 0, "num_cpus": -1}}, commands=VALIDATE),
    # every problem of a job file at once
    Case("many-problems", [
        J + "unknown key 'input.prompt_colum' (did you mean 'prompt_column'?)",
        J + "input.limit must be >= 1, got 0",
        J + "output.shard_size must be int, got str 'big'",
        J + "unknown key 'generation.temprature' (did you mean 'temperature'?)",
        J + "generation.max_tokens must be >= 1, got 0",
        J + "generation.top_p must be in (0, 1], got 1.5",
        J + "generation.presence_penalty must be in [-2, 2], got 3.0",
        J + "engine.prefill_step_size must be >= 1, got 0",
        J + "cache.kv_bits must be 4 or 8, got 5",
        J + "cache.kv_group_size must be 32, 64 or 128, got 48",
    ], {"input": {"prompt_colum": "x", "limit": 0}, "output": {"shard_size": "big"},
        "generation": {"temprature": 1, "max_tokens": 0, "top_p": 1.5, "presence_penalty": 3},
        "engine": {"prefill_step_size": 0}, "cache": {"kv_bits": 5, "kv_group_size": 48}}, committed=True),
    # the model spec
    Case("model-path-missing", [f"model './models/nope.gguf' {ALIAS_ERROR}"], {"model": "./models/nope.gguf"},
         committed=True),
    Case("model-dir-without-config", ["model directory 'empty' has no config.json"], {"model": "empty"}, with_files("empty/")),
    Case("unknown-alias", [f"model 'smollm3' {ALIAS_ERROR}"], {"model": "smollm3"}, commands=VALIDATE),
    # input files
    Case("missing-input-file", [
        "input.path 'missing.parquet': no input files found (.parquet, .jsonl, .json or .csv)"],
         {"input": {"path": "missing.parquet"}}, committed=True),
    Case("empty-glob", ["input.path 'data/*.parquet': no input files found (.parquet, .jsonl, .json or .csv)"],
         {"input": {"path": "data/*.parquet"}},
         with_files("data/")),
    Case("empty-directory", ["input.path 'data': no input files found (.parquet, .jsonl, .json or .csv)"],
         {"input": {"path": "data"}},
         with_files("data/"), commands=VALIDATE),
    Case("not-parquet", ["input file notes.parquet: not readable as Parquet: Parquet magic bytes not found in "
                         "footer. Either the file is corrupted or this is not a parquet file."],
         {"input": {"path": "notes.parquet"}}, with_files("notes.parquet")),
    # input columns
    Case("missing-prompt-column", ["input.prompt_column: column 'prompt' not found in in.parquet (columns: id, text)"],
         data=table(id=[1, 2], text=["a", "b"])),
    Case("missing-id-column", ["input.id_column: column 'id' not found in in.parquet (columns: prompt)"],
         data=table(prompt=["a", "b"])),
    Case("int-prompt-column", ["input.prompt_column: column 'prompt' has type int64, expected string"],
         data=table(id=[1, 2], prompt=[3, 4])),
    Case("float-id-column", ["input.id_column: column 'id' has type double, expected integer or string"],
         data=table(id=[1.5, 2.5], prompt=["a", "b"]), commands=VALIDATE),
    Case("string-temperature-column", ["per-row override of generation.temperature: column 'temperature' has type string, expected number"],
         data=table(id=[1, 2], prompt=["a", "b"], temperature=["0.5", "hot"])),
    Case("string-messages-column",
         ["input.messages_column: column 'messages' has type string, expected "
          "list<struct<role: string, content: string>>"],
         {"input": {"messages_column": "messages"}}, table(id=[1, 2], prompt=["a", "b"], messages=["hi", "yo"]),
         commands=VALIDATE),
    Case("duplicate-ids", ["input.id_column 'id': duplicate ids 1, 3"],
         data=table(id=[1, 2, 1, 3, 3], prompt=list("abcde")), committed=True),
    Case("duplicate-string-ids", ["input.id_column 'id': duplicate ids 'x'"],
         data=table(id=["x", "y", "x"], prompt=list("abc")), commands=VALIDATE),
    Case("null-ids", ["input.id_column 'id': null id in row(s) 1, 3"],
         data=table(id=[1, None, 2, None], prompt=list("abcd"))),
    # output dirs
    Case("output-dir-with-other-files",
         ["output.dir 'out' is not empty and has no manifest.json (found notes.txt); choose an empty or new directory"],
         data=with_files("out/notes.txt")),
    Case("output-dir-of-another-job",
         ["out holds results of a different job (changed: generation.temperature); use a new output.dir "
          "(or --output-dir DIR), or --force to add rows made with the new settings to this one"],
         {"generation": {"temperature": 0.5}}, committed=True),
    # problems in several places: validate lists them all, run stops at the first
    Case("model-input-and-output", [
        f"model './nope.gguf' {ALIAS_ERROR}",
        "input.path 'missing.parquet': no input files found (.parquet, .jsonl, .json or .csv)",
        "output.dir 'out' is not empty and has no manifest.json (found notes.txt); choose an empty or new directory",
    ], {"model": "./nope.gguf", "input": {"path": "missing.parquet"}}, with_files("out/notes.txt", data=no_data),
        run_lines=[f"model './nope.gguf' {ALIAS_ERROR}"]),
]


@pytest.fixture(scope="module")
def committed_run(tmp_path_factory) -> Path:
    """A working directory holding ``BASE_JOB``, its 2-row input and its committed output dir ``out``
    (one real run of the default model)."""
    d = tmp_path_factory.mktemp("committed")
    good_rows(d)
    write_job(d)
    proc = pipeline(d, "run", "job.yaml", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((d / "out" / "manifest.json").read_text())["rows"] == 2
    return d


def test_table_has_enough_cases():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path, request):
    case.data(tmp_path)
    write_job(tmp_path, case.job)
    out = tmp_path / "out"
    if case.committed:
        shutil.copytree(request.getfixturevalue("committed_run") / "out", out)
        assert (out / "manifest.json").is_file() and list(out.glob("part-*.parquet"))
    before = snapshot(out)
    for command in case.commands:
        proc = pipeline(tmp_path, command, "job.yaml")
        lines = case.run_lines if command == "run" and case.run_lines is not None else case.lines
        assert proc.stderr.splitlines() == [f"error: {line}" for line in lines], f"{command}:\n{proc.stderr}"
        assert proc.returncode == 2, f"{command} exited {proc.returncode}"
        assert snapshot(out) == before, f"{command} changed {out}"


def test_validate_counts_output_rows(tmp_path):
    table(id=[1, 2, 3], prompt=["a", "b", "c"], n=pa.array([None, 2, None], pa.int64()))(tmp_path)
    write_job(tmp_path, {"generation": {"n": 3}})
    proc = pipeline(tmp_path, "validate", "job.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok: job.yaml: 3 input rows (8 output rows, n=3), model smollm2-135m-instruct, output out\n"


def test_validate_accepts_the_committed_output_dir(committed_run):
    before = snapshot(committed_run / "out")
    proc = pipeline(committed_run, "validate", "job.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("ok: job.yaml: 2 input rows (2 output rows, n=1), model smollm2-135m-instruct, "
                           "output out is complete (2/2 rows; nothing to do)\n")
    assert snapshot(committed_run / "out") == before


def test_bad_rows_fail_alone_and_the_others_are_generated(tmp_path):
    """Per-row problems are not job errors: each bad row gets its error, the rest are generated."""
    rows = [  # (id, prompt, messages, temperature override, expected error or None)
        (0, "Say hi.", None, None, None),
        (1, None, None, None, "input columns 'prompt' and 'messages' are null"),
        (2, "", None, None, "input column 'prompt' is empty and 'messages' is null"),
        (3, None, [{"role": "user", "content": None}], None,
         "input column 'messages': messages[0] needs string 'role' and 'content'"),
        (4, None, [{"role": None, "content": "hi"}], None,
         "input column 'messages': messages[0] needs string 'role' and 'content'"),
        (5, None, [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], None,
         "input column 'messages': messages[1]: unknown role 'robot' (expected system, user, assistant, tool or "
         "developer)"),
        (6, None, [], None, "input column 'messages' is empty"),
        (7, "hello " * 9000, None, None,
         "prompt has 9031 tokens; the model's context is 8192 (input.truncate: left or right cuts it to fit)"),
        (8, "Say hi.", None, -1.0, "input column 'temperature' must be a finite number >= 0, got -1.0"),
        (9, None, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None, None),
    ]
    pq.write_table(pa.table({
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "prompt": pa.array([r[1] for r in rows], pa.string()),
        "messages": pa.array([r[2] for r in rows], MESSAGES),
        "temperature": pa.array([r[3] for r in rows], pa.float64()),
    }), tmp_path / "in.parquet")
    write_job(tmp_path, {"input": {"messages_column": "messages"}})
    proc = pipeline(tmp_path, "run", "job.yaml", "--no-progress")
    assert proc.returncode == 3, proc.stderr  # failed rows are not job errors: done, some rows failed
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    got = pa.concat_tables([pq.read_table(tmp_path / "out" / s["file"]) for s in manifest["shards"]]).to_pylist()
    assert sorted(r["id"] for r in got) == [r[0] for r in rows]
    by_id = {r["id"]: r for r in got}
    for row_id, _, _, _, expected in rows:
        r = by_id[row_id]
        if expected is None:
            assert r["error"] is None, (row_id, r["error"])
            assert r["completion"] is not None and r["finish_reason"] in ("stop", "length")
            assert 1 <= r["completion_tokens"] <= 2
        else:
            assert r["error"] == expected, row_id
        if expected is not None:
            assert r["completion"] is None and r["finish_reason"] is None
