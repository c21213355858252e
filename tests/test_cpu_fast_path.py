"""The CPU fast path: on Linux, MLX's float32 matmuls must run on OpenBLAS (scipy-openblas32), not on the
reference BLAS the mlx[cpu] wheel bundles (5x slower on the main job). These tests fail on a machine
where the promised fast path did not load, so a fresh CI machine catches it. Also: on a machine without
``g++`` (MLX's CPU kernel compiler) the engine decodes eagerly and says so once."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline  # noqa: F401  (first: loads OpenBLAS before mlx.core)
from pipeline import _blas

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from tiny_model import without_machine_warnings  # noqa: E402

linux = pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS fast path is for Linux")
CblasRowMajor, CblasNoTrans = 101, 111


def _pipeline_exe() -> str:
    exe = Path(sys.executable).with_name("pipeline")
    return str(exe) if exe.is_file() else shutil.which("pipeline")


@linux
def test_fast_path_is_active():
    assert os.environ.get("PIPELINE_BLAS") != "reference", "PIPELINE_BLAS=reference turns the fast path off"
    assert _blas.STATE.active, f"the CPU fast path is not active: {_blas.STATE.reason}"
    assert _blas.LOADED and Path(_blas.LOADED).is_file()
    assert _blas.STATE.threads >= 1 and _blas.STATE.core
    assert _blas.STATE.line().startswith("OpenBLAS from scipy-openblas32 ")


def _sgemm(fn, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = A @ B through a CBLAS ``cblas_sgemm`` entry point (row-major, no transposes)."""
    m, k = a.shape
    n = b.shape[1]
    c = np.zeros((m, n), dtype=np.float32)
    ptr = ctypes.POINTER(ctypes.c_float)
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ptr, ctypes.c_int, ptr, ctypes.c_int, ctypes.c_float, ptr,
                                        ctypes.c_int]
    fn(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0, a.ctypes.data_as(ptr), k, b.ctypes.data_as(ptr), n,
       0.0, c.ctypes.data_as(ptr), n)
    return c


@linux
def test_mlx_matmul_runs_on_openblas():
    """MLX's CPU matmul gives OpenBLAS's bits exactly, and not the bundled reference BLAS's (summation
    orders differ in the last bits at K = 1536), so the comparison would catch the wrong library."""
    assert _blas.STATE.active, _blas.STATE.reason
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 1536), dtype=np.float32)
    b = rng.standard_normal((1536, 96), dtype=np.float32)
    with mx.stream(mx.cpu):
        ours = np.array(mx.matmul(mx.array(a), mx.array(b)))
    openblas = _sgemm(ctypes.CDLL(_blas.LOADED).scipy_cblas_sgemm, a, b)
    libs = glob.glob(str(Path(mx.__file__).parent.parent / "mlx_cpu.libs" / "libblas-*.so*"))
    assert libs, "the mlx[cpu] wheel's bundled reference BLAS was not found"
    reference = _sgemm(ctypes.CDLL(libs[0]).cblas_sgemm, a, b)
    assert np.array_equal(ours, openblas)
    assert not np.array_equal(ours, reference)
    np.testing.assert_allclose(ours, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


def _sgemv(lib, w: np.ndarray, x: np.ndarray, trans: bool) -> np.ndarray:
    """y = op(W) x through OpenBLAS's ``scipy_cblas_sgemv`` (row-major), y first filled with NaN, beta 0."""
    rows, cols = w.shape
    y = np.full(cols if trans else rows, np.nan, dtype=np.float32)
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.scipy_cblas_sgemv(i(CblasRowMajor), i(112 if trans else CblasNoTrans), i(rows), i(cols), f(1.0),
                          p(w.ctypes.data), i(cols), p(x.ctypes.data), i(1), f(0.0), p(y.ctypes.data), i(1))
    return y


@linux
@pytest.mark.skipif(os.uname().machine.lower() not in ("x86_64", "amd64"), reason="the forwarder is x86-64 code")
def test_single_row_products_run_on_openblas_sgemv():
    """A batch-1 step's x @ W.T (and x @ W) gives OpenBLAS sgemv's bits exactly, not its sgemm's (which reads
    a single row at about half the bandwidth); products of more rows still give sgemm's bits."""
    assert _blas.STATE.gemv_forward and _blas.STATE.to_dict()["gemv_forward"] is True
    lib = ctypes.CDLL(_blas.LOADED)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1536), dtype=np.float32)
    w = rng.standard_normal((96, 1536), dtype=np.float32)  # (out, in), as a Linear's weight
    wt = np.ascontiguousarray(w.T)
    with mx.stream(mx.cpu):
        transposed = np.array(mx.array(x) @ mx.array(w).T)[0]
        plain = np.array(mx.array(x) @ mx.array(wt))[0]
        two = np.array(mx.array(np.concatenate([x, x])) @ mx.array(w).T)
    assert np.array_equal(transposed, _sgemv(lib, w, x, trans=False))
    assert np.array_equal(plain, _sgemv(lib, wt, x, trans=True))
    def sgemm_wt(a: np.ndarray) -> np.ndarray:  # a @ w.T through OpenBLAS's sgemm, w transposed as MLX passes it
        c = np.zeros((a.shape[0], 96), dtype=np.float32)
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.scipy_cblas_sgemm(i(CblasRowMajor), i(CblasNoTrans), i(112), i(a.shape[0]), i(96), i(1536), f(1.0),
                              p(a.ctypes.data), i(1536), p(w.ctypes.data), i(1536), f(0.0), p(c.ctypes.data), i(96))
        return c

    assert not np.array_equal(transposed, sgemm_wt(x)[0])  # the route is visible in the last bits at K = 1536
    assert np.array_equal(two, sgemm_wt(np.ascontiguousarray(np.concatenate([x, x]))))
    np.testing.assert_allclose(transposed, (x.astype(np.float64) @ w.T)[0], rtol=1e-4, atol=1e-3)


