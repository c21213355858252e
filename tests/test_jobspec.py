"""Job file validation: pipeline.jobspec.job_from_dict / load_job and `pipeline validate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.jobspec import (
    CacheSpec,
    EngineSpec,
    GenerationSpec,
    InputSpec,
    JobSpec,
    JobSpecError,
    OutputSpec,
    job_from_dict,
    load_job,
)
from pipeline.resolve import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]


def minimal(**overrides) -> dict:
    data = {"input": {"path": "in.parquet"}, "output": {"dir": "out"}}
    for key, value in overrides.items():
        data[key] = value
    return data


def test_minimal_job_gets_defaults():
    job = job_from_dict(minimal())
    assert isinstance(job, JobSpec)
    assert job.model == DEFAULT_MODEL
    assert job.input == InputSpec(path="in.parquet")
    assert job.input.prompt_column == "prompt"
    assert job.input.id_column is None
    assert job.input.messages_column is None
    assert job.input.system_prompt is None
    assert job.input.apply_chat_template is True
    assert job.input.limit is None
    assert job.output == OutputSpec(dir="out", shard_size=16)
    assert job.generation == GenerationSpec()
    assert (job.generation.max_tokens, job.generation.temperature, job.generation.seed) == (128, 0.0, 0)
    assert job.generation.ignore_eos is False
    assert job.engine == EngineSpec()
    assert (job.engine.dtype, job.engine.dequantize, job.engine.prefill_step_size) == ("auto", "auto", 512)


def test_int_is_accepted_for_float_and_converted():
    job = job_from_dict(minimal(generation={"temperature": 1}))
    assert job.generation.temperature == 1.0
    assert isinstance(job.generation.temperature, float)


def test_to_dict_round_trips():
    job = job_from_dict(minimal(generation={"max_tokens": 7, "seed": 3}, engine={"dequantize": False}))
    assert job_from_dict(job.to_dict()) == job


@pytest.mark.parametrize(
    "data, path, suggestion",
    [
        (minimal(generation={"temprature": 0.5}), "generation.temprature", "temperature"),
        (minimal(input={"path": "x", "prompt_colum": "p"}), "input.prompt_colum", "prompt_column"),
        (minimal(engine={"dtyp": "float32"}), "engine.dtyp", "dtype"),
        (minimal(modle="x"), "modle", "model"),
    ],
)
def test_unknown_key_names_path_and_suggests(data, path, suggestion):
    with pytest.raises(JobSpecError) as ei:
        job_from_dict(data)
    msg = str(ei.value)
    assert repr(path) in msg
    assert f"did you mean {suggestion!r}" in msg


def test_unknown_key_without_close_match_lists_known_keys():
    with pytest.raises(JobSpecError) as ei:
        job_from_dict(minimal(output={"dir": "o", "zzzzzz": 1}))
    msg = str(ei.value)
    assert "'output.zzzzzz'" in msg
    assert "known:" in msg and "shard_size" in msg


@pytest.mark.parametrize(
    "data, key",
    [
        (minimal(generation={"max_tokens": "10"}), "generation.max_tokens"),
        (minimal(generation={"max_tokens": True}), "generation.max_tokens"),
        (minimal(generation={"seed": 1.5}), "generation.seed"),
        (minimal(generation={"temperature": "hot"}), "generation.temperature"),
        (minimal(generation={"temperature": True}), "generation.temperature"),
        (minimal(generation={"ignore_eos": "yes"}), "generation.ignore_eos"),
        (minimal(output={"dir": "o", "shard_size": "4"}), "output.shard_size"),
        (minimal(input={"path": "x", "limit": True}), "input.limit"),
        (minimal(input={"path": 5}), "input.path"),
        (minimal(model=3), "model"),
        (minimal(engine={"dequantize": 1}), "engine.dequantize"),
        (minimal(engine={"batch_size": 2.5}), "engine.batch_size"),
        (minimal(engine={"batch_size": True}), "engine.batch_size"),
    ],
)
def test_wrong_type_names_the_key(data, key):
    with pytest.raises(JobSpecError) as ei:
        job_from_dict(data)
    msg = str(ei.value)
    assert key in msg
    assert "must be" in msg


def test_null_for_non_optional_key_is_an_error():
    with pytest.raises(JobSpecError, match=r"generation\.max_tokens must be int, got null"):
        job_from_dict(minimal(generation={"max_tokens": None}))


def test_null_for_optional_key_is_allowed():
    job = job_from_dict(minimal(input={"path": "x", "system_prompt": None, "limit": None}))
    assert job.input.system_prompt is None and job.input.limit is None


def test_section_must_be_a_mapping():
    with pytest.raises(JobSpecError, match="generation"):
        job_from_dict(minimal(generation=[1, 2]))


@pytest.mark.parametrize(
    "data, key",
    [
        (minimal(generation={"temperature": -0.1}), "generation.temperature"),
        (minimal(generation={"temperature": float("nan")}), "generation.temperature"),
        (minimal(generation={"temperature": float("inf")}), "generation.temperature"),
        (minimal(generation={"max_tokens": 0}), "generation.max_tokens"),
        (minimal(generation={"seed": -1}), "generation.seed"),
        (minimal(generation={"seed": 2**63}), "generation.seed"),
        (minimal(output={"dir": "o", "shard_size": 0}), "output.shard_size"),
        (minimal(engine={"dequantize": "yes"}), "engine.dequantize"),
        (minimal(engine={"dtype": "int8"}), "engine.dtype"),
        (minimal(engine={"prefill_step_size": 0}), "engine.prefill_step_size"),
        (minimal(engine={"fused": "yes"}), "engine.fused"),
        (minimal(engine={"batch_size": 0}), "engine.batch_size"),
        (minimal(engine={"batch_size": "max"}), "engine.batch_size"),
        (minimal(input={"path": "x", "limit": 0}), "input.limit"),
    ],
)
def test_out_of_range_values_name_the_key(data, key):
    with pytest.raises(JobSpecError, match=key.replace(".", r"\.")):
        job_from_dict(data)


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_dequantize_accepts_bool_or_auto(value):
    assert job_from_dict(minimal(engine={"dequantize": value})).engine.dequantize == value


@pytest.mark.parametrize("value", [1, 64, "auto"])
def test_batch_size_accepts_an_integer_or_auto(value):
    assert job_from_dict(minimal(engine={"batch_size": value})).engine.batch_size == value
    assert job_from_dict(minimal()).engine.batch_size == 1


@pytest.mark.parametrize("value, message", [
    (0, "engine.batch_size must be an integer >= 1 or auto, got 0"),
    (-4, "engine.batch_size must be an integer >= 1 or auto, got -4"),
    ("Auto", "engine.batch_size must be an integer >= 1 or auto, got 'Auto'"),
    (2.5, "engine.batch_size must be int or str, got float 2.5"),
    (None, "engine.batch_size must not be null"),
])
def test_bad_batch_size_is_one_line_naming_the_key(value, message):
    with pytest.raises(JobSpecError) as e:
        job_from_dict(minimal(engine={"batch_size": value}))
    assert str(e.value) == message


def test_batch_size_auto_is_in_the_fingerprint_as_auto():
    """The fingerprint holds the setting, "auto" (the size it resolves to is in the run record)."""
    from pipeline.run import fingerprint

    assert fingerprint(job_from_dict(minimal(engine={"batch_size": "auto"})), {"sha256": "x"})["engine"]["batch_size"] \
        == "auto"


def test_input_needs_a_prompt_or_messages_column():
    with pytest.raises(JobSpecError, match="prompt_column or messages_column"):
        job_from_dict(minimal(input={"path": "x", "prompt_column": None}))


def test_messages_column_needs_chat_template():
    with pytest.raises(JobSpecError, match="apply_chat_template"):
        job_from_dict(minimal(input={"path": "x", "messages_column": "m", "apply_chat_template": False}))


@pytest.mark.parametrize(
    "data, key",
    [
        ({"output": {"dir": "o"}}, "input"),
        ({"input": {"path": "x"}}, "output"),
        ({"input": {"path": "x"}, "output": {}}, "output.dir"),
    ],
)
def test_missing_required_key(data, key):
    with pytest.raises(JobSpecError) as ei:
        job_from_dict(data)
    assert f"missing required key {key!r}" in str(ei.value)


@pytest.mark.parametrize("inp", [{}, {"path": "x", "dataset": {"name": "o/d"}}])
def test_input_needs_path_or_dataset(inp):
    with pytest.raises(JobSpecError) as ei:
        job_from_dict({"input": inp, "output": {"dir": "o"}})
    assert str(ei.value) in ("input: set path (a file, directory or glob) or dataset",
                             "input: set path or dataset, not both")


def test_load_job_reads_yaml(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("input:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  max_tokens: 5\n")
    job = load_job(f)
    assert job.input.path == "a.parquet"
    assert job.generation.max_tokens == 5


def test_load_job_invalid_yaml_names_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("input: [unclosed\noutput:\n  dir: out\n")
    with pytest.raises(JobSpecError) as ei:
        load_job(f)
    msg = str(ei.value)
    assert str(f) in msg
    assert "invalid YAML" in msg


def test_load_job_invalid_job_names_file_and_key(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("input:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  temprature: 0.5\n")
    with pytest.raises(JobSpecError) as ei:
        load_job(f)
    msg = str(ei.value)
    assert msg.startswith(f"{f}: ")
    assert "'generation.temprature'" in msg and "'temperature'" in msg


def test_load_job_missing_file(tmp_path):
    f = tmp_path / "nope.yaml"
    with pytest.raises(JobSpecError, match="cannot read job file"):
        load_job(f)


def test_load_job_empty_file_reports_missing_input(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    with pytest.raises(JobSpecError, match="missing required key 'input'"):
        load_job(f)


def test_load_job_top_level_not_mapping(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(JobSpecError, match="must be a mapping"):
        load_job(f)


def test_repo_eval_job_loads():
    job = load_job(REPO / "jobs" / "eval.yaml")
    assert job.model == "smollm2-135m-instruct"
    assert job.input.path == "data_samples/prompts.parquet"
    assert job.input.id_column == "id"
    assert job.input.messages_column == "messages"
    assert job.input.system_prompt is None
    assert job.generation.max_tokens == 128
    assert job.generation.temperature == 0.0
    assert job.output.dir == "runs/eval"
    assert job.output.shard_size == 16


def _pipeline_cli(*args) -> subprocess.CompletedProcess:
    # The installed console script: next to this interpreter, else on PATH.
    import shutil

    exe = Path(sys.executable).with_name("pipeline")
    exe = str(exe) if exe.is_file() else shutil.which("pipeline")
    assert exe, "the `pipeline` console script is not installed"
    cmd = [exe, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_validate(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "input:\n  path: data_samples/prompts.parquet\noutput:\n  dir: runs/x\ngeneration:\n  temprature: 0.5\n"
    )
    proc = _pipeline_cli("validate", str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert "generation.temprature" in lines[0]
    assert "Traceback" not in proc.stderr

    proc = _pipeline_cli("validate", "jobs/eval.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: jobs/eval.yaml: 32 input rows")


def test_bad_max_tokens_is_one_problem_not_two():
    """min_tokens is compared with max_tokens only when max_tokens itself is valid."""
    from pipeline.jobspec import GenerationSpec, with_overrides

    with pytest.raises(JobSpecError) as e:
        job_from_dict({"input": {"path": "x"}, "output": {"dir": "o"}, "generation": {"max_tokens": -1}})
    assert str(e.value) == "generation.max_tokens must be >= 1, got -1"
    with pytest.raises(JobSpecError) as e:
        with_overrides(GenerationSpec(), {"max_tokens": -3})
    assert str(e.value) == "input column 'max_tokens' must be >= 1, got -3"


@pytest.mark.parametrize("inp, problems", [
    ({"path": "x", "filter": {"column": "id", "equals": [1]}},
     ["input.filter.equals must be str or int or float or bool, got list [1]"]),
    ({"dataset": {"name": "", "split": ""}},
     ["input.dataset.name must be a non-empty string", "input.dataset.split must be a non-empty string"]),
    ({"dataset": {"split": "test"}}, ["missing required key 'input.dataset.name'"]),
])
def test_a_bad_key_is_said_once_not_again_by_a_check_of_its_default(inp, problems):
    """The range checks run with a default in place of a key of the wrong type or a missing one: a check
    about that key judged the default ("set exactly one of equals or one_of" after a bad equals) and is left
    out."""
    with pytest.raises(JobSpecError) as e:
        job_from_dict({"input": inp, "output": {"dir": "o"}})
    assert e.value.problems == problems


@pytest.mark.parametrize("extra, kept", [
    ({"input": {"path": "x", "filter": {"column": 5, "one_of": []}}}, "input.filter on column None: one_of must not be empty"),
    ({"input": {"path": "x", "filter": {}}}, "input.filter on column None: set exactly one of equals or one_of"),
    ({"input": {"path": "x"}, "generation": {"max_tokens": "x", "min_tokens": -1}},
     "generation.min_tokens must be >= 0 and <= max_tokens (128), got -1"),
    ({"input": {"path": "x"}, "executor": "rays", "ray": {"actors": 0}}, "executor must be local or ray, got 'rays'"),
    ({"input": {"path": "x", "filter": 5, "template": "{{ q | nosuchfilter }}"}},
     "input.template does not compile: No filter named 'nosuchfilter'. (line 1)"),
])
def test_a_problem_that_only_mentions_a_bad_keys_name_is_kept(extra, kept):
    """Only a check that names a bad key's dotted path or asks to set it is left out; one that merely uses its
    name as a word is a problem of its own."""
    with pytest.raises(JobSpecError) as e:
        job_from_dict({"output": {"dir": "o"}, **extra})
    assert kept in e.value.problems


def test_an_integer_beyond_float64_is_one_problem_not_a_traceback():
    with pytest.raises(JobSpecError) as e:
        job_from_dict({"input": {"path": "x"}, "output": {"dir": "o", "flush_seconds": 10**400},
                       "generation": {"temperature": 10**400, "max_tokens": 0}})
    assert sorted(e.value.problems) == ["generation.max_tokens must be >= 1, got 0",
                                        "generation.temperature must be a finite number, got an integer of 401 digits",
                                        "output.flush_seconds must be a finite number, got an integer of 401 digits"]


def test_a_system_prompt_needs_the_chat_template():
    with pytest.raises(JobSpecError) as e:
        job_from_dict(minimal(input={"path": "x", "system_prompt": "Be brief.", "apply_chat_template": False}))
    assert str(e.value) == "input.system_prompt needs input.apply_chat_template: true (a raw prompt has no system turn)"


def test_an_empty_model_is_named_as_such():
    from pipeline.resolve import ModelResolveError, check_model_spec

    for spec in ("", "  "):
        with pytest.raises(ModelResolveError, match=r"^model must name a model, got '\s*' \(e.g. "):
            check_model_spec(spec)


def test_engine_fused_auto_leaves_the_fingerprint_as_before():
    """Output dirs written before engine.fused existed resume: "auto" adds nothing to the fingerprint;
    an explicit setting is recorded."""
    from pipeline.run import fingerprint

    assert "fused" not in fingerprint(job_from_dict(minimal()), {"sha256": "x"})["engine"]
    off = job_from_dict(minimal(engine={"fused": False}))
    assert off.engine.fused is False
    assert fingerprint(off, {"sha256": "x"})["engine"]["fused"] is False


@pytest.mark.parametrize("key, value", [("kv_group_size", 32), ("quantized_kv_start", 100)])
def test_a_quantization_setting_without_kv_bits_is_one_line_naming_it(key, value):
    """Without cache.kv_bits the cache is not quantized, so a group size or a start would do nothing."""
    with pytest.raises(JobSpecError) as e:
        job_from_dict(minimal(cache={key: value}))
    assert str(e.value) == (f"cache.{key}: {value} has no effect without cache.kv_bits; set kv_bits to 4 or 8, "
                            f"or remove {key}")
    assert getattr(job_from_dict(minimal(cache={key: value, "kv_bits": 4})).cache, key) == value


def test_quantization_settings_at_their_defaults_are_accepted_without_kv_bits():
    """The README's reference block spells out the defaults; a job copied from it is valid."""
    job = job_from_dict(minimal(cache={"kv_bits": None, "kv_group_size": 64, "quantized_kv_start": 0}))
    assert job.cache == CacheSpec()


