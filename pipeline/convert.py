"""``pipeline convert``: a GGUF llama model -> an MLX model directory (as ``mlx_lm.convert`` writes).

Quantized tensors are kept as they are (MLX affine, group size 32, bits per tensor); Q/K rows are
un-permuted so the standard (non-interleaved) RoPE applies, which makes the directory loadable by
``mlx_lm.load`` and by ``pipeline`` alike.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from .gguf import read_gguf


class ConvertError(RuntimeError):
    """DST cannot be written: its parent is a file, a read-only or special file system, no space left. One line
    naming DST and the OS's reason; the CLI exits with ``exit_code``: 1 for no space left (as ``pipeline run``),
    else 2 (the command line's destination)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def unpermute_rows(n_rows: int, n_heads: int) -> mx.array:
    """Row order that undoes llama.cpp's Q/K permutation.

    ``convert_hf_to_gguf.py`` (LlamaModel.permute) writes HF rows ``h, j, i`` (head, half, index) as
    ``h, i, j``: ``w.reshape(n_heads, 2, hd // 2, ...).swapaxes(1, 2)``. Taking GGUF rows in this order
    gives back the HF rows. Returns int32 indices ``(n_rows,)``.
    """
    head_dim = n_rows // n_heads
    idx = np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
    return mx.array(idx.astype(np.int32))


# What ``write_model_dir`` writes: a directory holding only these files is one an earlier convert wrote.
MODEL_DIR_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a ``dst`` that exists, unless ``overwrite`` and it is an empty directory or one an earlier
    convert wrote (regular files named in ``MODEL_DIR_FILES``, ``config.json`` among them) not holding
    ``src`` nor the current directory (which would be left deleted under the shell): anything else in it
    would be deleted with it, as ``export --overwrite`` refuses a directory that is not a saved dataset."""
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(f"{dst} already exists (use --overwrite)")
    if dst.is_symlink() or not dst.is_dir():
        raise FileExistsError(f"{dst}: exists and is not a directory; not replacing it")
    if dst.resolve() in src.resolve().parents:
        raise FileExistsError(f"{dst}: holds the source {src}; not replacing it")
    from .export import within

    if within(Path.cwd(), dst):
        raise FileExistsError(f"{dst}: is the current directory or holds it; not replacing it")
    entries = list(dst.iterdir())
    ours = all(p.name in MODEL_DIR_FILES and p.is_file() and not p.is_symlink() for p in entries)
    if entries and not (ours and (dst / "config.json").is_file()):
        raise FileExistsError(f"{dst}: a directory that convert did not write (it holds more than "
                              f"{', '.join(MODEL_DIR_FILES)}); not replacing it")


def convert_gguf(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write the GGUF llama model ``src`` as an MLX model directory ``dst``.

    Writes ``model.safetensors``, ``config.json`` (HF names, ``quantization`` with per-layer overrides
    where a tensor's bits differ from the most common), ``tokenizer.json``, ``tokenizer_config.json``
    (special tokens, ``add_bos_token``, the chat template) and ``generation_config.json``. The directory
    appears complete or not at all (written beside it, then renamed). With ``overwrite`` an existing ``dst``
    is replaced only if it is an empty directory or one an earlier convert wrote (``_check_destination``).

    Raises:
        FileExistsError: ``dst`` exists and ``overwrite`` is false, or it is not a directory that may be
            replaced (a file, a link, a directory holding ``src``, the current directory or one holding it,
            or one with files convert does not write).
        ConvertError: ``dst`` cannot be written (``export.destination_error``: its parent is a file, a
            read-only or special file system; no space left, exit_code 1); nothing of it is left behind,
            parent directories made for it included.
        GGUFError, TokenizerError: ``src`` is unreadable or unsupported.
    """
    src, dst = Path(src), Path(os.path.abspath(dst))  # "." has no name to write beside, nor a parent
    _check_destination(src, dst, overwrite)
    g = read_gguf(src)
    cfg = dict(g.config)
    weights = dict(g.weights)
    for proj, heads in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"])):
        for name in [k for k in weights if f".self_attn.{proj}." in k]:
            w = weights[name]
            weights[name] = w[unpermute_rows(w.shape[0], heads)]
    cfg["rope_traditional"] = False

    quant = {}
    for name in weights:
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            groups = weights[name].shape[-1]
            in_features = groups * 32
            quant[base] = {"group_size": 32, "bits": weights[base + ".weight"].shape[-1] * 32 // in_features}
    if quant:
        (bits, group), _ = Counter((q["bits"], q["group_size"]) for q in quant.values()).most_common(1)[0]
        cfg["quantization"] = {"group_size": group, "bits": bits}
        cfg["quantization"].update({k: q for k, q in quant.items() if (q["bits"], q["group_size"]) != (bits, group)})
    cfg["architectures"] = ["LlamaForCausalLM"]
    tok = g.tokenizer

    from .export import destination_error

    made = [a for a in [dst.parent, *dst.parent.parents] if not a.exists()]  # removed again on failure
    tmp = None
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700
        write_model_dir(tmp, cfg, weights, tok)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for a in made:  # deepest first
            try:
                a.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise destination_error("DST", dst, e, ConvertError) from None
        raise
    return dst


def bos_post_processor(bos: str, bos_id: int) -> dict:
    """The ``tokenizer.json`` post-processor that puts BOS before each sequence, as Hugging Face's Llama 3
    tokenizer.json has it (TemplateProcessing, single ``<bos> $A``, pair ``<bos> $A <bos> $B``): readers that
    encode with special tokens (``mlx_lm.load``, transformers' ``AutoTokenizer``) then add BOS as the GGUF asks."""
    def special(type_id):
        return {"SpecialToken": {"id": bos, "type_id": type_id}}

    def seq(name, type_id):
        return {"Sequence": {"id": name, "type_id": type_id}}

    return {"type": "TemplateProcessing", "single": [special(0), seq("A", 0)],
            "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def with_bos(tok_json: dict, bos: str, bos_id: int) -> dict:
    """The post-processor for ``tok_json`` (a ``tokenizer.json`` as a dict) that puts BOS first: its own one
    followed by ``bos_post_processor`` in a ``Sequence`` (as Hugging Face's Llama 3 tokenizer.json has
    ``Sequence[ByteLevel, TemplateProcessing]``), ``bos_post_processor`` alone when it has none, or its own
    unchanged when that already puts ``bos_id`` first."""
    existing = tok_json.get("post_processor")
    if existing is None:
        return bos_post_processor(bos, bos_id)
    if HFTokenizer.from_str(json.dumps(tok_json)).encode("").ids[:1] == [bos_id]:
        return existing
    earlier = existing["processors"] if existing.get("type") == "Sequence" else [existing]
    return {"type": "Sequence", "processors": [*earlier, bos_post_processor(bos, bos_id)]}


def write_model_dir(path: Path, config: dict, weights: dict, tokenizer) -> None:
    """Write an HF-style model directory into the existing folder ``path``: ``model.safetensors``,
    ``config.json``, ``tokenizer.json`` (BOS added by its post-processor when the tokenizer adds BOS: ``with_bos``),
    ``tokenizer_config.json`` (BOS/EOS, ``add_bos_token``, chat template) and ``generation_config.json``
    (BOS and every EOS id).

    Raises:
        OSError: a write failed; MLX's failed write of the weights as ENOSPC when the file system has less free
            space than the weights' bytes, else with MLX's message.
    """
    tok = tokenizer
    try:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    except RuntimeError as e:  # MLX's writer names no errno: "[write] Unable to write N bytes to file."
        needed = sum(w.nbytes for w in weights.values())
        if shutil.disk_usage(path).free < needed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
        raise OSError(f"{path / 'model.safetensors'}: {e}") from None
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tok_json = json.loads(tok.to_str())
    if tok.add_bos_token and tok.bos_token_id is not None:
        tok_json["post_processor"] = with_bos(tok_json, tok.bos_token, tok.bos_token_id)
    (path / "tokenizer.json").write_text(json.dumps(tok_json, indent=2, ensure_ascii=False), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token or None,
        "eos_token": tok.eos_token or None,
        "add_bos_token": tok.add_bos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if tok.chat_template:
        tok_cfg["chat_template"] = tok.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}, indent=2))
