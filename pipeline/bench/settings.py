"""Bench settings checked before anything runs: ``BenchError``, cache kinds, the context limit."""

from __future__ import annotations

import os
from pathlib import Path

from ..jobspec import CacheSpec


class BenchError(ValueError):
    """Bad benchmark settings (unknown shape, unparsable cache kind, prompt too long for the model, a
    prompts file that cannot be used): the command line's problem, exit 2."""


class BenchFailed(RuntimeError):
    """A benchmark run broke its own premise (the engine rejected a prompt, returned too few results, or
    generated another token count than asked): a bug, exit 1."""


def check_json_path(json_path) -> None:
    """Refuse a ``--json`` file that could not be written, before anything loads or runs: its directory
    missing, not a directory, or not writable.

    Raises:
        BenchError: one line naming ``--json``, the path and why.
    """
    if json_path is None:
        return
    path = Path(json_path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        why = "a directory"
    elif not parent.exists():
        why = f"its directory {parent} does not exist"
    elif not parent.is_dir():
        why = f"{parent} is not a directory"
    elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        why = "not writable"
    else:
        return
    raise BenchError(f"--json {json_path}: cannot write it: {why}")


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


def _cache_spec(kind: dict) -> CacheSpec | None:
    """The ``Engine``'s ``cache_spec`` for a parsed cache kind (KV groups of 64, quantized from the
    first position); None for ``full`` (the model's own layout).

    Raises:
        JobSpecError: a value ``CacheSpec.check`` rejects.
    """
    if kind["max_kv_size"] is None and kind["kv_bits"] is None:
        return None
    spec = CacheSpec(max_kv_size=kind["max_kv_size"], kv_bits=kind["kv_bits"], kv_group_size=64, quantized_kv_start=0)
    spec.check()
    return spec


def _check_context(args, prompt_tokens, max_tokens: int) -> int:
    """The model's context length in tokens (``args.max_position_embeddings``).

    Raises:
        BenchError: a prompt length + ``max_tokens`` exceeds it.
    """
    context = int(args.max_position_embeddings)
    for n in prompt_tokens:
        if n + max_tokens > context:
            raise BenchError(f"prompt {n} + {max_tokens} new tokens exceed the model's context ({context})")
    return context