@linux
def test_alias_elf_binds_names_to_addresses():
    """The generated shared object makes a new name resolve to an existing function's address: here
    libc's strlen, called through the alias."""
    libc = ctypes.CDLL(None)
    strlen = ctypes.cast(libc.strlen, ctypes.c_void_p).value
    machine = _blas._ELF_MACHINE[os.uname().machine.lower()]
    alias = _blas._load_alias_library(_blas.alias_elf({"pipeline_test_strlen": strlen, "pipeline_test_other": strlen},
                                                      machine, soname="libpipeline-test-alias.so"))
    fn = alias.pipeline_test_strlen
    assert ctypes.cast(fn, ctypes.c_void_p).value == strlen
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p]
    assert fn(b"seven c") == 7
    with pytest.raises(AttributeError):
        alias.strlen  # only the names given are defined


def _inspect(model: Path, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_pipeline_exe(), "inspect", str(model)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=tmp_path)


@linux
def test_broken_openblas_warns_once_with_the_fix(tmp_path, default_model_path):
    """A scipy-openblas32 whose library is missing (a broken install): one warning line naming what is
    missing, what it costs and the fix; inspect says which BLAS runs; the command still works."""
    shadow = tmp_path / "shadow" / "scipy_openblas32"
    (shadow / "lib").mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "def get_lib_dir():\n    return __path__[0] + '/lib'\n\n"
        "def get_library(fullname=False):\n    return 'libscipy_openblas.so'\n")
    proc = _inspect(default_model_path, {"PYTHONPATH": str(tmp_path / "shadow")}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "OpenBLAS did not load" in line]
    assert len(warnings) == 1, proc.stderr
    assert "libscipy_openblas.so" in warnings[0] and "about 5x slower" in warnings[0]
    assert "fix: pip install --force-reinstall scipy-openblas32" in warnings[0]
    assert "cpu blas:       reference BLAS bundled with mlx (OpenBLAS did not load" in proc.stdout
    assert "keep the quantized weights" in proc.stdout


@linux
def test_reference_blas_on_request_is_quiet(tmp_path, default_model_path):
    proc = _inspect(default_model_path, {"PIPELINE_BLAS": "reference"}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "OpenBLAS did not load" not in proc.stderr
    assert "cpu blas:       reference BLAS bundled with mlx (PIPELINE_BLAS=reference)" in proc.stdout


@linux
def test_inspect_names_the_active_blas(tmp_path, default_model_path):
    proc = _inspect(default_model_path, {}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"cpu blas:       {_blas.STATE.line()}" in proc.stdout
    assert "expand the quantized weights to float32" in proc.stdout
    assert not [line for line in without_machine_warnings(proc.stderr) if "WARNING" in line]


def _no_compiler_env(tmp_path: Path) -> dict:
    empty = tmp_path / "bin-without-gxx"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty)}  # the console script's shebang is absolute; nothing else needs PATH


@linux
def test_without_gxx_inspect_and_a_run_decode_eagerly_and_warn_once(tmp_path):
    """No C++ compiler on PATH (a fresh Debian image): MLX cannot compile CPU kernels, so a job decodes
    eagerly (its rows say compiled false), one warning names the reason and the fix, and the run ends well."""
    import json

    import pyarrow.parquet as pq

    from tiny_model import write_prompts, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    proc = _inspect(model, _no_compiler_env(tmp_path), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "cpu compile:    no: MLX compiles its CPU kernels with g++ and there is none on PATH" in proc.stdout
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "model": str(model), "input": {"path": str(write_prompts(tmp_path / "p.parquet", 3)), "id_column": "id",
                                       "prompt_column": "prompt"},
        "generation": {"max_tokens": 3, "ignore_eos": True}, "output": {"dir": str(tmp_path / "out")}}))
    run = subprocess.run([_pipeline_exe(), "run", str(job), "--no-progress"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **_no_compiler_env(tmp_path)}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "g++" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: MLX compiles its CPU kernels with g++")
    assert "decode runs eagerly" in warnings[0] and "apt-get install g++" in warnings[0]
    rows = [r for f in sorted((tmp_path / "out").glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 3 and all(r["compiled"] is False and r["completion_tokens"] == 3 for r in rows)


@linux
def test_compiled_decode_where_a_compiler_exists():
    if shutil.which("g++") is None:
        pytest.skip("no g++ on PATH: MLX cannot compile CPU kernels here (the test above covers it)")
    from pipeline.engine.compiled import cpu_compile_blocker

    assert cpu_compile_blocker() is None
