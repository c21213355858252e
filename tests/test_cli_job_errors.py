"""Job-file problems through the real CLI: `pipeline validate` and `pipeline run` print one `error:` line
naming the key (no traceback) and exit 2 before the model loads: values past their upper bound (generation.n,
memory sizes in GB, int32 sizes), a cache quantization setting without cache.kv_bits, a template with an
unknown filter, a job file that is not UTF-8, a key repeated in one mapping, an empty output dir (output.dir or --output-dir), and --ray on a score job."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

BASE = "model: smollm2-135m-instruct\ninput:\n  path: in.parquet\n  id_column: id\noutput:\n  dir: out\n"
J = "job.yaml: "
MEMORY_LIMIT = 4 * 2**30  # a command that plans per sample without a bound dies of MemoryError, not the machine


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def pipeline(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("pipeline")
    exe = str(exe) if exe.is_file() else shutil.which("pipeline")
    assert exe, "the `pipeline` console script is not installed"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_memory)


@pytest.fixture
def work(tmp_path) -> Path:
    """A working directory with a 3-row ``in.parquet`` (its ``n`` column sets per-row sample counts)."""
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["a", "b", "c"],
                             "n": pa.array([None, 2**40, 2], pa.int64())}), tmp_path / "in.parquet")
    return tmp_path


CASES = [
    ("n-huge", BASE + "generation: {max_tokens: 3, n: 1099511627776}\n",
     J + "generation.n must be <= 65536 (samples per row), got 1099511627776"),
    ("prefix-cache-gb-overflows", BASE + "cache: {prefix_cache_gb: 1.0e+300}\n",
     J + "cache.prefix_cache_gb must be a number >= 0 and <= 1000000 (GB), got 1e+300"),
    ("max-kv-memory-gb-inf", BASE + "engine: {max_kv_memory_gb: .inf}\n",
     J + "engine.max_kv_memory_gb must be > 0 and <= 1000000 (GB), got inf"),
    ("max-kv-size-past-int32", BASE + "cache: {max_kv_size: 99999999999}\n",
     J + "cache.max_kv_size must be < 2**31, got 99999999999"),
    ("quantized-kv-start-past-int32", BASE + "cache: {kv_bits: 8, quantized_kv_start: 99999999999}\n",
     J + "cache.quantized_kv_start must be < 2**31, got 99999999999"),
    ("group-size-without-kv-bits", BASE + "cache: {kv_group_size: 32}\n",
     J + "cache.kv_group_size: 32 has no effect without cache.kv_bits; set kv_bits to 4 or 8, or remove kv_group_size"),
    ("unknown-filter", BASE.replace("  id_column: id\n", '  id_column: id\n  template: "{{ q | nosuchfilter }}"\n'),
     J + "input.template does not compile: No filter named 'nosuchfilter'. (line 1)"),
    ("latin-1", (BASE + "generation:\n  stop: caf\xe9\n").encode("latin-1"),
     J + f"not UTF-8 text (byte 0xe9 at offset {len(BASE) + 23}); save it as UTF-8"),  # after "...stop: caf"
    ("utf-16", BASE.encode("utf-16"),
     J + "not UTF-8 text (byte 0xff at offset 0); it starts with a UTF-16 byte order mark; save it as UTF-8"),
    ("duplicate-nested-key", BASE + "generation:\n  max_tokens: 4\n  max_tokens: 400\n",
     J + "duplicate key 'generation.max_tokens' (line 9; first at line 8)"),
    ("duplicate-section", BASE + "generation:\n  max_tokens: 4\ngeneration:\n  seed: 3\n",
     J + "duplicate key 'generation' (line 9; first at line 7)"),
    ("empty-output-dir", BASE.replace("dir: out", 'dir: ""'), J + "output.dir must be a non-empty path, got ''"),
]


@pytest.mark.parametrize("name, job, line", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("command", ["validate", "run"])
def test_job_error_is_one_line_exit_2(work, command, name, job, line):
    (work / "job.yaml").write_bytes(job if isinstance(job, bytes) else job.encode())
    proc = pipeline(work, command, "job.yaml", *(["--no-progress"] if command == "run" else []))
    assert proc.stderr.splitlines() == [f"error: {line}"], proc.stderr
    assert proc.returncode == 2
    assert not (work / "out").exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_run_empty_output_dir_option_is_an_error(work, value):
    """An empty --output-dir is not ignored in favour of the job's output.dir."""
    (work / "job.yaml").write_text(BASE)
    proc = pipeline(work, "run", "job.yaml", "--no-progress", "--output-dir", value)
    assert proc.stderr.splitlines() == [f"error: --output-dir must be a non-empty path, got {value!r}"], proc.stderr
    assert proc.returncode == 2
    assert not (work / "out").exists()


@pytest.mark.parametrize("address", ["local", "auto"])
def test_run_with_ray_checks_the_job_as_executor_ray_does(work, address):
    """--ray sets executor: ray; a score job (local only) is refused as in the job file, before Ray starts."""
    pq.write_table(pa.table({"id": [1], "prompt": ["2+2="], "answer": [" 4"]}), work / "in.parquet")
    (work / "job.yaml").write_text("model: smollm2-135m-instruct\ntask: score\ninput:\n  path: in.parquet\n"
                                   "  id_column: id\n  continuation_column: answer\noutput:\n  dir: out\n")
    proc = pipeline(work, "validate", "job.yaml")
    assert proc.returncode == 0, proc.stderr
    proc = pipeline(work, "run", "job.yaml", "--no-progress", "--ray", address)
    assert proc.stderr.splitlines() == ["error: --ray: task: score runs with executor: local only"], proc.stderr
    assert proc.returncode == 2
    assert not (work / "out").exists()


def test_validate_counts_a_row_whose_n_override_is_past_the_cap_as_one_failed_row(work):
    """Row 2's ``n`` (2**40) fails that row (one output row, its error set at run time); rows 1 and 3 keep
    theirs (the job's n=1, the column's 2)."""
    (work / "job.yaml").write_text(BASE)
    proc = pipeline(work, "validate", "job.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok: job.yaml: 3 input rows (4 output rows, n=1), model smollm2-135m-instruct, output out\n"
