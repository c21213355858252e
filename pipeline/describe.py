"""``pipeline inspect``: what a model is (architecture, weights, cache, special tokens), as a dict or text."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import _blas
from .engine.compiled import cpu_compile_blocker
from .loader import compute_dtype, load_model, should_dequantize
from .modeldir import weight_files

_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _stored_dtypes(files: list[Path]) -> dict[str, str]:
    """Tensor name -> dtype as stored in safetensors ``files`` (read from their JSON headers only)."""
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: _SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"].lower())
                    for k, v in header.items() if k != "__metadata__"})
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _weights(model: nn.Module, stored: dict[str, str]) -> tuple[int, dict[str, int]]:
    """(parameter count, tensors per storage kind). A quantized layer is one tensor counted at its
    unquantized size (out_features x in_features); float tensors are named by their stored dtype when
    known (``stored``), else by their dtype in memory."""
    n_params, kinds, seen = 0, Counter(), set()
    for path, m in model.named_modules():
        if isinstance(m, _QUANTIZED):
            n_params += m.weight.shape[0] * m.scales.shape[-1] * m.group_size
            kinds[f"{m.bits}-bit (group {m.group_size})"] += 1
            seen.update(f"{path}.{k}" if path else k for k in ("weight", "scales", "biases"))
    for name, v in tree_flatten(model.parameters()):
        if name not in seen:
            n_params += v.size
            kinds[stored.get(name, str(v.dtype).removeprefix("mlx.core."))] += 1
    return n_params, dict(kinds)


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, quantized layers counted at their unquantized size (as ``describe_model``)."""
    return _weights(model, {})[0]


def _cache_layout(caches: list) -> str:
    """``"22 x RotatingKVCache(512), 4 x KVCache"``: layers per cache kind, in order of first use."""
    kinds = Counter(type(c).__name__ + (f"({c.max_size})" if getattr(c, "max_size", None) else "") for c in caches)
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items())


def describe_model(spec: str) -> dict:
    """Load the model ``spec`` (alias, ``.gguf`` path or model directory) with its stored quantization
    and describe it.

    Returns a JSON-serialisable dict: ``spec``, ``path``, ``format`` ("gguf" or "mlx-dir"),
    ``model_type``, ``parameters`` (quantized layers counted at their unquantized size),
    ``weight_tensors`` (tensors per storage kind, e.g. ``{"4-bit (group 32)": 210, "float32": 61}``),
    ``weight_bytes_on_disk`` (bytes of the model file / weight files), ``weight_bytes_in_memory``
    (bytes of the loaded parameters; float tensors are cast to the compute dtype), ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``context_length``, ``cache_layout``, ``eos_token_ids``, ``eos_tokens``, ``bos_token_id``,
    ``bos_token``, ``add_bos_token``, ``chat_template`` (whether there is one), ``device`` (MLX's default
    device), ``cpu_blas`` (``pipeline._blas.BlasState.to_dict()``; None off the CPU), ``cpu_compile``
    ("available", or why ``mx.compile`` cannot compile on the CPU here; None off the CPU) and ``dequantize_auto``
    (whether a job's ``engine.dequantize: auto`` expands the quantized weights here) and ``compute_dtype``
    (``engine.dtype: auto`` here).

    Raises:
        the errors of ``load_model``.
    """
    lm = load_model(spec, dequantize=False, fuse=False)
    cfg, model, tok = lm.config, lm.model, lm.tokenizer
    files = weight_files(lm.path) if lm.path.is_dir() else [lm.path]
    n_params, kinds = _weights(model, _stored_dtypes(files) if lm.path.is_dir() else {})
    args = model.args
    return {
        "spec": spec,
        "path": str(lm.path),
        "format": "mlx-dir" if lm.path.is_dir() else "gguf",
        "model_type": cfg["model_type"],
        "parameters": n_params,
        "weight_tensors": kinds,
        "weight_bytes_on_disk": sum(f.stat().st_size for f in files),
        "weight_bytes_in_memory": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "context_length": lm.engine.context_length,
        "cache_layout": _cache_layout(model.make_cache()),
        "eos_token_ids": list(tok.eos_token_ids),
        "eos_tokens": [tok.decode([i]) for i in tok.eos_token_ids],
        "bos_token_id": tok.bos_token_id,
        "bos_token": tok.bos_token or None,
        "add_bos_token": tok.add_bos_token,
        "chat_template": bool(tok.chat_template),
        "device": str(mx.default_device()),
        "cpu_blas": _blas.STATE.to_dict() if mx.default_device() == mx.cpu else None,
        "cpu_compile": None if mx.default_device() != mx.cpu else (cpu_compile_blocker() or "available"),
        "dequantize_auto": any("bit" in k for k in kinds) and should_dequantize(model, compute_dtype("auto")),
        "compute_dtype": str(compute_dtype("auto")).removeprefix("mlx.core."),
    }


def format_description(d: dict) -> str:
    """``describe_model``'s dict as aligned ``name: value`` lines."""
    mib = 1 << 20
    eos = ", ".join(f"{i} {t!r}" for i, t in zip(d["eos_token_ids"], d["eos_tokens"])) or "none"
    bos = "none" if d["bos_token_id"] is None else f"{d['bos_token_id']} {d['bos_token']!r}"
    rows = [
        ("model", d["spec"]),
        ("path", d["path"]),
        ("format", d["format"]),
        ("model_type", d["model_type"]),
        ("parameters", f"{d['parameters']:,} ({d['parameters'] / 1e6:.1f}M)"),
        ("weights", ", ".join(f"{k} x {_plural(n, 'tensor')}" for k, n in d["weight_tensors"].items())),
        ("weight bytes", f"{d['weight_bytes_on_disk'] / mib:.1f} MiB on disk, "
                         f"{d['weight_bytes_in_memory'] / mib:.1f} MiB in memory"),
        ("hidden size", d["hidden_size"]),
        ("layers", d["num_hidden_layers"]),
        ("heads", f"{d['num_attention_heads']} ({d['num_key_value_heads']} kv), head_dim {d['head_dim']}"),
        ("context length", d["context_length"]),
        ("cache", d["cache_layout"]),
        ("eos", eos),
        ("bos", f"{bos}, {'added' if d['add_bos_token'] else 'not added'} to prompts"),
        ("chat template", "yes" if d["chat_template"] else "no"),
        ("device", d["device"]),
    ]
    if d["cpu_blas"] is not None:
        rows.append(("cpu blas", d["cpu_blas"]["line"]))
        rows.append(("cpu compile", d["cpu_compile"] if d["cpu_compile"] == "available"
                     else f"no: {d['cpu_compile']}; decode runs eagerly"))
    if any("bit" in k for k in d["weight_tensors"]):
        rows.append(("jobs here", f"expand the quantized weights to {d['compute_dtype']} (engine.dequantize: auto)"
                     if d["dequantize_auto"] else "keep the quantized weights (engine.dequantize: auto)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)
