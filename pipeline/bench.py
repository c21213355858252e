"""``pipeline bench``: decode tok/s, prefill tok/s and TTFT of the engine, eager vs compiled, per KV cache
kind and prompt length, with mlx-lm's ``generate_step`` on the same weights as the peer in the same run.

Each row (implementation x variant x cache kind x prompt length) runs one warm-up generation (kernel
JIT, graph tracing, cache buffer allocation; timed and reported apart as ``warmup_s``), then ``trials``
timed generations of ``max_tokens`` new tokens, greedy, ``ignore_eos``, from the same random prompt;
the table shows the medians. The achieved read bandwidth is ``(weight bytes read per token + mean KV
bytes read per decode step) x median decode tok/s``.

With ``batch_sizes`` (``pipeline bench --batch-size``): job throughput instead, i.e. generated tokens /
wall seconds of many prompts through ``pipeline.engine.batch.BatchEngine`` at each batch size, with mlx-lm's
``batch_generate`` as the peer (``run_batch_bench``).

Models: any model spec (``load_model``'s rules: dtype "auto", the "auto" dequantize rule), or random
weights of a named real shape (``RANDOM_SHAPES``), 4-bit affine quantized (group 64) in memory, one
tensor chunk at a time, so a GPU run needs no download.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import _blas
from .engine import Engine, GenerateParams
from .loader import compute_dtype, should_dequantize
from .models import FAMILIES, build_model, dequantize_model, dequantized_nbytes
from .engine.fused import fused_blocker
from .models.base import fuse_projections

SCHEMA = "pipeline.bench/1"

# Hugging Face config.json values of the real models (architecture only; weights are random).
RANDOM_SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct)
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-3.2-1B(-Instruct)
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": {
        "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
    # google/gemma-3-1b-it (no lm_head: the output projection is the embedding)
    "gemma-3-1b": {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "intermediate_size": 6912,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "max_position_embeddings": 32768, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
    # Not a real model: for tests (hidden from the CLI help).
    "tiny": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
    },
}
PUBLIC_SHAPES = [name for name in RANDOM_SHAPES if name != "tiny"]
RANDOM_QUANTIZATION = {"group_size": 64, "bits": 4}
EMBED_STD = 0.1


class BenchError(ValueError):
    """Bad benchmark settings (unknown shape, unparsable cache kind, prompt too long for the model)."""


# --- cache kinds -------------------------------------------------------------------------------------


def parse_cache_kind(text: str) -> dict:
    """``full``, ``rotating:N``, ``qB`` (quantized KV, B bits) or ``rotating-qB:N`` ->
    ``{"name", "max_kv_size", "kv_bits"}``.

    Raises:
        BenchError: anything else.
    """
    name = text.strip()
    head, _, size = name.partition(":")
    bits = None
    if head.startswith("rotating-q"):
        bits, rotating = head[len("rotating-q"):], True
    elif head.startswith("q"):
        bits, rotating = head[1:], False
    elif head in ("full", "rotating"):
        rotating = head == "rotating"
    else:
        raise BenchError(f"unknown cache kind {name!r} (full, rotating:N, q8, q4, rotating-q8:N)")
    if bits is not None:
        if bits not in ("4", "8"):
            raise BenchError(f"cache kind {name!r}: KV bits must be 4 or 8")
        bits = int(bits)
    if rotating != bool(size):
        problem = "rotating caches need :SIZE" if rotating else "only rotating caches take :SIZE"
        raise BenchError(f"cache kind {name!r}: {problem}")
    max_kv_size = None
    if rotating:
        if not size.isdigit() or int(size) < 1:
            raise BenchError(f"cache kind {name!r}: SIZE must be a positive integer")
        max_kv_size = int(size)
    return {"name": name, "max_kv_size": max_kv_size, "kv_bits": bits}


def engine_features() -> dict:
    """What this checkout's ``Engine`` takes: ``compile`` (compiled vs eager decode), ``fused`` (the fused
    CUDA step) and ``cache_spec`` (with ``pipeline.jobspec.CacheSpec``)."""
    params = inspect.signature(Engine.__init__).parameters
    try:
        from .jobspec import CacheSpec  # noqa: F401
        has_spec = True
    except ImportError:
        has_spec = False
    return {"compile": "compile" in params, "fused": "fused" in params,
            "cache_spec": "cache_spec" in params and has_spec}


def _cache_spec(kind: dict):
    if kind["max_kv_size"] is None and kind["kv_bits"] is None:
        return None
    from .jobspec import CacheSpec

    spec = CacheSpec(max_kv_size=kind["max_kv_size"], kv_bits=kind["kv_bits"], kv_group_size=64, quantized_kv_start=0)
    if hasattr(spec, "check"):
        spec.check()
    return spec


# --- models ------------------------------------------------------------------------------------------


def random_tensor(name: str, shape: tuple[int, ...]) -> mx.array:
    """Random float32 values for the parameter ``name``, spread so logits and greedy paths are not
    degenerate: norm weights 1 + 0.1 N(0,1), other vectors 0.1 N(0,1), embeddings N(0, EMBED_STD),
    matrices N(0, 1/in)."""
    if len(shape) == 1 and name.endswith("norm.weight"):
        return 1.0 + 0.1 * mx.random.normal(shape)
    if len(shape) == 1:
        return 0.1 * mx.random.normal(shape)
    if "embed" in name:
        return EMBED_STD * mx.random.normal(shape)
    return mx.random.normal(shape) * shape[-1] ** -0.5


def random_weights(config: dict, dtype: mx.Dtype, *, bits: int = 4, group_size: int = 64, seed: int = 0,
                   chunk_elements: int = 1 << 24) -> dict[str, mx.array]:
    """Random HF-named weights for ``config``, every Linear/Embedding whose input size is a multiple of
    ``group_size`` affine-quantized (``bits``): each such matrix is drawn and quantized
    ``chunk_elements`` floats at a time, so no float copy of the model (nor of one large matrix) ever
    exists. Matrices ~ N(0, 1/in) (embeddings N(0, EMBED_STD)), norm weights 1 + 0.1 N, biases 0.1 N;
    other floats in ``dtype``. No ``lm_head`` when the embeddings are tied (``tie_word_embeddings``,
    default true)."""
    family = FAMILIES[config["model_type"]]
    skeleton = family.Model(family.ModelArgs.from_dict(config))  # lazy parameters: nothing is computed
    quantizable = {f"{path}.weight" for path, m in skeleton.named_modules()
                   if path and hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0}
    tied = config.get("tie_word_embeddings", True)
    mx.random.seed(seed)
    weights: dict[str, mx.array] = {}
    for name, p in tree_flatten(skeleton.parameters()):
        if tied and name.startswith("lm_head."):
            continue
        if name in quantizable:
            rows, cols = p.shape
            std = EMBED_STD if "embed" in name else cols**-0.5
            step = max(1, chunk_elements // cols)
            parts = []
            for r in range(0, rows, step):
                w = mx.random.normal((min(step, rows - r), cols)) * std
                q = mx.quantize(w, group_size=group_size, bits=bits)
                mx.eval(q)
                parts.append(q)
                del w
            wq, scales, biases = (parts[0][j] if len(parts) == 1 else mx.concatenate([part[j] for part in parts])
                                  for j in range(3))
            prefix = name[: -len(".weight")]
            weights[name] = wq
            weights[f"{prefix}.scales"] = scales.astype(dtype)
            weights[f"{prefix}.biases"] = biases.astype(dtype)
            mx.eval(weights[name], weights[f"{prefix}.scales"], weights[f"{prefix}.biases"])
            del parts
        else:
            weights[name] = random_tensor(name, p.shape).astype(dtype)
            mx.eval(weights[name])
    return weights


def load_weights(model: str | None, random: str | None, dtype: mx.Dtype, seed: int = 0) -> tuple[dict, dict, dict]:
    """(config, weights, source description) for a model spec or a random shape name.

    Raises:
        BenchError: unknown shape, or neither/both of ``model`` and ``random``.
    """
    if (model is None) == (random is None):
        raise BenchError("give a MODEL or --random SHAPE (not both)")
    if random is not None:
        if random not in RANDOM_SHAPES:
            raise BenchError(f"unknown random shape {random!r} (known: {', '.join(PUBLIC_SHAPES)})")
        config = {**RANDOM_SHAPES[random], "quantization": dict(RANDOM_QUANTIZATION)}
        weights = random_weights(config, dtype, seed=seed, **RANDOM_QUANTIZATION)
        return config, weights, {"random": random, "quantization": dict(RANDOM_QUANTIZATION), "seed": seed}
    from .gguf import read_gguf
    from .loader import model_identity
    from .modeldir import read_model_dir
    from .resolve import resolve_model

    path = resolve_model(model)
    g = read_model_dir(path) if path.is_dir() else read_gguf(path)
    return g.config, g.weights, {"spec": model, "path": str(path), "identity": model_identity(model, path)}


def peer_model(config: dict, weights: dict[str, mx.array], dtype: mx.Dtype) -> nn.Module:
    """mlx-lm's model class for ``config`` holding the same weights (quantized tensors shared, bits and
    group size read off each tensor as ``build_model`` does), floats cast to ``dtype``."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    family = importlib.import_module(f"mlx_lm.models.{model_type}")
    ref = family.Model(family.ModelArgs.from_dict(config))
    w = dict(weights)
    if hasattr(ref, "sanitize"):
        w = ref.sanitize(w)

    def quant_params(path: str, module: nn.Module):
        scales = w.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_features = module.weight.shape[-1]
        return {"group_size": in_features // scales.shape[-1],
                "bits": w[f"{path}.weight"].shape[-1] * 32 // in_features}

    nn.quantize(ref, class_predicate=quant_params)
    ref.load_weights(list(w.items()), strict=True)
    ref.set_dtype(dtype)
    ref.eval()
    mx.eval(ref.parameters())
    return ref


def weight_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter, except that an untied input embedding
    table is only gathered (one row per token)."""
    params = dict(tree_flatten(model.parameters()))
    total = sum(v.nbytes for v in params.values())
    if any(k.startswith("lm_head.") for k in params):
        emb = {k: v for k, v in params.items() if ".embed_tokens." in k}
        table = sum(v.nbytes for v in emb.values())
        rows = next(v.shape[0] for k, v in emb.items() if k.endswith("embed_tokens.weight"))
        total -= table - table // rows
    return total


def _kv_layout(args, max_kv_size: int | None) -> list[int | None]:
    """Each layer's attention window (None: the whole context): the model's own sliding windows
    (Gemma 3), capped by ``max_kv_size``."""
    windows = []
    for i in range(args.num_hidden_layers):
        w = args.sliding_window if hasattr(args, "is_sliding") and args.is_sliding(i) else None
        if max_kv_size is not None:
            w = max_kv_size if w is None else min(w, max_kv_size)
        windows.append(w)
    return windows


def kv_read_bytes(args, windows: list[int | None], prompt_tokens: int, max_tokens: int, dtype: mx.Dtype,
                  kv_bits: int | None, kv_group_size: int = 64) -> float:
    """Mean K+V bytes read per decode step: step ``t`` (1 .. max_tokens - 1) attends over
    ``prompt_tokens + t`` positions (``min(., window)`` per layer); quantized entries cost
    ``bits/8`` bytes plus a scale and a bias (``dtype``) per ``kv_group_size`` elements."""
    steps = range(1, max_tokens)
    if not steps:
        return 0.0
    per_elem = dtype.size if kv_bits is None else kv_bits / 8 + 2 * dtype.size / kv_group_size
    per_pos = 2 * args.num_key_value_heads * args.head_dim * per_elem
    positions = sum(min(prompt_tokens + t, w) if w else prompt_tokens + t for t in steps for w in windows)
    return per_pos * positions / len(steps)


# --- timing ------------------------------------------------------------------------------------------


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _summary(trials: list[dict]) -> dict:
    return {k: _median([t[k] for t in trials]) for k in ("ttft_s", "prefill_tps", "decode_tps", "total_s")}


def _gen_record(gen) -> dict:
    return {"ttft_s": gen.ttft_s, "prefill_tps": gen.prefill_tps, "decode_tps": gen.decode_tps,
            "total_s": gen.total_s, "generated_tokens": len(gen.token_ids),
            "peak_memory_bytes": gen.peak_memory_bytes, "compiled": getattr(gen, "compiled", None),
            "fused": getattr(gen, "fused", None)}


def _peer_generate(ref, prompt: list[int], max_tokens: int, kind: dict, prefill_step_size: int) -> dict:
    """One mlx-lm ``generate_step`` run with a fresh mlx-lm prompt cache: TTFT is the time to the first
    yielded token, decode tok/s counts the tokens yielded after it."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ref, max_kv_size=kind["max_kv_size"])
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    t_first = t_last = None
    n = 0
    for _tok, _ in generate_step(mx.array(prompt), ref, max_tokens=max_tokens, prompt_cache=cache,
                                 prefill_step_size=prefill_step_size, kv_bits=kind["kv_bits"], kv_group_size=64,
                                 quantized_kv_start=0):
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        n += 1
    ttft, decode_s = t_first - t0, t_last - t_first
    return {"ttft_s": ttft, "prefill_tps": len(prompt) / ttft,
            "decode_tps": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "total_s": t_last - t0, "generated_tokens": n, "peak_memory_bytes": int(mx.get_peak_memory()),
            "compiled": False}


def _time_row(run_once: Callable[[], dict], trials: int, after_warmup: Callable[[], object] = lambda: None) -> dict:
    """One warm-up run (its wall time is ``warmup_s``; not among the trials), then ``trials`` timed
    runs and their medians; ``after_warmup()`` is recorded between the two."""
    warmup = run_once()
    probe = after_warmup()
    timed = [run_once() for _ in range(trials)]
    return {"warmup_s": warmup["total_s"], "warmup": warmup, "after_warmup": probe, "trials": timed,
            "median": _summary(timed)}


# --- the benchmark -----------------------------------------------------------------------------------


def machine_info() -> dict:
    info = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "mlx": mx.__version__, "device": str(mx.default_device()),
        "blas": _blas.STATE.to_dict(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        info["mlx_lm"] = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        info["mlx_lm"] = None
    try:
        dev = mx.device_info()
        info["device_info"] = {k: v for k, v in dev.items() if isinstance(v, (str, int, float))}
    except Exception:  # noqa: BLE001 - not every backend describes itself
        pass
    return info


def _peer_available() -> bool:
    try:
        importlib.import_module("mlx_lm.generate")
        return True
    except ImportError:
        return False


def _load_ours(model, random, dtype, dequantize, seed, batch_size: int = 1):
    """(config, weights, source, our model, dequantized?, load seconds): our model as ``load_model``
    builds it (the "auto" dequantize rule for ``batch_size`` unless ``dequantize`` is a bool, fused
    projections)."""
    t = time.perf_counter()
    config, weights, source = load_weights(model, random, dtype, seed)
    ours = build_model(config, weights, dtype)
    if dequantize == "auto":
        dequantize = should_dequantize(ours, dtype, batch_size)
    if dequantize:
        dequantize_model(ours, dtype)
    fuse_projections(ours)  # as load_model does
    return config, weights, source, ours, dequantize, time.perf_counter() - t


def _check_context(args, prompt_tokens, max_tokens: int) -> int:
    context = int(args.max_position_embeddings)
    for n in prompt_tokens:
        if n + max_tokens > context:
            raise BenchError(f"prompt {n} + {max_tokens} new tokens exceed the model's context ({context})")
    return context


def run_bench(model: str | None = None, *, random: str | None = None, prompt_tokens=(64, 512, 2048),
              max_tokens: int = 256, trials: int = 3, caches=("full",), dequantize: bool | str = "auto",
              peer: bool = True, variants=("eager", "compiled"), json_path: str | Path | None = None,
              prefill_step_size: int = 512, seed: int = 0, echo: Callable[[str], None] = print,
              progress: Callable[[str], None] | None = None, batch_sizes=None, prompts: int = 256,
              prompts_b1: int | None = None) -> dict:
    """Run the benchmark; prints the table with ``echo`` and returns (and with ``json_path`` writes) the
    result document (see ``docs/BENCHMARKS.md``).

    With ``batch_sizes`` it measures job throughput instead (``run_batch_bench``; ``prompts`` and
    ``prompts_b1`` apply there only).

    Raises:
        BenchError: bad settings. Model-loading errors propagate as ``load_model``'s do.
    """
    if batch_sizes:
        return run_batch_bench(model, random=random, batch_sizes=batch_sizes, prompts=prompts, prompts_b1=prompts_b1,
                               prompt_tokens=prompt_tokens[0], max_tokens=max_tokens, trials=trials, caches=caches,
                               dequantize=dequantize, peer=peer, variants=variants, json_path=json_path,
                               prefill_step_size=prefill_step_size, seed=seed, echo=echo, progress=progress)
    progress = progress or (lambda _s: None)
    if trials < 1 or max_tokens < 1 or not prompt_tokens or min(prompt_tokens) < 1:
        raise BenchError("trials, max_tokens and every prompt length must be >= 1")
    kinds = [parse_cache_kind(c) for c in caches]
    for v in variants:
        if v not in ("eager", "compiled", "fused"):
            raise BenchError(f"unknown variant {v!r} (eager, compiled, fused)")
    features = engine_features()
    dtype = compute_dtype("auto")
    notes: list[str] = []

    dequantize_setting = dequantize
    config, weights, source, ours, dequantize, load_s = _load_ours(model, random, dtype, dequantize, seed)
    args = ours.args
    context = _check_context(args, prompt_tokens, max_tokens)
    progress(f"loaded {model or 'random ' + random} in {load_s:.1f}s (dtype {dtype}, dequantized {bool(dequantize)})")

    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, args.vocab_size, n).tolist() for n in prompt_tokens}
    params = GenerateParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    our_weight_bytes = weight_read_bytes(ours)
    rows: list[dict] = []
    skipped: list[dict] = []

    if "compiled" in variants and not features["compile"]:
        skipped.append({"impl": "pipeline", "variant": "compiled", "reason": "this Engine has no compile option"})
        notes.append("compiled variant not run: Engine has no compile option in this checkout (eager only)")
    run_variants = [v for v in variants if v == "eager" or features["compile"]]

    def row_base(impl, variant, kind, n):
        return {"impl": impl, "variant": variant, "cache": kind["name"], "max_kv_size": kind["max_kv_size"],
                "kv_bits": kind["kv_bits"], "prompt_tokens": n, "max_tokens": max_tokens}

    ran_caches = set()
    for kind in kinds:
        if kind["name"] != "full" and not features["cache_spec"]:
            skipped.append({"impl": "pipeline", "cache": kind["name"],
                            "reason": "this Engine has no cache_spec option (full cache only)"})
            continue
        for variant in run_variants:
            kwargs = {"prefill_step_size": prefill_step_size}
            if features["compile"]:
                kwargs["compile"] = variant == "compiled"
            if features["fused"]:  # "auto": a fused row that cannot run is skipped below, not warned about
                kwargs["fused"] = "auto" if variant == "fused" else False
            elif variant == "fused":
                skipped.append({"impl": "pipeline", "variant": variant, "reason": "this Engine has no fused option"})
                continue
            try:
                if features["cache_spec"]:
                    kwargs["cache_spec"] = _cache_spec(kind)
                engine = Engine(ours, eos_token_ids=[], context_length=context, **kwargs)
            except (ValueError, NotImplementedError) as e:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"], "reason": str(e)})
                continue
            if variant == "fused" and engine.fused is None:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"],
                                "reason": f"no fused step: {fused_blocker(ours, engine.cache)}"})
                continue
            windows = _kv_layout(args, kind["max_kv_size"])
            for n in prompt_tokens:
                row = row_base("pipeline", variant, kind, n)
                try:
                    row.update(_time_row(lambda: _gen_record(engine.generate(prompts[n], params)), trials,
                                         after_warmup=lambda: getattr(engine, "trace_count", None)))
                except (ValueError, NotImplementedError) as e:
                    skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                    continue
                row["compiled"] = row["trials"][-1]["compiled"]
                row["fused"] = row["trials"][-1].get("fused")
                if variant == "fused" and not row["fused"]:
                    skipped.append({**row, "reason": "the fused step is not available for this model or machine"})
                    continue
                row["closure_count"] = getattr(engine, "closure_count", None)
                row["trace_count_after_warmup"] = row.pop("after_warmup")
                row["trace_count"] = getattr(engine, "trace_count", None)
                row["weight_read_bytes"] = our_weight_bytes
                row["kv_read_bytes"] = kv_read_bytes(args, windows, n, max_tokens, dtype, kind["kv_bits"])
                rows.append(row)
                ran_caches.add(kind["name"])
                progress(_row_line(row))
            del engine

    peer_info = {"available": _peer_available(), "ran": False}
    if peer and peer_info["available"]:
        t = time.perf_counter()
        ref = peer_model(config, weights, dtype)
        peer_info.update({"ran": True, "function": "mlx_lm.generate.generate_step", "dtype": str(dtype),
                          "dequantized": False, "load_s": time.perf_counter() - t,
                          "prefill_step_size": prefill_step_size, "quantized_kv_start": 0,
                          "weight_read_bytes": weight_read_bytes(ref)})
        from mlx_lm.models.cache import make_prompt_cache

        for kind in kinds:
            if kind["name"] not in ran_caches:
                continue
            # mlx-lm's make_prompt_cache ignores max_kv_size for models with their own make_cache.
            windows = [getattr(c, "max_size", None) for c in make_prompt_cache(ref, max_kv_size=kind["max_kv_size"])]
            same_layout = windows == _kv_layout(args, kind["max_kv_size"])
            if not same_layout:
                notes.append(f"cache {kind['name']}: mlx-lm's prompt cache for this model has another layout "
                             f"(per-layer windows {sorted(set(windows), key=str)}): its make_prompt_cache ignores "
                             f"max_kv_size for models with their own make_cache")
            for n in prompt_tokens:
                row = row_base("mlx-lm", "generate_step", kind, n)
                try:
                    row.update(_time_row(lambda: _peer_generate(ref, prompts[n], max_tokens, kind, prefill_step_size),
                                         trials))
                except (ValueError, NotImplementedError) as e:
                    skipped.append({**row, "reason": f"mlx-lm: {type(e).__name__}: {e}"})
                    continue
                del row["after_warmup"]
                row["cache_layout_matches_ours"] = same_layout
                row["compiled"] = False
                row["weight_read_bytes"] = peer_info["weight_read_bytes"]
                row["kv_read_bytes"] = kv_read_bytes(args, windows, n, max_tokens, dtype, kind["kv_bits"])
                rows.append(row)
                progress(_row_line(row))
        del ref
    elif peer:
        notes.append("peer not run: mlx-lm is not installed")

    for row in rows:
        m = row["median"]
        row["bandwidth_gbps"] = ((row["weight_read_bytes"] + row["kv_read_bytes"]) * m["decode_tps"] / 1e9
                                 if m["decode_tps"] else None)
    for row in rows:
        if row["impl"] != "pipeline":
            continue
        p = next((r for r in rows if r["impl"] == "mlx-lm" and r["cache"] == row["cache"]
                  and r["prompt_tokens"] == row["prompt_tokens"]), None)
        if p is None:
            row["vs_peer"] = None
            continue
        a, b = row["median"], p["median"]
        row["vs_peer"] = {
            "decode_tps": a["decode_tps"] / b["decode_tps"] if a["decode_tps"] and b["decode_tps"] else None,
            "prefill_tps": a["prefill_tps"] / b["prefill_tps"],
            "ttft_s": a["ttft_s"] / b["ttft_s"],
            "same_cache_layout": p["cache_layout_matches_ours"],
        }

    doc = {
        "schema": SCHEMA,
        "machine": machine_info(),
        "settings": {
            "model": source, "prompt_tokens": list(prompt_tokens), "max_tokens": max_tokens, "trials": trials,
            "caches": [k["name"] for k in kinds], "variants": list(variants), "dtype": str(dtype),
            "dequantize": dequantize_setting, "dequantized": bool(dequantize),
            "prefill_step_size": prefill_step_size, "seed": seed, "greedy": True, "ignore_eos": True,
            "engine_features": features, "peer": peer_info,
        },
        "model": {
            "model_type": config["model_type"], "config": config, "context_length": context,
            "parameters": dequantized_nbytes(ours, mx.float32) // 4, "weight_read_bytes": our_weight_bytes,
            "dequantized": bool(dequantize), "load_s": load_s,
        },
        "rows": rows,
        "skipped": skipped,
        "notes": notes,
    }
    echo(format_table(doc))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    return doc