# The cache section of the fingerprint of a job without kv_bits, as output dirs written so far record it.
UNQUANTIZED_CACHE_FP = '{"max_kv_size": null, "kv_bits": null, "kv_group_size": 64, "quantized_kv_start": 0, ' \
                       '"prefix_block_size": 32}'


def test_the_fingerprint_of_an_unquantized_cache_holds_no_quantization_settings():
    """Without kv_bits the fingerprint records kv_group_size and quantized_kv_start at their defaults, the
    keys kept: the fingerprint of a job without kv_bits is as before (its output dirs resume), and a spec
    built without ``check`` (stray settings that do nothing) does not change it."""
    import json

    from pipeline.run import fingerprint

    def cache_fp(cache) -> str:
        job = job_from_dict(minimal())
        job.cache = cache
        return json.dumps(fingerprint(job, {"sha256": "x"})["cache"])

    assert json.dumps(fingerprint(job_from_dict(minimal()), {"sha256": "x"})["cache"]) == UNQUANTIZED_CACHE_FP
    assert cache_fp(CacheSpec(kv_group_size=64, quantized_kv_start=0)) == UNQUANTIZED_CACHE_FP
    assert cache_fp(CacheSpec(kv_group_size=32, quantized_kv_start=100)) == UNQUANTIZED_CACHE_FP
    quantized = json.loads(cache_fp(CacheSpec(kv_bits=8, kv_group_size=32, quantized_kv_start=100)))
    assert (quantized["kv_bits"], quantized["kv_group_size"], quantized["quantized_kv_start"]) == (8, 32, 100)


