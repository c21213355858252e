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

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import bench
from pipeline.cli import main
from pipeline.engine import BatchEngine, Engine
from pipeline.engine.sampler import row_seed
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


def test_cli_help_names_every_public_shape():
    help_text = " ".join(CliRunner().invoke(main, ["bench", "--help"]).output.split())
    for name in bench.PUBLIC_SHAPES:
        assert name in help_text, name


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
    assert result.exit_code == 2 and "--random" in result.output


@pytest.mark.parametrize("args, line", [
    (["--cache", "bogus"], "error: unknown cache kind 'bogus' (full, rotating:N, q8, q4, rotating-q8:N)"),
    (["--cache", "rotating:0"], "error: cache kind 'rotating:0': SIZE must be a positive integer"),
    (["--variants", "bogus"], "error: unknown variant 'bogus' (eager, compiled, fused, fused-replay, fused-layers)"),
    (["--variants", ",,"], "error: --variants: name at least one"),
    (["--cache", ","], "error: --cache: name at least one"),
    (["--json", "/nonexistent-dir/x.json"], "error: --json /nonexistent-dir/x.json: cannot write it: its directory "
                                             "/nonexistent-dir does not exist"),
    (["--prompts", "5"], "error: --prompts: job throughput settings; add --batch-size"),
    (["--prompts-b1", "2", "--prompt-column", "q"],
     "error: --prompts-b1, --prompt-column: job throughput settings; add --batch-size"),
])
def test_cli_bad_settings_are_one_line_exit_2(args, line):
    """Bench settings the command line got wrong exit 2, as click's own checks (--prompt-tokens 0) do."""
    result = CliRunner().invoke(main, ["bench", "--random", "tiny", "--prompt-tokens", "8", *args])
    assert (result.exit_code, result.output.splitlines()) == (2, [line])
    assert CliRunner().invoke(main, ["bench", "--random", "tiny", "--prompt-tokens", "0"]).exit_code == 2
    for bad in ("8,,16", "8,", " "):  # an empty item is not dropped
        result = CliRunner().invoke(main, ["bench", "--random", "tiny", "--prompt-tokens", bad])
        assert result.exit_code == 2 and "expected comma-separated integers" in result.output, bad


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
                    if line.split()[:2] == [r["impl"], r["variant"]] and line.split()[6] == str(r["batch_size"]))
        assert f"{r['median']['job_tps']:.1f}" in line
        assert line.split()[4] == r["weights"].replace("-bit g", "bit-g") and line.split()[5] == "greedy"
        assert (r["temperature"], r["top_p"], r["ignore_eos"]) == (0.0, 1.0, True)
    assert (s["greedy"], s["temperature"], s["top_p"], s["ignore_eos"]) == (True, 0.0, 1.0, True)
    assert s["prompts_file"] is None
    assert "3 new tokens each, greedy, ignore_eos" in output
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
        # the peer runs our weight format: dense when ours were dequantized ("auto"), 4-bit when not
        assert s["peer"]["dequantized"] == s["dequantized"]
        assert {r["weights"] for r in doc["rows"]} == {doc["model"]["weights"]} == {s["peer"]["weights"]}
        assert doc["model"]["weights"] == (str(mx.float32 if mx.default_device() == mx.cpu else mx.float16)
                                           .removeprefix("mlx.core.") if s["dequantized"] else "4-bit g64")


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