# --- batch mode: job throughput ----------------------------------------------------------------------

WARMUP_TOKENS = 8  # new tokens per prompt in a batch row's warm-up run


class _NoStopTokenizer:
    """The tokenizer ``batch_generate`` is given: no EOS ids, so only ``max_tokens`` ends a sequence
    (random weights can emit the real EOS); texts are not decoded."""

    eos_token_ids: tuple = ()

    def decode(self, _ids) -> str:
        return ""


def distinct_prompts(rng: np.random.Generator, count: int, length: int, vocab: int) -> list[list[int]]:
    """``count`` distinct random prompts of ``length`` token ids below ``vocab``.

    Raises:
        BenchError: fewer than ``count`` distinct prompts exist.
    """
    if vocab**length < count:
        raise BenchError(f"only {vocab}**{length} distinct prompts of {length} tokens exist; asked for {count}")
    seen: set[tuple] = set()
    out: list[list[int]] = []
    while len(out) < count:
        p = tuple(rng.integers(0, vocab, length).tolist())
        if p not in seen:
            seen.add(p)
            out.append(list(p))
    return out


def _job_record(wall_s: float, counts: list[int], **extra) -> dict:
    n = sum(counts)
    return {"wall_s": wall_s, "prompts": len(counts), "generated_tokens": n, "job_tps": n / wall_s,
            "min_tokens_per_prompt": min(counts), "max_tokens_per_prompt": max(counts),
            "peak_memory_bytes": int(mx.get_peak_memory()), **extra}


