"""Read a GGUF file into a HF-style config dict, HF-named MLX weights and a tokenizer.

GGUF key and tensor names: ggml's gguf-py (``gguf/constants.py``, ``gguf/tensor_mapping.py``).
Tensors are read by ``mx.load``, which returns Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized
``(weight, scales, biases)`` triples with group size 32.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .tokenizer import Tokenizer, TokenizerError

SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
# the ids the engine uses (BOS fed by the warm-up, EOS/EOT as stops); a padding id is never used, so not checked
_TOKEN_ID_KEYS = tuple(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot"))
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


class GGUFError(ValueError):
    """The GGUF file cannot be read or describes something unsupported."""


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face terms.

    Attributes:
        config: HF ``config.json``-style dict (``model_type``, ``hidden_size``, ...).
        weights: HF-named tensors; quantized ones as ``.weight`` (uint32) + ``.scales`` + ``.biases``.
        tokenizer: the tokenizer from ``tokenizer.ggml.*`` metadata.
        metadata: the raw GGUF metadata.
        token_ids: the BOS, EOS and EOT ids the metadata declares, each with where
            (``"FILE: GGUF metadata tokenizer.ggml.bos_token_id"``), for ``loader.check_token_ids``.
    """

    config: dict
    weights: dict[str, mx.array]
    tokenizer: Tokenizer
    metadata: dict
    token_ids: list[tuple[str, int]] = field(default_factory=list)


def _scalar(v):
    return v.item() if hasattr(v, "item") else v


# ggml type ids (ggml.h ``enum ggml_type``) that MLX 0.32's ``mx.load`` reads: F32, F16, BF16 (as float16),
# Q4_0/Q4_1/Q8_0 (as affine-quantized triples), Q2_K/Q4_K/Q6_K (as float16). Checked by loading a file with
# each id 0-41: Q5_0, Q5_1, Q8_1, Q3_K, Q5_K, Q8_K, the IQ types, I64, F64 fail ("gguf_tensor_to_f16 failed");
# ids 4-5 crashed the process; ids from 31 (TQ1_0, TQ2_0, MXFP4, ...) ended the tensor list there without an
# error; I8/I16/I32 load as integers, which no weight is.
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
               11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
               19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
               27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