def test_sampled_batch_mode(monkeypatch):
    """--temperature/--top-p: every request of ours samples with those settings and its own seed (as a job's
    row i), mlx-lm's batch_generate gets make_sampler's sampler (None when greedy), and the document, the
    progress lines and the table name the settings."""
    seen = {"ours": [], "peer": []}
    original_run = BatchEngine.run

    def run(self, requests):
        requests = list(requests)
        seen["ours"] += [r.params for r in requests]
        return original_run(self, requests)

    monkeypatch.setattr(BatchEngine, "run", run)
    original_peer = bench.throughput._peer_batch

    def peer_batch(*args, **kwargs):
        seen["peer"].append(args[7])  # the sampler
        return original_peer(*args, **kwargs)

    monkeypatch.setattr(bench.throughput, "_peer_batch", peer_batch)
    lines, progress = [], []
    doc = bench.run_batch_bench(random="tiny", batch_sizes=(2,), prompts=3, prompt_tokens=8, max_tokens=3,
                                temperature=0.8, top_p=0.95, peer=HAVE_MLX_LM, echo=lines.append,
                                progress=progress.append)
    s = doc["settings"]
    assert (s["greedy"], s["temperature"], s["top_p"], s["ignore_eos"]) == (False, 0.8, 0.95, True)
    assert {(p.temperature, p.top_p, p.ignore_eos) for p in seen["ours"]} == {(0.8, 0.95, True)}
    timed = seen["ours"][-3:]  # the last trial's three requests: one seed each, a job's row_seed(seed, i, 0)
    assert [p.seed for p in timed] == [row_seed(0, i, 0) for i in range(3)]
    for r in doc["rows"]:
        assert (r["temperature"], r["top_p"]) == (0.8, 0.95)
        assert r["trials"][0]["generated_tokens"] == 3 * 3
    table = lines[0]
    assert "3 new tokens each, temperature 0.8, top_p 0.95, ignore_eos" in table
    assert all(" t=0.8,p=0.95 " in line for line in table.splitlines() if line.startswith(("pipeline ", "mlx-lm ")))
    assert all("temperature 0.8, top_p 0.95" in line for line in progress[1:])
    if HAVE_MLX_LM:
        assert s["peer"]["sampler"] == "make_sampler(0.8, top_p=0.95)"
        assert seen["peer"] and all(callable(f) for f in seen["peer"])
        assert any("top_p: ours keeps the nucleus" in n for n in doc["notes"])
        seen["peer"].clear()
        greedy = bench.run_batch_bench(random="tiny", batch_sizes=(2,), prompts=3, prompt_tokens=8, max_tokens=3,
                                       echo=lambda _s: None)
        assert greedy["settings"]["peer"]["sampler"] is None and seen["peer"] and set(seen["peer"]) == {None}
        seen["peer"].clear()
        tiny_t = bench.run_batch_bench(random="tiny", batch_sizes=(2,), prompts=3, prompt_tokens=8, max_tokens=3,
                                       temperature=1e-6, echo=lambda _s: None)  # greedy in our sampler (vLLM's rule)
        assert tiny_t["settings"]["greedy"] and tiny_t["settings"]["peer"]["sampler"] is None
        assert set(seen["peer"]) == {None}


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "--temperature must be"), ({"temperature": float("nan")}, "--temperature must be"),
    ({"temperature": 0.7, "top_p": 0.0}, "--top-p must be"), ({"top_p": 1.5}, "--top-p must be"),
    ({"prompts_file": "x.parquet"}, "needs a MODEL"),
])
def test_batch_mode_rejects_bad_sampling_and_random_prompt_files(kwargs, message):
    with pytest.raises(bench.BenchError, match=message):
        bench.run_batch_bench(random="tiny", batch_sizes=(1,), peer=False, echo=lambda _s: None, **kwargs)


def test_job_throughput_settings_need_batch_size():
    result = CliRunner().invoke(main, ["bench", "--random", "tiny", "--prompt-tokens", "8", "--temperature", "0.8"])
    assert result.exit_code == 2 and "--temperature: job throughput settings; add --batch-size" in result.output


@pytest.mark.parametrize("dequantize", [True, False])
def test_peer_runs_our_weight_format(dequantize):
    """--dequantize: both sides dense in the compute dtype; --no-dequantize: both 4-bit; the ratio is computed."""
    doc = bench.run_batch_bench(random="tiny", batch_sizes=(2,), prompts=3, prompt_tokens=8, max_tokens=3,
                                dequantize=dequantize, peer=HAVE_MLX_LM, echo=lambda _s: None)
    dense = str(mx.float32 if mx.default_device() == mx.cpu else mx.float16).removeprefix("mlx.core.")
    want = dense if dequantize else "4-bit g64"
    assert doc["model"]["weights"] == want and doc["settings"]["dequantized"] is dequantize
    assert all(r["weights"] == want for r in doc["rows"])
    if HAVE_MLX_LM:
        peer = doc["settings"]["peer"]
        assert (peer["weights"], peer["dequantized"]) == (want, dequantize)
        assert peer["dtype"] == doc["settings"]["dtype"]
        ours = next(r for r in doc["rows"] if r["impl"] == "pipeline")
        assert ours["ratio_vs_peer"] is not None


