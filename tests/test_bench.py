"""``pipeline bench`` on the hidden tiny random shape: the JSON's structure and internal consistency
(medians of the trials, warm-up kept out of them, peer row and ratios). Never speed."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import statistics

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import pytest
from click.testing import CliRunner

from pipeline import bench
from pipeline.cli import main
from pipeline.engine import Engine
from pipeline.models import FAMILIES, build_model

HAVE_MLX_LM = importlib.util.find_spec("mlx_lm") is not None
METRICS = ("ttft_s", "prefill_tps", "decode_tps", "total_s")


@pytest.fixture(scope="module")
def cli_doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--random", "tiny", "--prompt-tokens", "8", "--max-tokens", "4",
                                       "--trials", "3", "--json", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text(encoding="utf-8")), result.output


def test_json_structure(cli_doc):
    doc, output = cli_doc
    assert doc["schema"] == bench.SCHEMA
    for key in ("platform", "processor", "mlx", "device", "date"):
        assert doc["machine"][key]
    s = doc["settings"]
    assert s["model"]["random"] == "tiny" and s["model"]["quantization"] == {"group_size": 64, "bits": 4}
    assert (s["prompt_tokens"], s["max_tokens"], s["trials"], s["caches"]) == ([8], 4, 3, ["full"])
    assert s["dtype"] == str(mx.float32 if mx.default_device() == mx.cpu else mx.float16)
    assert isinstance(s["dequantized"], bool) and s["dequantized"] == doc["model"]["dequantized"]
    assert doc["model"]["model_type"] == "llama" and doc["model"]["weight_read_bytes"] > 0

    ours = [r for r in doc["rows"] if r["impl"] == "pipeline"]
    expected = ["eager", "compiled"] if s["engine_features"]["compile"] else ["eager"]
    assert [r["variant"] for r in ours] == expected
    for r in doc["rows"]:
        assert (r["cache"], r["prompt_tokens"], r["max_tokens"]) == ("full", 8, 4)
        assert len(r["trials"]) == 3
        for t in [r["warmup"], *r["trials"]]:
            assert t["generated_tokens"] == 4
            assert t["ttft_s"] > 0 and t["decode_tps"] > 0
            assert math.isclose(t["prefill_tps"], 8 / t["ttft_s"])
        assert r["warmup_s"] == r["warmup"]["total_s"]
        assert r["kv_read_bytes"] > 0
        assert math.isclose(r["bandwidth_gbps"],
                            (r["weight_read_bytes"] + r["kv_read_bytes"]) * r["median"]["decode_tps"] / 1e9)
        # the variant's cell may say how it ran: "compiled(fell back: eager)" where MLX cannot compile here
        line = next(line for line in output.splitlines()
                    if line.split()[:1] == [r["impl"]] and line.split()[1].split("(")[0] == r["variant"]
                    and " full " in line)
        assert f"{r['median']['decode_tps']:.1f}" in line


def test_medians_are_medians_of_the_trials(cli_doc):
    doc, _ = cli_doc
    for r in doc["rows"]:
        for m in METRICS:
            assert r["median"][m] == statistics.median(t[m] for t in r["trials"])


@pytest.mark.skipif(not HAVE_MLX_LM, reason="mlx-lm not installed")
def test_peer_row_and_ratios(cli_doc):
    doc, _ = cli_doc
    assert doc["settings"]["peer"]["ran"] and doc["settings"]["peer"]["function"] == "mlx_lm.generate.generate_step"
    peers = [r for r in doc["rows"] if r["impl"] == "mlx-lm"]
    assert len(peers) == 1 and peers[0]["variant"] == "generate_step"
    p = peers[0]["median"]
    for r in doc["rows"]:
        if r["impl"] == "pipeline":
            m, v = r["median"], r["vs_peer"]
            assert math.isclose(v["decode_tps"], m["decode_tps"] / p["decode_tps"])
            assert math.isclose(v["prefill_tps"], m["prefill_tps"] / p["prefill_tps"])
            assert math.isclose(v["ttft_s"], m["ttft_s"] / p["ttft_s"])


def test_warmup_is_excluded_from_the_trials(monkeypatch):
    """Every row makes exactly 1 + trials runs; the first is the warm-up, the rest are the trials, in order."""
    calls = []
    original_generate = Engine.generate

    def generate(self, prompt_ids, params):
        gen = original_generate(self, prompt_ids, params)
        calls.append(("pipeline", gen.ttft_s, gen.total_s))
        return gen

    monkeypatch.setattr(Engine, "generate", generate)
    original_peer = bench.decode._peer_generate

    def peer_generate(*args, **kwargs):
        rec = original_peer(*args, **kwargs)
        calls.append(("mlx-lm", rec["ttft_s"], rec["total_s"]))
        return rec

    monkeypatch.setattr(bench.decode, "_peer_generate", peer_generate)
    doc = bench.run_bench(random="tiny", prompt_tokens=(8, 12), max_tokens=4, trials=3, variants=("eager",),
                          peer=HAVE_MLX_LM, echo=lambda _s: None)
    rows = doc["rows"]
    assert len(rows) == (4 if HAVE_MLX_LM else 2)
    assert len(calls) == 4 * len(rows)
    for i, r in enumerate(rows):
        runs = calls[4 * i: 4 * i + 4]
        assert {impl for impl, _, _ in runs} == {r["impl"]}
        assert (r["warmup"]["ttft_s"], r["warmup_s"]) == runs[0][1:]
        assert [(t["ttft_s"], t["total_s"]) for t in r["trials"]] == [run[1:] for run in runs[1:]]


def test_no_dequantize_and_cache_kinds():
    """Every requested cache kind runs or is listed as skipped; KV bytes follow the kind; a peer row whose
    mlx-lm cache has another layout (mlx-lm's llama ignores max_kv_size) is flagged, and so are its ratios."""
    doc = bench.run_bench(random="tiny", prompt_tokens=(24,), max_tokens=3, trials=1, variants=("eager",),
                          caches=("full", "rotating:16", "q8"), dequantize=False, peer=HAVE_MLX_LM,
                          echo=lambda _s: None)
    assert doc["settings"]["dequantized"] is False and doc["model"]["dequantized"] is False
    assert doc["settings"]["caches"] == ["full", "rotating:16", "q8"]
    ours = {r["cache"]: r for r in doc["rows"] if r["impl"] == "pipeline"}
    skipped = {s["cache"] for s in doc["skipped"] if "cache" in s}
    assert set(ours) | skipped == {"full", "rotating:16", "q8"} and "full" in ours
    if not doc["settings"]["engine_features"]["cache_spec"]:
        return
    assert set(ours) == {"full", "rotating:16", "q8"}
    kv = {k: r["kv_read_bytes"] for k, r in ours.items()}
    assert kv["rotating:16"] < kv["full"] and kv["q8"] < kv["full"]
    if HAVE_MLX_LM:
        peers = {r["cache"]: r for r in doc["rows"] if r["impl"] == "mlx-lm"}
        assert set(peers) == set(ours)
        assert peers["full"]["cache_layout_matches_ours"] and peers["q8"]["cache_layout_matches_ours"]
        assert peers["rotating:16"]["cache_layout_matches_ours"] is False
        assert ours["rotating:16"]["vs_peer"]["same_cache_layout"] is False
        assert ours["full"]["vs_peer"]["same_cache_layout"] is True


@pytest.mark.parametrize("text, expected", [
    ("full", (None, None)), ("rotating:256", (256, None)), ("q8", (None, 8)), ("q4", (None, 4)),
    ("rotating-q8:256", (256, 8)),
])
def test_parse_cache_kind(text, expected):
    kind = bench.parse_cache_kind(text)
    assert kind["name"] == text and (kind["max_kv_size"], kind["kv_bits"]) == expected


@pytest.mark.parametrize("text", ["rotating", "full:3", "q7", "q2", "q8:16", "rotating:0", "paged"])
def test_parse_cache_kind_rejects(text):
    with pytest.raises(bench.BenchError):
        bench.parse_cache_kind(text)


@pytest.mark.parametrize("name", bench.PUBLIC_SHAPES)
def test_real_shapes_are_valid_configs(name):
    config = bench.RANDOM_SHAPES[name]
    family = FAMILIES[config["model_type"]]
    args = family.ModelArgs.from_dict(config)
    assert args.hidden_size % 64 == 0 and args.intermediate_size % 64 == 0
    if HAVE_MLX_LM:
        mlx_lm_family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        mlx_lm_family.ModelArgs.from_dict(config)


def test_random_weights_quantized_in_chunks():
    """Chunked drawing (here 1,000 floats at a time) gives complete 4-bit tensors that load strictly."""
    config = {**bench.RANDOM_SHAPES["tiny"], "quantization": {"group_size": 64, "bits": 4}}
    weights = bench.random_weights(config, mx.float32, chunk_elements=1000)
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32
    assert weights["model.embed_tokens.weight"].shape == (256, 64 * 4 // 32)
    assert weights["model.layers.0.mlp.down_proj.scales"].shape == (64, 128 // 64)
    assert "lm_head.weight" not in weights
    model = build_model(config, weights, mx.float32)
    assert model(mx.array([[1, 2, 3]]), model.make_cache()).shape == (1, 3, 256)


def test_cli_needs_a_model():
    result = CliRunner().invoke(main, ["bench", "--prompt-tokens", "8"])
    assert result.exit_code == 1 and "--random" in result.output


# --- batch mode (--batch-size): job throughput ----------------------------------------------------------


@pytest.fixture(scope="module")
def batch_doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-batch") / "batch.json"
    result = CliRunner().invoke(main, ["bench", "--random", "tiny", "--prompt-tokens", "8,12", "--max-tokens", "3",
                                       "--trials", "2", "--batch-size", "1,3", "--prompts", "5", "--prompts-b1", "2",
                                       "--json", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text(encoding="utf-8")), result.output


def test_batch_mode_structure(batch_doc):
    doc, output = batch_doc
    assert doc["schema"] == bench.SCHEMA
    s = doc["settings"]
    assert s["mode"] == "batch" and s["batch_sizes"] == [1, 3] and (s["prompts"], s["prompts_b1"]) == (5, 2)
    assert (s["prompt_tokens"], s["max_tokens"], s["trials"], s["variants"]) == ([8], 3, 2, ["auto"])
    expected = [("pipeline", "sequential", 1), ("pipeline", "batch", 1)]
    expected += [("mlx-lm", "batch_generate", 1)] if HAVE_MLX_LM else []
    expected += [("pipeline", "batch", 3)] + ([("mlx-lm", "batch_generate", 3)] if HAVE_MLX_LM else [])
    assert [(r["impl"], r["variant"], r["batch_size"]) for r in doc["rows"]] == expected
    for r in doc["rows"]:
        n = 2 if r["batch_size"] == 1 else 5
        assert r["mode"] == "batch" and (r["prompts"], r["prompt_tokens"], r["max_tokens"]) == (n, 8, 3)
        assert len(r["trials"]) == 2
        for t in r["trials"]:  # every prompt generated exactly max_tokens: no early EOS on either side
            assert (t["prompts"], t["generated_tokens"]) == (n, n * 3)
            assert t["min_tokens_per_prompt"] == t["max_tokens_per_prompt"] == 3
            assert math.isclose(t["job_tps"], t["generated_tokens"] / t["wall_s"])
        warm = r["warmup"]
        assert r["warmup_s"] == warm["wall_s"]
        if r["variant"] == "sequential":
            assert warm["generated_tokens"] == min(n, 2) * 3
        else:
            assert warm["prompts"] == min(n, r["batch_size"] + 1) and warm["max_tokens_per_prompt"] == min(3, 8)
        assert r["median"]["job_tps"] == statistics.median(t["job_tps"] for t in r["trials"])
        assert r["median"]["wall_s"] == statistics.median(t["wall_s"] for t in r["trials"])
        line = next(line for line in output.splitlines()
                    if line.split()[:2] == [r["impl"], r["variant"]] and line.split()[4] == str(r["batch_size"]))
        assert f"{r['median']['job_tps']:.1f}" in line
    ours = [r for r in doc["rows"] if r["impl"] == "pipeline"]
    seq = ours[0]["median"]["job_tps"]
    for r in ours:
        assert r["compile"] == "auto" and isinstance(r["compiled"], bool)
        assert math.isclose(r["speedup_vs_sequential"], r["median"]["job_tps"] / seq)
        if r["variant"] == "batch":
            assert r["kv_bytes"] > 0
            assert r["trace_count"] == r["trace_count_after_warmup"]  # nothing traced during the timed runs
        peer = next((p for p in doc["rows"] if p["impl"] == "mlx-lm" and p["batch_size"] == r["batch_size"]), None)
        if peer is None:
            assert r["ratio_vs_peer"] is None
        else:
            assert math.isclose(r["ratio_vs_peer"], r["median"]["job_tps"] / peer["median"]["job_tps"])
    if HAVE_MLX_LM:
        assert s["peer"]["function"] == "mlx_lm.generate.batch_generate"
        assert [p["prefill_batch_size"] for p in doc["rows"] if p["impl"] == "mlx-lm"] == [1, 3]


def test_distinct_prompts():
    import numpy as np

    ps = bench.distinct_prompts(np.random.default_rng(0), 16, 2, 4)  # all 16 prompts of 2 tokens from 4 ids
    assert len({tuple(p) for p in ps}) == 16 and all(len(p) == 2 and max(p) < 4 for p in ps)
    with pytest.raises(bench.BenchError):
        bench.distinct_prompts(np.random.default_rng(0), 17, 2, 4)


@pytest.mark.parametrize("kwargs", [{"batch_sizes": (2, 2)}, {"batch_sizes": (0,)}, {"variants": ("fast",)},
                                    {"prompts": 0}])
def test_batch_mode_rejects(kwargs):
    with pytest.raises(bench.BenchError):
        bench.run_batch_bench(random="tiny", **{"batch_sizes": (1,), **kwargs}, echo=lambda _s: None)


def test_fused_variant_runs_only_where_the_fused_step_exists():
    """--variants fused: on the CPU (no CUDA backend) the row is listed as skipped with the reason and no
    generation runs; on CUDA the row is fused."""
    import mlx.core as mx

    doc = bench.run_bench(random="tiny", prompt_tokens=(8,), max_tokens=3, trials=1, variants=("fused",),
                          peer=False, echo=lambda _s: None)
    if mx.cuda.is_available():
        assert [r["fused"] for r in doc["rows"]] == [True]
    else:
        assert doc["rows"] == []
        assert [s["reason"] for s in doc["skipped"]] == ["no fused step: not on MLX's CUDA backend"]
    with pytest.raises(bench.BenchError, match="unknown variant 'fast'"):
        bench.run_bench(random="tiny", prompt_tokens=(8,), variants=("fast",), peer=False, echo=lambda _s: None)