def test_top_level_help_lists_every_exit_status():
    out = _pipeline_cli("--help").stdout
    assert "3    run: done, but some rows failed; their error column says why" in out
    for code in ("0    success", "2    a problem with the job", "1    any other failure", "130  run stopped by SIGINT",
                 "143 by SIGTERM"):
        assert code in out, code


_REQUIRED = object()


def _readme_job_reference() -> tuple[dict, list[str]]:
    """The YAML block of README's "Job file" section, parsed, and its lines."""
    import re

    import yaml

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Job file\n"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return yaml.safe_load(block), block.splitlines()


def _dataclass_defaults(cls) -> dict:
    """Field name -> default (``_REQUIRED`` without one; a dict for a field typed as a dataclass)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = _dataclass_defaults(hints[f.name])
        elif f.default is not dataclasses.MISSING:
            out[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default  # a tuple is a YAML list
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = _REQUIRED
    return out


def test_readme_job_reference_shows_every_key_with_its_default():
    """README's job-file reference documents every key of pipeline.jobspec, each with the dataclass default
    (a key without a default is marked "required" on its line), and no key that does not exist."""
    documented, lines = _readme_job_reference()
    problems = []

    def compare(doc, want, path):
        if set(doc) != set(want):
            problems.append(f"{path.rstrip('.') or 'top level'}: missing {sorted(set(want) - set(doc))}, "
                            f"unknown {sorted(set(doc) - set(want))}")
        for key in set(doc) & set(want):
            where, value, default = f"{path}{key}", doc[key], want[key]
            if isinstance(default, dict):
                if not isinstance(value, dict):
                    problems.append(f"{where}: a section, documented as {value!r}")
                else:
                    compare(value, default, where + ".")
            elif default is _REQUIRED:
                if not any(line.strip().startswith(f"{key}:") and "required" in line for line in lines):
                    problems.append(f"{where}: has no default, but its line does not say required")
            elif value != default or isinstance(value, bool) != isinstance(default, bool):
                problems.append(f"{where}: documented {value!r}, default {default!r}")

    compare(documented, _dataclass_defaults(JobSpec), "")
    assert not problems, "\n".join(problems)
    assert documented["input"]["truncate"] == "error"
    assert any("right drops its last" in line for line in lines)  # every allowed value explained


# --- upper bounds, template compilation, the job file's bytes and keys, empty output dir ---------------


@pytest.mark.parametrize("data, message", [
    (minimal(generation={"n": 2**40}), "generation.n must be <= 65536 (samples per row), got 1099511627776"),
    (minimal(generation={"n": 65537}), "generation.n must be <= 65536 (samples per row), got 65537"),
    (minimal(cache={"prefix_cache_gb": 1e300}),
     "cache.prefix_cache_gb must be a number >= 0 and <= 1000000 (GB), got 1e+300"),
    (minimal(cache={"prefix_cache_gb": float("inf")}),
     "cache.prefix_cache_gb must be a number >= 0 and <= 1000000 (GB), got inf"),
    (minimal(cache={"prefix_cache_gb": float("nan")}),
     "cache.prefix_cache_gb must be a number >= 0 and <= 1000000 (GB), got nan"),
    (minimal(engine={"max_kv_memory_gb": float("inf")}),
     "engine.max_kv_memory_gb must be > 0 and <= 1000000 (GB), got inf"),
    (minimal(engine={"max_kv_memory_gb": 1e300}),
     "engine.max_kv_memory_gb must be > 0 and <= 1000000 (GB), got 1e+300"),
    (minimal(engine={"max_kv_memory_gb": float("nan")}),
     "engine.max_kv_memory_gb must be > 0 and <= 1000000 (GB), got nan"),
    (minimal(cache={"max_kv_size": 99999999999}), "cache.max_kv_size must be < 2**31, got 99999999999"),
    (minimal(cache={"max_kv_size": 2**31}), "cache.max_kv_size must be < 2**31, got 2147483648"),
    (minimal(cache={"quantized_kv_start": 2**31, "kv_bits": 8}),
     "cache.quantized_kv_start must be < 2**31, got 2147483648"),
    (minimal(engine={"prefill_step_size": 2**31}), "engine.prefill_step_size must be < 2**31, got 2147483648"),
    (minimal(engine={"batch_size": 2**31}), "engine.batch_size must be < 2**31, got 2147483648"),
    (minimal(output={"dir": ""}), "output.dir must be a non-empty path, got ''"),
    (minimal(output={"dir": "  "}), "output.dir must be a non-empty path, got '  '"),
])
def test_values_past_their_upper_bound_are_one_line_naming_the_key(data, message):
    with pytest.raises(JobSpecError) as e:
        job_from_dict(data)
    assert str(e.value) == message


def test_values_at_their_upper_bound_are_accepted():
    job = job_from_dict(minimal(generation={"n": 65536}, cache={"max_kv_size": 2**31 - 1, "prefix_cache_gb": 1e6,
                                                               "kv_bits": 8, "quantized_kv_start": 2**31 - 1},
                                engine={"max_kv_memory_gb": 1e6, "prefill_step_size": 2**31 - 1,
                                        "batch_size": 2**31 - 1}))
    assert (job.generation.n, job.cache.max_kv_size, job.engine.batch_size) == (65536, 2**31 - 1, 2**31 - 1)
    assert job_from_dict(minimal(output={"dir": "."})).output.dir == "."


def test_an_n_override_column_past_the_cap_fails_its_row_only(tmp_path):
    """An input column ``n`` over the cap is a failed row (one planned sample, the error naming the
    column), as other out-of-range override values are; the other rows keep their n."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.inputs import read_rows
    from pipeline.jobspec import with_overrides
    from pipeline.run.plan import plan_samples, row_generation

    with pytest.raises(JobSpecError) as e:
        with_overrides(GenerationSpec(), {"n": 2**40})
    assert str(e.value) == "input column 'n' must be <= 65536 (samples per row), got 1099511627776"

    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["a", "b", "c"],
                             "n": pa.array([None, 2**40, 3], pa.int64())}), tmp_path / "in.parquet")
    job = job_from_dict({"input": {"path": str(tmp_path / "in.parquet"), "id_column": "id"},
                         "output": {"dir": str(tmp_path / "out")}, "generation": {"n": 2}})
    rows, _ = read_rows(job.input)
    assert row_generation(job, rows[1]) == "input column 'n' must be <= 65536 (samples per row), got 1099511627776"
    assert [(r.id, k) for r, k, _ in plan_samples(job, rows)] == [(1, 0), (1, 1), (2, 0), (3, 0), (3, 1), (3, 2)]


