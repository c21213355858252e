"""A minimal GGUF v3 writer (ggml's docs/gguf.md layout) and a tiny random llama GGUF built with it, for tests
of what ``pipeline.gguf`` makes of malformed metadata or tensors."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

# GGUF metadata value types (gguf-py ``GGUFValueType``).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
            BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
GGML_F32 = 0
ALIGNMENT = 32

# A byte-level vocabulary: the 256 characters of GPT-2's byte alphabet, then three control tokens.
_BYTE_CHARS = [chr(b) for b in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]]
_BYTE_CHARS += [chr(256 + n) for n in range(256 - len(_BYTE_CHARS))]
TOKENS = _BYTE_CHARS + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = len(TOKENS) - 2, len(TOKENS) - 1
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        item_kind, items = value
        return struct.pack("<IQ", item_kind, len(items)) + b"".join(_value(item_kind, v) for v in items)
    return struct.pack(_FORMATS[kind], value)


def write_gguf(path: Path, kv: dict[str, tuple[int, object]], tensors: list[tuple[str, np.ndarray, int]]) -> Path:
    """Write ``kv`` (key -> (value type, value); an array is ``(ARRAY, (item type, items))``) and ``tensors``
    ((name, data, ggml type id); the data's bytes are written as they are, dims innermost first)."""
    header = struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(kv))
    header += b"".join(_string(k) + struct.pack("<I", kind) + _value(kind, v) for k, (kind, v) in kv.items())
    blobs, offset = [], 0
    for name, data, ggml_type in tensors:
        dims = data.shape[::-1]
        header += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        header += struct.pack("<IQ", ggml_type, offset)
        blob = data.tobytes()
        blob += b"\0" * (-len(blob) % ALIGNMENT)
        blobs.append(blob)
        offset += len(blob)
    header += b"\0" * (-len(header) % ALIGNMENT)
    path.write_bytes(header + b"".join(blobs))
    return path


def tiny_llama_kv() -> dict[str, tuple[int, object]]:
    """The metadata of a llama of hidden size 64, 2 layers, 4 heads (2 KV heads), context 256."""
    return {
        "general.architecture": (STRING, "llama"),
        "llama.embedding_length": (UINT32, 64),
        "llama.block_count": (UINT32, 2),
        "llama.feed_forward_length": (UINT32, 128),
        "llama.attention.head_count": (UINT32, 4),
        "llama.attention.head_count_kv": (UINT32, 2),
        "llama.attention.layer_norm_rms_epsilon": (FLOAT32, 1e-5),
        "llama.context_length": (UINT32, 256),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "gpt2"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, TOKENS)),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, [1] * 256 + [3, 3, 3])),
        "tokenizer.ggml.merges": (ARRAY, (STRING, [])),
        "tokenizer.ggml.bos_token_id": (UINT32, BOS),
        "tokenizer.ggml.eos_token_id": (UINT32, EOS),
        "tokenizer.chat_template": (STRING, TEMPLATE),
    }


def tiny_llama_tensors(seed: int = 0) -> list[tuple[str, np.ndarray, int]]:
    """Random float32 tensors of ``tiny_llama_kv``'s model, GGUF-named (embedding tied)."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (len(TOKENS), 64), "output_norm.weight": (64,)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (64,), f"blk.{i}.ffn_norm.weight": (64,),
                       f"blk.{i}.attn_q.weight": (64, 64), f"blk.{i}.attn_k.weight": (32, 64),
                       f"blk.{i}.attn_v.weight": (32, 64), f"blk.{i}.attn_output.weight": (64, 64),
                       f"blk.{i}.ffn_gate.weight": (128, 64), f"blk.{i}.ffn_up.weight": (128, 64),
                       f"blk.{i}.ffn_down.weight": (64, 128)})
    return [(name, (rng.standard_normal(shape) * 0.1).astype(np.float32), GGML_F32) for name, shape in shapes.items()]


def write_tiny_gguf(path: Path, kv: dict | None = None, tensors: list | None = None) -> Path:
    """``write_gguf`` of the tiny llama with the keys of ``kv`` set (a value of None removes the key)."""
    merged = {**tiny_llama_kv(), **(kv or {})}
    return write_gguf(path, {k: v for k, v in merged.items() if v is not None},
                      tiny_llama_tensors() if tensors is None else tensors)