def _ours_sequential(engine: Engine, prompts: list[list[int]], params: GenerateParams) -> dict:
    """The ``Engine.generate`` loop, one prompt after the other (what a job runs at batch size 1)."""
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gens = [engine.generate(p, params) for p in prompts]
    wall = time.perf_counter() - t0
    return _job_record(wall, [len(g.token_ids) for g in gens], compiled=all(g.compiled for g in gens))


def _ours_batch(be, prompts: list[list[int]], params: GenerateParams) -> dict:
    """Every prompt through ``BatchEngine.run``; the wall time includes each request's prefill."""
    from .engine.batch import Request

    counts: dict[int, int] = {}
    t0 = time.perf_counter()
    for tag, got in be.run(Request(i, p, params) for i, p in enumerate(prompts)):
        if isinstance(got, Exception):
            raise BenchError(f"BatchEngine rejected prompt {tag}: {got}")
        counts[tag] = len(got.token_ids)
    wall = time.perf_counter() - t0
    if len(counts) != len(prompts):
        raise BenchError(f"BatchEngine returned {len(counts)} of {len(prompts)} requests")
    return _job_record(wall, [counts[i] for i in range(len(prompts))], compiled=be.compiled)


def _peer_batch(ref, prompts: list[list[int]], max_tokens: int, batch_size: int, prefill_batch_size: int,
                prefill_step_size: int) -> dict:
    """mlx-lm's ``batch_generate`` over every prompt (completion batch ``batch_size``); the tokens counted
    are the ids it returned."""
    from mlx_lm.generate import batch_generate

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    resp = batch_generate(ref, _NoStopTokenizer(), prompts, max_tokens=max_tokens, return_token_ids=True,
                          completion_batch_size=batch_size, prefill_batch_size=prefill_batch_size,
                          prefill_step_size=prefill_step_size)
    wall = time.perf_counter() - t0
    st = resp.stats
    return _job_record(wall, [len(t) for t in resp.token_ids], compiled=False,
                       peer_stats={"prompt_time": getattr(st, "prompt_time", None),
                                   "generation_tps": getattr(st, "generation_tps", None)})