_LOADABLE_TYPES = (0, 1, 30, 2, 3, 8, 10, 12, 14)
# GGUF metadata value types (docs/gguf.md): fixed sizes by type id; 8 is a string, 9 an array.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_types(path: Path) -> list[tuple[str, int]] | None:
    """``(name, ggml type id)`` of every tensor info in the GGUF (v2 or v3) file ``path``, read from its header
    (ggml docs/gguf.md). None for a file this cannot parse (not GGUF, version 1, cut short), which ``mx.load``
    then reports."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            n = take("<Q")
            pos += n
        elif kind == 9:
            item_kind, n = take("<IQ")
            if item_kind in _VALUE_SIZES:
                pos += n * _VALUE_SIZES[item_kind]
            else:
                for _ in range(n):
                    skip_value(item_kind)
        elif kind in _VALUE_SIZES:
            pos += _VALUE_SIZES[kind]
        else:
            raise struct.error(f"unknown metadata value type {kind}")

    try:
        magic, version, n_tensors, n_kv = take("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            return None
        for _ in range(n_kv):
            n = take("<Q")
            pos += n  # the key
            skip_value(take("<I"))
        types = []
        for _ in range(n_tensors):
            n = take("<Q")
            name = bytes(data[pos:pos + n]).decode("utf-8", "replace")
            pos += n
            ndim = take("<I")
            pos += 8 * ndim  # the dimensions
            types.append((name, take("<IQ")[0]))  # type, offset
        return types
    except (struct.error, RecursionError):  # cut short, or arrays nested without end
        return None


def read_gguf(path: str | Path) -> GGUFModel:
    """Read a GGUF llama-architecture model.

    Raises:
        GGUFError: unreadable file, unsupported architecture, a tensor of a type MLX cannot load (named with
            its type id, ``tensor_types``), unknown tensor names, RoPE scaling (an explicit
            ``rope.scaling.type``, or a ``rope.scaling.factor`` / ``rope.scale_linear`` other than 1, which
            llama.cpp takes as linear scaling).
        TokenizerError: unsupported tokenizer.
    """
    path = Path(path)
    try:
        types = tensor_types(path)
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e.strerror or e}") from None
    for name, type_id in types or ():
        if type_id not in _LOADABLE_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has GGML type {type_id} ({_GGML_TYPES.get(type_id, 'unknown')}), "
                            f"which MLX cannot load (supported: {', '.join(_GGML_TYPES[t] for t in _LOADABLE_TYPES)})")
    try:
        tensors, md = mx.load(str(path), return_metadata=True)
    except Exception as e:  # mx.load raises RuntimeError/ValueError with the reason
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from None
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key, default=None, required=True, kind=None):
        """``{arch}.{key}`` as a Python value; ``kind`` int (at least 1) or float checks it is such a number."""
        v = md.get(f"{arch}.{key}")
        if v is None:
            if required and default is None:
                raise GGUFError(f"{path}: GGUF metadata lacks {arch}.{key}")
            return default
        v = v.tolist() if getattr(v, "size", 1) != 1 else _scalar(v)  # a per-layer array is not a number
        if kind is int and not (type(v) is int and v >= 1):
            raise GGUFError(f"{path}: GGUF metadata {arch}.{key} must be a positive integer, got {v!r:.60}")
        if kind is float and type(v) not in (int, float):
            raise GGUFError(f"{path}: GGUF metadata {arch}.{key} must be a number, got {v!r:.60}")
        return v

    n_heads = get("attention.head_count", kind=int)
    hidden = get("embedding_length", kind=int)
    token_ids = []
    for key in _TOKEN_ID_KEYS:
        v = md.get(key)
        if v is not None:
            v = v.tolist() if getattr(v, "size", 1) != 1 else _scalar(v)
            if type(v) is not int:
                raise GGUFError(f"{path}: GGUF metadata {key} must be a token id, got {v!r:.60}")
            token_ids.append((f"{path}: GGUF metadata {key}", v))
    try:
        tok = Tokenizer.from_gguf_metadata(md)
    except TokenizerError as e:
        raise TokenizerError(f"{path}: {e}") from None
    vocab_size = get("vocab_size", required=False, kind=int) or len(md["tokenizer.ggml.tokens"])
    head_dim = (get("attention.key_length", required=False, kind=int)
                or get("rope.dimension_count", required=False, kind=int) or hidden // n_heads)
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count", kind=int),
        "intermediate_size": get("feed_forward_length", kind=int),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads, kind=int),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", kind=float)),
        "rope_theta": float(get("rope.freq_base", 10000.0, kind=float)),
        "max_position_embeddings": get("context_length", 4096, kind=int),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        # GGUF llama Q/K rows are permuted for llama.cpp's interleaved RoPE
        # (convert_hf_to_gguf.py, LlamaModel.permute), so RoPE must be the traditional one.
        "rope_traditional": True,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": list(tok.eos_token_ids),
    }
    # llama.cpp (llama-model.cpp, llm_load_hparams): the scaling type defaults to "linear", and the factor to
    # the old key rope.scale_linear; a factor of 0 or 1 is no scaling.
    factor = get("rope.scaling.factor", required=False, kind=float)
    if factor is None:
        factor = get("rope.scale_linear", required=False, kind=float)
    scaling = get("rope.scaling.type", required=False) or ("linear" if factor not in (None, 0, 1) else None)
    if scaling not in (None, "none"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported for GGUF models")

    weights = {}
    for name, value in tensors.items():
        if name == "rope_freqs.weight":
            raise GGUFError(f"{path}: GGUF rope_freqs (llama3 RoPE scaling) is not supported")
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _LAYER_TENSORS:
            weights[f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"] = value
            continue
        m = _TOP_RE.match(name)
        if m and m.group(1) in _TOP_TENSORS:
            weights[f"{_TOP_TENSORS[m.group(1)]}.{m.group(2)}"] = value
            continue
        raise GGUFError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
    return GGUFModel(config=config, weights=weights, tokenizer=tok, metadata=md, token_ids=token_ids)