@pytest.mark.skipif(not HAVE_MLX_LM, reason="mlx-lm not installed")
def test_no_ratio_across_weight_formats(monkeypatch):
    """Should the peer run another weight format than ours (here its dequantization is switched off while
    ours is dequantized), no ratio to it is computed or printed, in either mode, and a note says why."""
    monkeypatch.setattr(bench.peer, "dequantize_model", lambda model, dtype: None)
    lines = []
    doc = bench.run_batch_bench(random="tiny", batch_sizes=(2,), prompts=3, prompt_tokens=8, max_tokens=3,
                                dequantize=True, echo=lines.append)
    ours = next(r for r in doc["rows"] if r["impl"] == "pipeline")
    peer = next(r for r in doc["rows"] if r["impl"] == "mlx-lm")
    assert ours["weights"] != peer["weights"] == "4-bit g64"
    assert ours["ratio_vs_peer"] is None
    assert any(n.startswith("B=2: no x_peer: ours ran") for n in doc["notes"])
    row = next(line for line in lines[0].splitlines() if line.startswith("pipeline "))
    assert row.split()[-2] == "-"  # x_peer
    assert f"weights: ours {ours['weights']}, mlx-lm 4-bit g64" in lines[0]
    doc = bench.run_bench(random="tiny", prompt_tokens=(8,), max_tokens=3, trials=1, variants=("eager",),
                          dequantize=True, echo=lambda _s: None)
    assert [r["vs_peer"] for r in doc["rows"] if r["impl"] == "pipeline"] == [None]
    assert any(n.startswith("no x_peer: ours ran") for n in doc["notes"])


# --- real prompts (--prompts-file): a model directory, a Parquet input, EOS stops -------------------------


@pytest.fixture(scope="module")
def stopping_model(tmp_path_factory):
    """The tiny random model whose tokenizer also declares as EOS the second token it generates greedily for
    the first prompt below, so that some rows end on EOS well before max_tokens (random weights rarely
    emit the real EOS)."""
    from tiny_model import _default_tokenizer, write_tiny_model

    from pipeline import load_model
    from pipeline.engine import GenerateParams
    from pipeline.tokenizer import Tokenizer

    tmp = tmp_path_factory.mktemp("stopping")
    data = tmp / "questions.parquet"
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(5)],
                             "question": [f"Tell me about topic {i}" + " please" * i for i in range(5)]}), data)
    first = write_tiny_model(tmp / "plain")
    lm = load_model(path=first)
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about topic 0"}]),
                              parse_special=True)
    stop = lm.engine.generate(ids, GenerateParams(max_tokens=2, ignore_eos=True)).token_ids[1]
    base = _default_tokenizer()
    tok = Tokenizer(base._hf, bos_token_id=base.bos_token_id, eos_token_ids=[*base.eos_token_ids, stop],
                    add_bos_token=base.add_bos_token, chat_template=base.chat_template)
    return write_tiny_model(tmp / "model", tokenizer=tok), data, stop