def _time_job(run_once: Callable[[list[list[int]], int], dict], prompts: list[list[int]], warmup_prompts: int,
              warmup_tokens: int, max_tokens: int, trials: int, probe: Callable[[], object] = lambda: None) -> dict:
    """One warm-up run (``warmup_prompts`` prompts of ``warmup_tokens`` new tokens; its wall time is
    ``warmup_s``), then ``trials`` timed runs of every prompt and their medians."""
    warmup = run_once(prompts[:warmup_prompts], warmup_tokens)
    after = probe()
    timed = [run_once(prompts, max_tokens) for _ in range(trials)]
    return {"warmup_s": warmup["wall_s"], "warmup": warmup, "trials": timed, "after_warmup": after,
            "median": {"job_tps": statistics.median(t["job_tps"] for t in timed),
                       "wall_s": statistics.median(t["wall_s"] for t in timed)}}


def run_batch_bench(model: str | None = None, *, random: str | None = None, batch_sizes=(1, 8, 32, 64, 128),
                    prompts: int = 256, prompts_b1: int | None = None, prompt_tokens: int = 64,
                    max_tokens: int = 128, trials: int = 1, caches=("full",), dequantize: bool | str = "auto",
                    peer: bool = True, variants=("auto",), json_path: str | Path | None = None,
                    prefill_step_size: int = 512, seed: int = 0, echo: Callable[[str], None] = print,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Job throughput (generated tokens / wall seconds, prefill included) of ``prompts`` distinct random
    prompts, greedy, ``ignore_eos``, ``max_tokens`` new tokens each, per batch size B: ours through
    ``pipeline.engine.batch.BatchEngine`` (and at B=1 also the sequential ``Engine.generate`` loop), mlx-lm's
    ``batch_generate`` (completion batch B, prefill batch min(B, 8)) on the same weights as the peer.

    ``variants``: the engine's ``compile`` setting, ``auto`` (what a job uses), ``eager``, ``compiled``.
    Rows at B=1 (sequential, batch and peer) run ``prompts_b1`` prompts (default ``prompts``): their
    rate is per token, and they take longest. Each row: one warm-up run of min(prompts, B + 1) prompts of
    ``WARMUP_TOKENS`` new tokens (every slot filled, then one refilled) (the sequential row: min(prompts, 2) prompts of ``max_tokens``), then
    ``trials`` timed runs; B's rows of ours and mlx-lm run one after the other.

    Raises:
        BenchError: bad settings, or a run that did not generate ``max_tokens`` per prompt.
    """
    from .engine.batch import BatchEngine

    progress = progress or (lambda _s: None)
    batch_sizes = list(batch_sizes)
    prompts_b1 = prompts if prompts_b1 is None else prompts_b1
    if trials < 1 or max_tokens < 1 or prompt_tokens < 1 or prompts < 1 or prompts_b1 < 1:
        raise BenchError("trials, max_tokens, prompt tokens and prompts must be >= 1")
    if not batch_sizes or min(batch_sizes) < 1 or len(set(batch_sizes)) != len(batch_sizes):
        raise BenchError("batch sizes must be distinct integers >= 1")
    for v in variants:
        if v not in ("auto", "eager", "compiled"):
            raise BenchError(f"unknown variant {v!r} (auto, eager, compiled)")
    kinds = [parse_cache_kind(c) for c in caches]
    features = engine_features()
    dtype = compute_dtype("auto")
    notes: list[str] = []
    skipped: list[dict] = []

    dequantize_setting = dequantize
    config, weights, source, ours, dequantize, load_s = _load_ours(model, random, dtype, dequantize, seed,
                                                                   batch_size=max(batch_sizes))
    args = ours.args
    context = _check_context(args, [prompt_tokens], max_tokens)
    progress(f"loaded {model or 'random ' + random} in {load_s:.1f}s (dtype {dtype}, dequantized {bool(dequantize)})")

    rng = np.random.default_rng(seed)
    all_prompts = distinct_prompts(rng, max(prompts, prompts_b1), prompt_tokens, args.vocab_size)
    warmup_tokens = min(max_tokens, WARMUP_TOKENS)

    def n_prompts(b: int) -> int:
        return prompts_b1 if b == 1 else prompts

    def params(n_new: int) -> GenerateParams:
        return GenerateParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)

    peer_info = {"available": _peer_available(), "ran": False}
    ref = None
    if peer and peer_info["available"]:
        t = time.perf_counter()
        ref = peer_model(config, weights, dtype)
        peer_info.update({"ran": True, "function": "mlx_lm.generate.batch_generate", "dtype": str(dtype),
                          "dequantized": False, "load_s": time.perf_counter() - t,
                          "prefill_step_size": prefill_step_size, "prefill_batch_size": "min(B, 8)",
                          "stop_tokens": [], "weight_read_bytes": weight_read_bytes(ref)})
    elif peer:
        notes.append("peer not run: mlx-lm is not installed")

    engines: dict[tuple, Engine] = {}
    run_kinds = []
    for kind in kinds:
        if kind["name"] != "full" and not features["cache_spec"]:
            skipped.append({"impl": "pipeline", "cache": kind["name"],
                            "reason": "this Engine has no cache_spec option (full cache only)"})
            continue
        for variant in variants:
            compile_setting = {"auto": "auto", "eager": False, "compiled": True}[variant]
            try:
                spec = _cache_spec(kind) if features["cache_spec"] else None
                engines[kind["name"], variant] = Engine(
                    ours, eos_token_ids=[], context_length=context, prefill_step_size=prefill_step_size,
                    compile=compile_setting, **({"cache_spec": spec} if features["cache_spec"] else {}))
            except (ValueError, NotImplementedError) as e:
                skipped.append({"impl": "pipeline", "variant": variant, "cache": kind["name"], "reason": str(e)})
                continue
        if any(k[0] == kind["name"] for k in engines):
            run_kinds.append(kind)
        if ref is not None and kind["name"] != "full":
            notes.append(f"cache {kind['name']}: no mlx-lm row (batch_generate is run with full caches only)")

    rows: list[dict] = []

    def base(impl, variant, compile_setting, kind, b):
        return {"mode": "batch", "impl": impl, "variant": variant, "compile": compile_setting, "cache": kind["name"],
                "max_kv_size": kind["max_kv_size"], "kv_bits": kind["kv_bits"], "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens, "batch_size": b, "prompts": n_prompts(b)}

    def add(row, timed):
        row.update(timed)
        row["trace_count_after_warmup"] = row.pop("after_warmup")
        row["compiled"] = row["trials"][-1]["compiled"]
        for t in row["trials"]:
            if (t["min_tokens_per_prompt"], t["max_tokens_per_prompt"]) != (max_tokens, max_tokens):
                raise BenchError(f"{row['impl']} {row['variant']} B={row['batch_size']} generated "
                                 f"{t['min_tokens_per_prompt']}-{t['max_tokens_per_prompt']} tokens per prompt, "
                                 f"not {max_tokens}")
        rows.append(row)
        progress(_batch_row_line(row))

    for b in batch_sizes:
        ps = all_prompts[: n_prompts(b)]
        for kind in run_kinds:
            for variant in variants:
                engine = engines.get((kind["name"], variant))
                if engine is None:
                    continue
                if b == 1:
                    row = base("pipeline", "sequential", variant, kind, 1)
                    try:
                        timed = _time_job(lambda p, n: _ours_sequential(engine, p, params(n)), ps, min(len(ps), 2),
                                          max_tokens, max_tokens, trials, probe=lambda: engine.trace_count)
                    except (ValueError, NotImplementedError) as e:
                        skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                    else:
                        add(row, timed)
                        row["trace_count"] = engine.trace_count
                row = base("pipeline", "batch", variant, kind, b)
                try:
                    be = BatchEngine(engine, b, prompt_tokens + max_tokens)
                    timed = _time_job(lambda p, n: _ours_batch(be, p, params(n)), ps, min(len(ps), b + 1),
                                      warmup_tokens, max_tokens, trials, probe=lambda: be.trace_count)
                except (ValueError, NotImplementedError) as e:
                    skipped.append({**row, "reason": f"{type(e).__name__}: {e}"})
                else:
                    add(row, timed)
                    row["trace_count"] = be.trace_count
                    try:
                        row["kv_bytes"] = be.kv_bytes()
                    except Exception:  # noqa: BLE001 - informational only
                        row["kv_bytes"] = None
                del be
        if ref is not None and any(k["name"] == "full" for k in run_kinds):
            pbs = min(b, 8)
            row = base("mlx-lm", "batch_generate", None, parse_cache_kind("full"), b)
            row["prefill_batch_size"] = pbs
            timed = _time_job(lambda p, n: _peer_batch(ref, p, n, b, pbs, prefill_step_size), ps, min(len(ps), b + 1),
                              warmup_tokens, max_tokens, trials)
            add(row, timed)

    for row in rows:
        if row["impl"] != "pipeline":
            continue
        p = next((r for r in rows if r["impl"] == "mlx-lm" and r["cache"] == row["cache"]
                  and r["batch_size"] == row["batch_size"]), None)
        row["ratio_vs_peer"] = row["median"]["job_tps"] / p["median"]["job_tps"] if p else None
        seq = next((r for r in rows if r["impl"] == "pipeline" and r["variant"] == "sequential"
                    and r["cache"] == row["cache"] and r["compile"] == row["compile"]), None)
        row["speedup_vs_sequential"] = row["median"]["job_tps"] / seq["median"]["job_tps"] if seq else None

    doc = {
        "schema": SCHEMA,
        "machine": machine_info(),
        "settings": {
            "mode": "batch", "model": source, "prompt_tokens": [prompt_tokens], "max_tokens": max_tokens,
            "trials": trials, "caches": [k["name"] for k in kinds], "variants": list(variants), "dtype": str(dtype),
            "dequantize": dequantize_setting, "dequantized": bool(dequantize),
            "prefill_step_size": prefill_step_size, "seed": seed, "greedy": True, "ignore_eos": True,
            "engine_features": features, "peer": peer_info, "batch_sizes": batch_sizes, "prompts": prompts,
            "prompts_b1": prompts_b1, "warmup_tokens": warmup_tokens,
        },
        "model": {
            "model_type": config["model_type"], "config": config, "context_length": context,
            "parameters": dequantized_nbytes(ours, mx.float32) // 4, "weight_read_bytes": weight_read_bytes(ours),
            "dequantized": bool(dequantize), "load_s": load_s,
        },
        "rows": rows,
        "skipped": skipped,
        "notes": notes,
    }
    echo(format_table(doc))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    return doc


# --- output ------------------------------------------------------------------------------------------


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row_line(row: dict) -> str:
    m = row["median"]
    return (f"{row['impl']} {row['variant']} cache={row['cache']} prompt={row['prompt_tokens']}: "
            f"warm-up {row['warmup_s']:.2f}s, TTFT {m['ttft_s'] * 1e3:.1f} ms, prefill {m['prefill_tps']:.1f} tok/s, "
            f"decode {_fmt(m['decode_tps'], '.1f')} tok/s (median of {len(row['trials'])})")


def _batch_row_line(row: dict) -> str:
    m = row["median"]
    compile_setting = f" compile={row['compile']}" if row["compile"] is not None else ""
    return (f"{row['impl']} {row['variant']}{compile_setting} cache={row['cache']} B={row['batch_size']}: "
            f"warm-up {row['warmup_s']:.2f}s, {row['prompts']} prompts in {m['wall_s']:.2f}s, "
            f"{m['job_tps']:.1f} tok/s (median of {len(row['trials'])})")


def _format_batch_table(doc: dict) -> str:
    s, mach, mod = doc["settings"], doc["machine"], doc["model"]
    src = s["model"].get("spec") or f"random {s['model']['random']} (4-bit, group 64)"
    b1 = f" ({s['prompts_b1']} at B=1)" if s["prompts_b1"] != s["prompts"] else ""
    head = [
        f"model: {src}, {mod['model_type']}, {mod['parameters'] / 1e6:.1f}M parameters; "
        f"dtype {s['dtype']}, ours dequantized: {str(mod['dequantized']).lower()}",
        _device_line(mach),
        f"job throughput: {s['prompts']} prompts{b1} of {s['prompt_tokens'][0]} random tokens, {s['max_tokens']} new "
        f"tokens each, greedy, ignore_eos; generated tokens / wall s (prefill included); median of {s['trials']} "
        f"trials after 1 warm-up (warmup_s, excluded)",
    ]
    cols = ["impl", "variant", "compile", "cache", "B", "prompts", "warmup_s", "wall_s", "job_tok/s", "x_peer",
            "x_sequential"]
    lines = []
    for r in doc["rows"]:
        m = r["median"]
        compile_setting = "-" if r["compile"] is None else r["compile"] + ("(compiled)" if r["compiled"] else "(eager)")
        lines.append([r["impl"], r["variant"], compile_setting, r["cache"], str(r["batch_size"]), str(r["prompts"]),
                      f"{r['warmup_s']:.2f}", f"{m['wall_s']:.2f}", f"{m['job_tps']:.1f}",
                      _fmt(r.get("ratio_vs_peer"), ".2f"), _fmt(r.get("speedup_vs_sequential"), ".2f")])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]

    def fmt_line(cells):
        return "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = head + ["", fmt_line(cols)] + [fmt_line(line) for line in lines]
    out.append("x_peer: ours / mlx-lm batch_generate at the same B; x_sequential: ours / our sequential "
               "Engine.generate loop (same compile setting)")
    for sk in doc["skipped"]:
        what = " ".join(f"{k}={sk[k]}" for k in ("impl", "variant", "cache", "batch_size") if k in sk)
        out.append(f"skipped: {what}: {sk['reason']}")
    out += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(out)


def _device_line(mach: dict) -> str:
    """``device: Device(cpu, 0) (x86_64, 2 cores), CPU BLAS: OpenBLAS (...), mlx 0.32.4, mlx-lm 0.32.2, DATE``."""
    blas = mach.get("blas")
    cpu_blas = ""
    if isinstance(blas, dict) and "cpu" in mach["device"]:
        cpu_blas = f", CPU BLAS: {blas['line']}"
    return (f"device: {mach['device']} ({mach['processor']}, {mach['cpu_count']} cores){cpu_blas}, mlx {mach['mlx']}, "
            f"mlx-lm {mach.get('mlx_lm')}, {mach['date']}")


def format_table(doc: dict) -> str:
    """The plain-text table: one line per row, medians of the trials; ``x peer`` columns are
    ours / mlx-lm for tok/s (above 1: ours faster) and ours / mlx-lm for TTFT (below 1: ours faster).
    Batch mode: one line per (implementation, variant, batch size), job tok/s."""
    if doc["settings"].get("mode") == "batch":
        return _format_batch_table(doc)
    s, mach, mod = doc["settings"], doc["machine"], doc["model"]
    src = s["model"].get("spec") or f"random {s['model']['random']} (4-bit, group 64)"
    head = [
        f"model: {src}, {mod['model_type']}, {mod['parameters'] / 1e6:.1f}M parameters; "
        f"dtype {s['dtype']}, ours dequantized: {str(mod['dequantized']).lower()}; "
        f"weights read per token: ours {mod['weight_read_bytes'] / 1e6:.1f} MB"
        + (f", mlx-lm {s['peer']['weight_read_bytes'] / 1e6:.1f} MB" if s["peer"].get("ran") else ""),
        _device_line(mach),
        f"{s['max_tokens']} new tokens, greedy, ignore_eos; median of {s['trials']} trials after 1 warm-up "
        f"(warmup_s: its wall time, excluded)",
    ]
    cols = ["impl", "variant", "cache", "prompt", "warmup_s", "ttft_ms", "prefill_tok/s", "decode_tok/s", "GB/s",
            "decode_x_peer", "prefill_x_peer", "ttft_x_peer"]
    lines = []
    for r in doc["rows"]:
        m, vp = r["median"], r.get("vs_peer") or {}
        variant = r["variant"]
        if r["impl"] == "pipeline" and r.get("compiled") is False and variant == "compiled":
            variant += "(fell back: eager)"
        mark = "*" if vp.get("same_cache_layout") is False else ""
        lines.append([r["impl"], variant, r["cache"], str(r["prompt_tokens"]), f"{r['warmup_s']:.2f}",
                      f"{m['ttft_s'] * 1e3:.1f}", f"{m['prefill_tps']:.1f}", _fmt(m["decode_tps"], ".1f"),
                      _fmt(r["bandwidth_gbps"], ".2f"), _fmt(vp.get("decode_tps"), ".2f") + mark,
                      _fmt(vp.get("prefill_tps"), ".2f") + mark, _fmt(vp.get("ttft_s"), ".2f") + mark])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    def fmt_line(cells):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = head + ["", fmt_line(cols)] + [fmt_line(line) for line in lines]
    if any(r.get("cache_layout_matches_ours") is False for r in doc["rows"]):
        out.append("*: mlx-lm ran another cache layout for this kind (see the notes); not like for like")
    for sk in doc["skipped"]:
        what = " ".join(f"{k}={sk[k]}" for k in ("impl", "variant", "cache", "prompt_tokens") if k in sk)
        out.append(f"skipped: {what}: {sk['reason']}")
    out += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(out)
