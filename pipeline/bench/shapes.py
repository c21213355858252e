"""The models a bench run times: random weights of real shapes or a model spec, and the bytes they read.

Random weights (``RANDOM_SHAPES``) are 4-bit affine quantized (group 64) in memory, one tensor chunk at a
time, so a GPU run needs no download. Our model is built from them as ``load_model`` builds it
(``pipeline.loader.prepare_model``); the weights stay for the peer (``peer.peer_model``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..gguf import read_gguf
from ..loader import model_identity, prepare_model
from ..modeldir import read_model_dir
from ..models import FAMILIES, build_model
from ..models.base import weight_format  # noqa: F401  (the bench modules take it from here)
from ..resolve import resolve_model
from ..tokenizer import Tokenizer
from .settings import BenchError

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
    # Qwen/Qwen3-0.6B (per-head q/k RMSNorms, head_dim 128, tied output projection)
    "qwen3-0.6b": {
        "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
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
    return _read(model, random, dtype, seed)[:3]


def _read(model: str | None, random: str | None, dtype: mx.Dtype, seed: int = 0):
    """``load_weights``'s triple and the model's ``Tokenizer`` (None for random weights)."""
    if (model is None) == (random is None):
        raise BenchError("give a MODEL or --random SHAPE" if model is None else
                         "give a MODEL or --random SHAPE, not both")
    if random is not None:
        if random not in RANDOM_SHAPES:
            raise BenchError(f"unknown random shape {random!r} (known: {', '.join(PUBLIC_SHAPES)})")
        config = {**RANDOM_SHAPES[random], "quantization": dict(RANDOM_QUANTIZATION)}
        weights = random_weights(config, dtype, seed=seed, **RANDOM_QUANTIZATION)
        return config, weights, {"random": random, "quantization": dict(RANDOM_QUANTIZATION), "seed": seed}, None
    path = resolve_model(model)
    g = read_model_dir(path) if path.is_dir() else read_gguf(path)
    return (g.config, g.weights, {"spec": model, "path": str(path), "identity": model_identity(model, path)},
            g.tokenizer)


@dataclass
class BenchModel:
    """The model under test.

    Attributes:
        config: HF-style config dict.
        weights: the weights as read or drawn (the peer is built from these).
        source: where they came from (``load_weights``'s description).
        model: ours, built as ``load_model`` builds it.
        dtype: the compute dtype (``compute_dtype("auto")``).
        dequantize: the setting asked for (true, false or "auto").
        dequantized: whether ours was dequantized.
        load_s: seconds to read (or draw) the weights and build ours.
        tokenizer: the model spec's ``Tokenizer`` (None for random weights).
    """

    config: dict
    weights: dict[str, mx.array]
    source: dict
    model: nn.Module
    dtype: mx.Dtype
    dequantize: bool | str
    dequantized: bool
    load_s: float
    tokenizer: Tokenizer | None = None


def _load_ours(model: str | None, random: str | None, dtype: mx.Dtype, dequantize: bool | str, seed: int,
               batch_size: int = 1) -> BenchModel:
    """The weights of a model spec or random shape, and our model built from them as ``load_model``
    builds it (``prepare_model``: the "auto" dequantize rule for ``batch_size`` unless ``dequantize`` is
    a bool, fused projections).

    Raises:
        BenchError: as ``load_weights``. Model-loading errors propagate as ``load_model``'s do.
    """
    t = time.perf_counter()
    config, weights, source, tokenizer = _read(model, random, dtype, seed)
    ours = build_model(config, weights, dtype)
    dequantized = prepare_model(ours, dtype, dequantize, batch_size)
    return BenchModel(config, weights, source, ours, dtype, dequantize, dequantized, time.perf_counter() - t,
                      tokenizer)


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
        w = args.sliding_window if args.is_sliding(i) else None
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
