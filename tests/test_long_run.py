"""A long unattended run in-process: 2,000 very short prompts on the tiny model, with process RSS, MLX
active memory and the count of live Python objects sampled every 100 rows; after warm-up they stay flat.

Prefix caching stays on, with a store of 50 blocks: every prompt here differs inside its first block, so each
row stores one new block (2 layers x K,V x 2 heads x 32 positions x 16 dims x 4 bytes = 16 KiB) and the store
is full after 50 rows; from then on every insert evicts one, and MLX active memory stays flat only if an
evicted block's arrays are freed (at the default 1 GB the store would grow by 28 MiB over these rows)."""

from __future__ import annotations

import gc
import json
import os

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.jobspec import job_from_dict
from pipeline.run import run_job
from tiny_model import write_tiny_model

ROWS = 2000
EVERY = 100
WARMUP = 200
# Bounds on growth from the sample at WARMUP rows to any later sample (1,800 rows). Measured on a 2-core
# x86_64 CPU: RSS +0.5 MiB, MLX active memory +0 bytes, gc-tracked objects within +-500 (the shard
# buffer of up to 16 Results fills and empties). What each bound catches over 1,800 rows:
# - RSS 16 MiB: any leak of >= 9 KiB per row, e.g. one KV cache per row (2 layers x K,V x 2 heads x
#   512 positions x 16 dims x 4 bytes = 128 KiB) or one logits row (49,152 x 4 bytes = 192 KiB).
RSS_GROWTH_MAX = 16 << 20
# - MLX active memory 64 KiB: any MLX array of >= 10 int32 / float32 values kept per row (a prompt's ids,
#   a logits row); the weights and the preallocated KV cache stay allocated the whole run.
MLX_GROWTH_MAX = 64 << 10
# - 1,000 objects: keeping one container object (a Result, a dict, a list) per row.
OBJECTS_GROWTH_MAX = 1000
BLOCK_BYTES = 2 * 2 * 2 * 32 * 16 * 4  # one prefix block of the tiny model: layers x K,V x heads x tokens x dims x 4
PREFIX_BLOCKS = 50


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux) for RSS")
def test_memory_stays_flat_over_2000_rows(tmp_path, monkeypatch):
    model = write_tiny_model(tmp_path / "model")
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "pipeline-home"))  # the run's model-hash cache
    pq.write_table(pa.table({"prompt": [f"hi {i}" for i in range(ROWS)]}), tmp_path / "prompts.parquet")
    out = tmp_path / "out"
    job = job_from_dict({
        "model": str(model),
        "input": {"path": str(tmp_path / "prompts.parquet")},  # ids: the row index; chat template on
        "generation": {"max_tokens": 2, "temperature": 0.0},
        "output": {"dir": str(out), "shard_size": 16},
        "cache": {"prefix_cache_gb": PREFIX_BLOCKS * BLOCK_BYTES / 1e9},
    })
    samples = []  # (rows done, RSS bytes, MLX active bytes, gc-tracked objects)
    seen = []

    def on_result(res):
        seen.append(res.error)
        if len(seen) % EVERY == 0:
            gc.collect()  # count live objects, not garbage awaiting the cycle collector
            samples.append((len(seen), rss_bytes(), mx.get_active_memory(), len(gc.get_objects())))

    summary = run_job(job, progress=False, on_result=on_result)
    print(f"{summary.line()}\n" + "\n".join(
        f"{n:5d} rows: RSS {r / 2**20:.1f} MiB, MLX active {a} bytes, {o} objects" for n, r, a, o in samples))

    assert summary.complete and summary.rows_written == ROWS and summary.rows_failed == 0
    assert len(seen) == ROWS and not any(seen)
    manifest = json.loads((out / "manifest.json").read_text())
    ids = pa.concat_tables([pq.read_table(out / s["file"], columns=["id"]) for s in manifest["shards"]])
    assert sorted(ids.column("id").to_pylist()) == list(range(ROWS))

    assert [n for n, *_ in samples] == list(range(EVERY, ROWS + 1, EVERY))
    base = next(s for s in samples if s[0] == WARMUP)
    later = [s for s in samples if s[0] > WARMUP]
    rss_growth = max(s[1] for s in later) - base[1]
    mlx_growth = max(s[2] for s in later) - base[2]
    obj_growth = max(s[3] for s in later) - base[3]
    assert rss_growth < RSS_GROWTH_MAX, f"RSS grew {rss_growth / 2**20:.1f} MiB after warm-up"
    assert mlx_growth < MLX_GROWTH_MAX, f"MLX active memory grew {mlx_growth / 2**20:.2f} MiB after warm-up"
    assert obj_growth < OBJECTS_GROWTH_MAX, f"{obj_growth} more live Python objects after warm-up"