@pytest.mark.parametrize("template, message", [
    ("{{ q | nosuchfilter }}", "input.template does not compile: No filter named 'nosuchfilter'. (line 1)"),
    ("Q: {{ prompt }}\n{{ prompt is nosuchtest }}",
     "input.template does not compile: No test named 'nosuchtest'. (line 2)"),
    ("{{ prompt", "input.template does not compile: unexpected end of template, expected 'end of print "
                  "statement'. (line 1)"),
    # jinja2 alone defers these to the first row that reaches them
    ("{% if q %}\n{{ q | nosuchfilter }}{% endif %}",
     "input.template does not compile: No filter named 'nosuchfilter'. (line 2)"),
    ("{% if q is nosuchtest %}x{% endif %}", "input.template does not compile: No test named 'nosuchtest'. (line 1)"),
    ("{{ q if q else (p | nosuchfilter) }}", "input.template does not compile: No filter named 'nosuchfilter'. (line 1)"),
    ("{% filter nosuchfilter %}x{% endfilter %}",
     "input.template does not compile: No filter named 'nosuchfilter'. (line 1)"),
])
def test_a_template_that_does_not_compile_is_one_line(template, message):
    with pytest.raises(JobSpecError) as e:
        job_from_dict(minimal(input={"path": "x", "template": template}))
    assert str(e.value) == message
    assert job_from_dict(minimal(input={"path": "x", "template": "{{ prompt | upper }}"})).input.template
    assert job_from_dict(minimal(input={"path": "x", "template": "{% if q is string %}{{ q | trim }}{% endif %}"}))