def test_prompts_file_runs_the_jobs_token_ids(stopping_model, tmp_path, monkeypatch):
    """--prompts-file: ours and mlx-lm get exactly the token ids a job builds from those rows (chat template),
    EOS ends rows on both sides, and at B=1 the sequential row generates exactly the tokens `pipeline run`
    of the same job generates (its run record's completion_tokens)."""
    from pipeline.jobspec import job_from_dict
    from pipeline.run import run_job

    model, data, _ = stopping_model
    got = {"ours": [], "peer": []}
    original_ours, original_peer = bench.throughput._ours_batch, bench.throughput._peer_batch
    monkeypatch.setattr(bench.throughput, "_ours_batch", lambda be, p, params: (got["ours"].append(p),
                                                                               original_ours(be, p, params))[1])
    monkeypatch.setattr(bench.throughput, "_peer_batch", lambda ref, p, *a: (got["peer"].append(p),
                                                                            original_peer(ref, p, *a))[1])
    path = tmp_path / "real.json"
    result = CliRunner().invoke(main, ["bench", str(model), "--batch-size", "1,2", "--prompts-file", str(data),
                                       "--prompt-column", "question", "--max-tokens", "6", "--trials", "1",
                                       "--json", str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(path.read_text(encoding="utf-8"))

    summary = run_job(job_from_dict({"model": str(model), "input": {"path": str(data), "id_column": "id",
                                                                    "prompt_column": "question"},
                                     "generation": {"max_tokens": 6}, "output": {"dir": str(tmp_path / "out")}}),
                      progress=False, echo=lambda _m: None)
    table = pa.concat_tables([pq.read_table(f) for f in sorted((tmp_path / "out").glob("part-*.parquet"))])
    job_rows = {r["id"]: r for r in table.to_pylist()}
    lengths = [job_rows[f"q{i}"]["prompt_tokens"] for i in range(5)]

    s = doc["settings"]
    assert s["prompts_file"]["path"] == str(data) and s["prompts_file"]["prompt_column"] == "question"
    assert s["prompts_file"]["rows"] == s["prompts"] == s["prompts_b1"] == 5
    assert s["prompts_file"]["prompt_tokens"]["total"] == sum(lengths) and s["ignore_eos"] is False
    timed = [p for p in got["ours"] if len(p) == 5]  # the timed runs (warm-ups run B + 1 prompts)
    assert timed and all(p == timed[0] for p in timed) and [len(x) for x in timed[0]] == lengths
    if HAVE_MLX_LM:
        peer_timed = [p for p in got["peer"] if len(p) == 5]
        assert peer_timed and all(p == timed[0] for p in peer_timed)
    seq = next(r for r in doc["rows"] if r["variant"] == "sequential")
    assert seq["trials"][0]["generated_tokens"] == summary.completion_tokens
    assert any(r["finish_reason"] == "stop" for r in job_rows.values())  # the EOS ended some rows
    for r in doc["rows"]:
        assert r["prompts"] == 5 and r["prompt_tokens"] is None and r["prompt_tokens_total"] == sum(lengths)
        assert r["ignore_eos"] is False
        t = r["trials"][0]
        assert t["min_tokens_per_prompt"] < 6 and t["max_tokens_per_prompt"] <= 6  # EOS stops, either side
    assert "prompts of " + str(data) in result.output and "EOS stops" in result.output


def test_prompts_file_errors(stopping_model, tmp_path):
    model, data, _ = stopping_model
    result = CliRunner().invoke(main, ["bench", str(model), "--batch-size", "1", "--prompts-file", str(data),
                                       "--prompt-column", "nope", "--no-peer"])
    assert result.exit_code == 2 and "nope" in result.output  # an input problem, as for a job
    assert result.output.startswith("error: --prompts-file: ") and "loaded" not in result.output  # model not loaded
    result = CliRunner().invoke(main, ["bench", str(model), "--batch-size", "1", "--prompts-file",
                                       str(tmp_path / "missing.parquet"), "--no-peer"])
    assert (result.exit_code, result.output.splitlines()) == (2, [
        f"error: --prompts-file: input.path '{tmp_path / 'missing.parquet'}': no input files found (.parquet, "
        ".jsonl, .json or .csv)"])
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["fine", ""]}), bad)
    with pytest.raises(bench.BenchError, match="row 1"):
        bench.run_batch_bench(str(model), batch_sizes=(1,), prompts_file=bad, peer=False, echo=lambda _s: None)
    with pytest.raises(bench.BenchError, match="has 5 rows; asked for 6"):
        bench.run_batch_bench(str(model), batch_sizes=(1,), prompts_file=data, prompt_column="question", prompts=6,
                              peer=False, echo=lambda _s: None)
