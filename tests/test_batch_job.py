"""``engine.batch_size`` through the full ``pipeline run`` path: batched vs sequential on the real default
model (same rows, same schema, greedy completions equal at the measured rate), sampled runs independent of
the batch size, the KV memory check refusing a batch that does not fit before anything is written, and
``batch_size: auto`` resolving to what fits (tiny random model)."""

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT  # noqa: F401
from test_job_end_to_end import SAMPLES, read_output, run_cli
from tiny_model import without_machine_warnings, write_prompts, write_tiny_model

from pipeline.errors import JobSpecError
from pipeline.jobspec import job_from_dict
from pipeline.run import run_job

LIMIT, MAX_TOKENS = 8, 16
# Measured 2026-11-29 on the CPU (x86_64, mlx 0.32.4): 12 of 12 greedy completions of the default model
# (the first 12 sample rows, 16 tokens each) equal to sequential decoding at batch_size 4. Different matmul
# shapes may flip a near-tie, so one of the 8 rows here may differ.
MIN_EQUAL = 7


def job_file(tmp, name, *, batch_size, model="smollm2-135m-instruct", limit=LIMIT, engine=None, **generation):
    job = {
        "model": str(model),
        "input": {"path": str(SAMPLES), "id_column": "id", "prompt_column": "prompt",
                  "messages_column": "messages", "limit": limit},
        "generation": {"max_tokens": MAX_TOKENS, **generation},
        "engine": {"batch_size": batch_size, **(engine or {})},
        "output": {"dir": str(tmp / name), "shard_size": 4},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def rows_of(out):
    return {(r["id"], r["sample_index"]): r for r in read_output(out).to_pylist()}


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("greedy")
    for name, b in (("seq", 1), ("b4", 4)):
        run_cli("run", str(job_file(tmp, name, batch_size=b)), "--no-progress")
    return tmp


def test_batched_greedy_matches_sequential(greedy):
    seq, bat = rows_of(greedy / "seq"), rows_of(greedy / "b4")
    assert seq.keys() == bat.keys() and len(seq) == LIMIT
    equal = [k for k in seq if seq[k]["completion"] == bat[k]["completion"]]
    print(f"greedy completions equal to sequential: {len(equal)}/{len(seq)}")
    assert len(equal) >= MIN_EQUAL
    for k in seq:  # prefill is batch 1 in both modes: the prompt side is identical
        assert bat[k]["prompt_tokens"] == seq[k]["prompt_tokens"] and bat[k]["seed"] == seq[k]["seed"]
        assert bat[k]["error"] is None and bat[k]["finish_reason"] in ("stop", "length")
        assert (seq[k]["batch_size"], bat[k]["batch_size"]) == (1, 4)
        assert bat[k]["ttft_s"] > 0 and bat[k]["total_s"] >= bat[k]["ttft_s"]


def test_batched_shards_have_the_sequential_schema(greedy):
    seq_files = sorted((greedy / "seq").glob("part-*.parquet"))
    bat_files = sorted((greedy / "b4").glob("part-*.parquet"))
    assert seq_files and bat_files
    assert all(pq.read_schema(f) == pq.read_schema(seq_files[0]) for f in seq_files + bat_files)


def test_sampled_batched_runs_do_not_depend_on_batch_size(tmp_path):
    """temperature 0.8, n=2: batch 2 and batch 4 give the same rows, and batch 4 twice too (each
    row samples from its own logits with its own seed stream)."""
    outs = {}
    for name, b in (("b2", 2), ("b4", 4), ("b4-again", 4)):
        job = job_file(tmp_path, name, batch_size=b, limit=4, temperature=0.8, top_p=0.95, n=2, seed=11,
                       max_tokens=10)
        run_cli("run", str(job), "--no-progress")
        outs[name] = rows_of(tmp_path / name)
    fields = ("completion", "seed", "completion_tokens", "finish_reason")
    pick = lambda rows: {k: tuple(r[f] for f in fields) for k, r in rows.items()}  # noqa: E731
    assert len(outs["b2"]) == 8
    assert pick(outs["b4"]) == pick(outs["b4-again"])
    assert pick(outs["b2"]) == pick(outs["b4"])
    assert len({outs["b4"][k]["completion"] for k in outs["b4"]}) >= 6  # samples of a row differ


def test_kv_memory_check_refuses_before_writing(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    job = job_file(tmp_path, "out", batch_size=8, model=model, limit=8, engine={"max_kv_memory_gb": 0.0005})
    proc = run_cli("run", str(job), "--no-progress", expect=2)
    assert "engine.batch_size 8 needs" in proc.stderr and "use engine.batch_size <= " in proc.stderr
    assert len(without_machine_warnings(proc.stderr)) == 1
    assert not list((tmp_path / "out").glob("part-*.parquet"))
    # the limit the message suggests fits
    fits = int(proc.stderr.rsplit("use engine.batch_size <= ", 1)[1].split(",")[0])
    assert 1 <= fits < 8
    job = job_file(tmp_path, "out", batch_size=fits, model=model, limit=8, engine={"max_kv_memory_gb": 0.0005})
    run_cli("run", str(job), "--no-progress")
    assert len(rows_of(tmp_path / "out")) == 8


# --- engine.batch_size: auto (tiny random model, in-process) ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    return write_tiny_model(tmp / "tiny"), write_prompts(tmp / "in.parquet", 10)


def tiny_job(tiny_inputs, out, **engine):
    model, data = tiny_inputs
    return job_from_dict({"model": str(model), "input": {"path": str(data), "id_column": "id"},
                          "generation": {"max_tokens": 4}, "engine": engine,
                          "output": {"dir": str(out), "shard_size": 4}})


def test_batch_size_auto_resolves_logs_and_records(tiny_inputs, tmp_path, capsys):
    """auto: the KV of many slots fits, so it resolves to the device's cap (8 on the CPU, 256 on a GPU); the
    size is logged, recorded in the run record and the rows, and the fingerprint keeps "auto"."""
    import json

    from pipeline.run.local import auto_batch_cap

    summary = run_job(tiny_job(tiny_inputs, tmp_path / "out", batch_size="auto"), echo=lambda _m: None)
    cap = auto_batch_cap()
    assert summary.rows_written == 10 and summary.batch_size == cap
    assert f"batch size {cap}," in summary.line()
    assert f"engine.batch_size auto: {cap} (" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["runs"][-1]["batch_size"] == cap and manifest["fingerprint"]["engine"]["batch_size"] == "auto"
    assert set(read_output(tmp_path / "out").column("batch_size").to_pylist()) == {cap}


def test_a_job_gets_no_more_slots_than_samples(tiny_inputs, tmp_path, capsys):
    summary = run_job(tiny_job(tiny_inputs, tmp_path / "out", batch_size=64), echo=lambda _m: None)
    assert summary.rows_written == 10 and summary.batch_size == 10
    assert "engine.batch_size 64: the job has 10 samples, so 10 slots" in capsys.readouterr().err
    assert set(read_output(tmp_path / "out").column("batch_size").to_pylist()) == {10}


def test_batch_size_auto_takes_what_the_memory_limit_allows(tiny_inputs, tmp_path):
    """Under engine.max_kv_memory_gb, auto is exactly the largest batch_size the KV check's refusal names; with
    room for no slot at all it is refused as a fixed size is, before any row is written."""
    with pytest.raises(JobSpecError) as e:
        run_job(tiny_job(tiny_inputs, tmp_path / "fixed", batch_size=8, max_kv_memory_gb=0.0005), progress=False,
                echo=lambda _m: None)
    fits = int(str(e.value).rsplit("use engine.batch_size <= ", 1)[1].split(",")[0])
    assert 1 <= fits < 8
    summary = run_job(tiny_job(tiny_inputs, tmp_path / "auto", batch_size="auto", max_kv_memory_gb=0.0005),
                      progress=False, echo=lambda _m: None)
    assert summary.batch_size == fits and summary.rows_written == 10
    with pytest.raises(JobSpecError, match="no batch of this capacity fits"):
        run_job(tiny_job(tiny_inputs, tmp_path / "none", batch_size="auto", max_kv_memory_gb=1e-9), progress=False,
                echo=lambda _m: None)
    assert not list((tmp_path / "none").glob("part-*.parquet"))


def test_auto_batch_size_is_the_fit_capped(tiny_inputs, monkeypatch):
    from pipeline import load_model
    from pipeline.engine import BatchEngine
    from pipeline.run import local

    lm = load_model(path=tiny_inputs[0], batch_size=2)
    per_slot = BatchEngine(lm.engine, 1, 100).slot_bytes()
    for limit, want in ((3 * per_slot + 5, 3), (10**15, local.auto_batch_cap()), (0, 1)):
        monkeypatch.setattr(local, "memory_limit", lambda limit=limit: (limit, "the test's memory"))
        b, why = local.auto_batch_size(lm.engine, 100, None)
        assert b == want and why.startswith(f"{max(limit // per_slot, 0)} slots for up to 100 positions fit in the "
                                            "test's memory")
    monkeypatch.setattr(local, "memory_limit", lambda: (10**15, "the test's memory"))
    b, why = local.auto_batch_size(lm.engine, 100, (2 * per_slot + 5) / 1e9)  # max_kv_memory_gb below the device's
    assert b == 2 and "engine.max_kv_memory_gb" in why


@pytest.mark.parametrize("info", [{"memory_size": 8 * 2**30, "architecture": "applegpu_g15s"},  # Metal's keys
                                  {"total_memory": 8 * 2**30, "device_name": "NVIDIA H200"}])  # CUDA's (MLX 0.32.4)
def test_the_gpu_memory_is_read_from_metal_and_cuda_device_info(info, monkeypatch):
    """The dequantize rule and the KV memory limit read the GPU's memory under either backend's key (under
    CUDA a missing ``memory_size`` once kept every batched GPU job on 4-bit weights)."""
    from pipeline import loader
    from pipeline.engine import batch

    monkeypatch.setattr(mx, "device_info", lambda: dict(info))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    assert batch.device_memory() == 8 * 2**30
    assert batch.memory_limit() == (int(0.9 * 8 * 2**30), "the GPU's memory")
    monkeypatch.setattr(loader, "dequantized_nbytes", lambda model, dtype: 2 * 2**30)
    assert loader.should_dequantize(None, mx.float16, batch_size=64)  # a quarter of 8 GiB fits 2 GiB
    assert not loader.should_dequantize(None, mx.float16, batch_size=1)
    monkeypatch.setattr(loader, "dequantized_nbytes", lambda model, dtype: 3 * 2**30)
    assert not loader.should_dequantize(None, mx.float16, batch_size=64)
    monkeypatch.setattr(mx, "device_info", lambda: {})
    assert batch.device_memory() is None and batch.memory_limit()[1] == "the machine's memory"


@pytest.mark.parametrize("batch_size", [1, 2])
def test_total_s_counts_building_the_rows_prompt(tmp_path, monkeypatch, batch_size):
    """README: total_s is the row's seconds, prompt building included. Building each prompt is made slow here
    (a spy on build_prompt that calls through, then waits 0.3 s): every row's first sample counts it, in
    sequential and batched mode."""
    import time

    from pipeline.run import plan

    build = plan.build_prompt

    def slow(*args, **kwargs):
        out = build(*args, **kwargs)
        time.sleep(0.3)
        return out

    monkeypatch.setattr(plan, "build_prompt", slow)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))  # the tiny model's hash cache
    model = write_tiny_model(tmp_path / "tiny")
    data = write_prompts(tmp_path / "in.parquet", 3)
    job = job_from_dict({"model": str(model), "input": {"path": str(data), "id_column": "id"},
                         "generation": {"max_tokens": 2, "n": 2, "seed": 1, "temperature": 0.5},
                         "engine": {"batch_size": batch_size}, "output": {"dir": str(tmp_path / "out")}})
    run_job(job, progress=False, echo=lambda _: None)
    rows = [r for s in sorted((tmp_path / "out").glob("part-*.parquet")) for r in pq.read_table(s).to_pylist()]
    firsts = [r for r in rows if r["sample_index"] == 0]
    assert len(firsts) == 3 and all(r["error"] is None and r["total_s"] >= 0.3 for r in firsts), \
        [(r["id"], r["total_s"]) for r in firsts]