@pytest.mark.parametrize("data, message", [
    ("input:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  stop: caf\xe9\n".encode("latin-1"),
     "not UTF-8 text (byte 0xe9 at offset 67); save it as UTF-8"),
    ("input:\n  path: a.parquet\noutput:\n  dir: out\n".encode("utf-16"),
     "not UTF-8 text (byte 0xff at offset 0); it starts with a UTF-16 byte order mark; save it as UTF-8"),
])
def test_load_job_not_utf8_is_one_line(tmp_path, data, message):
    f = tmp_path / "job.yaml"
    f.write_bytes(data)
    with pytest.raises(JobSpecError) as e:
        load_job(f)
    assert str(e.value) == f"{f}: {message}"


def test_load_job_accepts_a_utf8_byte_order_mark(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_bytes("\ufeffinput:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  stop: café\n".encode())
    assert load_job(f).generation.stop == ("café",)


@pytest.mark.parametrize("text, message", [
    ("input:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  max_tokens: 4\n  max_tokens: 400\n",
     "duplicate key 'generation.max_tokens' (line 7; first at line 6)"),
    ("generation:\n  max_tokens: 4\ninput:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  seed: 3\n",
     "duplicate key 'generation' (line 7; first at line 1)"),
    ("input:\n  path: a.parquet\n  filter:\n    - column: a\n      equals: 1\n      column: b\noutput:\n  dir: out\n",
     "duplicate key 'input.filter[0].column' (line 6; first at line 4)"),
    ("input: {path: a.parquet, 'path': b.parquet}\noutput:\n  dir: out\n",
     "duplicate key 'input.path' (line 1; first at line 1)"),
])
def test_load_job_duplicate_key_names_its_path(tmp_path, text, message):
    f = tmp_path / "job.yaml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(JobSpecError) as e:
        load_job(f)
    assert str(e.value) == f"{f}: {message}"


def test_a_duplicate_key_is_said_with_every_other_problem(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("input:\n  path: a.parquet\noutput:\n  dir: out\ngeneration:\n  max_tokens: 5\n  max_tokens: 6\n"
                 "cache:\n  kv_bits: 3\n", encoding="utf-8")
    with pytest.raises(JobSpecError) as e:
        load_job(f)
    assert e.value.problems == [f"{f}: duplicate key 'generation.max_tokens' (line 7; first at line 6)",
                                f"{f}: cache.kv_bits must be 4 or 8, got 3"]


def test_load_job_merge_keys_may_be_overridden(tmp_path):
    """YAML merge keys are not duplicates: the mapping's own key wins over the merged one."""
    f = tmp_path / "job.yaml"
    f.write_text("input:\n  path: a.parquet\noutput:\n  dir: out\n"
                 "generation:\n  <<: {max_tokens: 4, seed: 1}\n  max_tokens: 9\n", encoding="utf-8")
    gen = load_job(f).generation
    assert (gen.max_tokens, gen.seed) == (9, 1)


def test_a_null_inside_a_list_is_said_as_null():
    from pipeline.jobspec import with_overrides

    with pytest.raises(JobSpecError) as e:
        with_overrides(GenerationSpec(), {"stop": ["a", None]})
    assert str(e.value) == "input column 'stop'[1] must be str, got null"


@pytest.mark.parametrize("address, ok", [("localhost", False), ("10.0.0.1", False), ("ray://h", False),
                                         ("http://h:1", False), ("h:abc", False), ("", False),
                                         ("localhost:6379", True), ("ray://h:10001", True), ("[::1]:6379", True),
                                         ("auto", True), ("local", True)])
def test_a_ray_address_without_its_port_is_a_job_error(address, ok):
    """ray.init raises "Invalid address format" (a traceback) on a host without a port: refused up front."""
    job = minimal(executor="ray", ray={"address": address})
    if ok:
        assert job_from_dict(job).ray.address == address
    else:
        with pytest.raises(JobSpecError) as e:
            job_from_dict(job)
        assert str(e.value) == f"ray.address must be null, auto, local, HOST:PORT or ray://HOST:PORT, got {address!r}"
