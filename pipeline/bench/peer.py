"""The peer: mlx-lm's model on the same weights, run through its ``generate_step`` and ``batch_generate``.

mlx-lm is imported only here, and only when a run asks for the peer (it is optional).
"""

from __future__ import annotations

import importlib
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..models import dequantize_model
from .shapes import weight_format, weight_read_bytes
from .timing import _job_record


def _peer_available() -> bool:
    try:
        importlib.import_module("mlx_lm.generate")
        return True
    except ImportError:
        return False


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


def load_peer(wanted: bool, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype, notes: list[str],
              function: str, *, dequantize: bool = False, **details) -> tuple[nn.Module | None, dict]:
    """(mlx-lm's model, or None, and the document's ``settings.peer``): the model when ``wanted`` and
    mlx-lm is installed (else a note is appended to ``notes`` if ``wanted``); ``settings.peer`` holds
    ``available`` and ``ran``, and when it ran ``function``, the dtype, ``dequantized``, ``weights``
    (``weight_format``), ``load_s`` (seconds), ``details`` and ``weight_read_bytes``.

    ``dequantize``: expand its quantized layers to ``dtype`` (``models.dequantize_model``, as ours is
    expanded), so that both sides run the same weight format: pass whether ours was dequantized."""
    info = {"available": _peer_available(), "ran": False}
    if not (wanted and info["available"]):
        if wanted:
            notes.append("peer not run: mlx-lm is not installed")
        return None, info
    t = time.perf_counter()
    ref = peer_model(config, weights, dtype)
    if dequantize:
        dequantize_model(ref, dtype)
    info.update({"ran": True, "function": function, "dtype": str(dtype), "dequantized": bool(dequantize),
                 "weights": weight_format(ref), "load_s": time.perf_counter() - t, **details,
                 "weight_read_bytes": weight_read_bytes(ref)})
    return ref, info


def peer_windows(ref: nn.Module, max_kv_size: int | None) -> list[int | None]:
    """Each layer's window in the prompt cache mlx-lm makes for ``ref`` (None: the whole context).
    mlx-lm's ``make_prompt_cache`` ignores ``max_kv_size`` for models with their own ``make_cache``."""
    from mlx_lm.models.cache import make_prompt_cache

    return [getattr(c, "max_size", None) for c in make_prompt_cache(ref, max_kv_size=max_kv_size)]


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


class PeerTokenizer:
    """What ``batch_generate`` reads of a tokenizer: ``eos_token_ids`` (each ends a sequence; the ending
    id is not among the returned ids, as ours leaves it out of ``Generation.token_ids``) and ``decode``
    (called once per sequence at the end). The default has no EOS ids, so only ``max_tokens`` ends a
    sequence (random weights can emit the real EOS), and decodes nothing."""

    def __init__(self, eos_token_ids=(), decode: Callable[[list[int]], str] | None = None):
        self.eos_token_ids = tuple(eos_token_ids)
        self._decode = decode

    def decode(self, ids) -> str:
        return "" if self._decode is None else self._decode(list(ids))


def peer_sampler(temperature: float, top_p: float):
    """mlx-lm's sampler for these settings (``mlx_lm.sample_utils.make_sampler(temp, top_p=...)``, in
    mlx-lm 0.32: ``make_sampler(temp=0.0, top_p=0.0, min_p=0.0, min_tokens_to_keep=1, top_k=0, ...)``,
    top_p applied only in (0, 1)), or None for greedy (``batch_generate``'s default argmax)."""
    if temperature == 0:
        return None
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temperature, top_p=top_p)


def _peer_batch(ref, prompts: list[list[int]], max_tokens: int, batch_size: int, prefill_batch_size: int,
                prefill_step_size: int, tokenizer: PeerTokenizer | None = None, sampler=None) -> dict:
    """mlx-lm's ``batch_generate`` over every prompt (completion batch ``batch_size``; ``sampler`` None:
    greedy); the tokens counted are the ids it returned."""
    from mlx_lm.generate import batch_generate

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    resp = batch_generate(ref, tokenizer or PeerTokenizer(), prompts, max_tokens=max_tokens, return_token_ids=True,
                          completion_batch_size=batch_size, prefill_batch_size=prefill_batch_size,
                          prefill_step_size=prefill_step_size, **({} if sampler is None else {"sampler": sampler}))
    wall = time.perf_counter() - t0
    st = resp.stats
    return _job_record(wall, [len(t) for t in resp.token_ids], compiled=False,
                       peer_stats={"prompt_time": getattr(st, "prompt_time", None),
                                   "generation_tps": getattr(st, "generation_tps", None)})
