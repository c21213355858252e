"""Read an MLX / Hugging Face model directory: ``config.json``, ``model*.safetensors`` (optionally
sharded with ``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, ``chat_template.jinja`` — the layout ``mlx_lm.convert`` writes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .tokenizer import Tokenizer


class ModelDirError(ValueError):
    """The model directory lacks a file or holds an unreadable one; the message names it."""


@dataclass
class ModelDir:
    """What a model directory holds.

    Attributes:
        config: ``config.json`` (with ``eos_token_id`` replaced by the union of every EOS id declared).
        weights: safetensors tensors by name.
        tokenizer: the tokenizer with chat template and special tokens.
        token_ids: the BOS id used and every EOS id ``config.json`` and ``generation_config.json`` declare, each with
            where it is declared (``"DIR/config.json: eos_token_id"``), for ``loader.check_token_ids``.
    """

    config: dict
    weights: dict[str, mx.array]
    tokenizer: Tokenizer
    token_ids: list[tuple[str, int]] = field(default_factory=list)


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ModelDirError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model in ``path``.

    Raises:
        ModelDirError: no weights, or an index naming a missing shard.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        if not (isinstance(weight_map, dict) and all(isinstance(n, str) for n in weight_map.values())):
            raise ModelDirError(f"{index}: weight_map must be an object of tensor name -> file name, "
                                f"got {weight_map!r:.60}")
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{index}: shard(s) {', '.join(missing)} not found")
        return files
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ModelDirError(f"{path}: no model*.safetensors weights found")
    return files


def model_files(path: Path) -> list[Path]:
    """Every file whose content determines the model's outputs (for fingerprints)."""
    names = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
             "chat_template.jinja", "special_tokens_map.json"]
    return [path / n for n in names if (path / n).is_file()] + weight_files(path)


def _ids(file: Path, config: dict, key: str) -> list[int]:
    """``config[key]``, a token id or a list of them (absent or null: none).

    Raises:
        ModelDirError: another value (a string, a float, a list holding one), naming ``file`` and ``key``.
    """
    value = config.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelDirError(f"{file}: {key} must be a token id or a list of token ids, got {value!r:.60}")
    return ids


def read_model_dir(path: str | Path) -> ModelDir:
    """Read a model directory.

    EOS ids are the union of ``config.json``'s ``eos_token_id`` (int or list), ``generation_config.json``'s,
    and the tokenizer config's ``eos_token``.

    Raises:
        ModelDirError: missing or unreadable files (named), token ids that are not integers (file and key named).
        TokenizerError: a tokenizer that cannot be built.
    """
    path = Path(path)
    config = _read_json(path / "config.json")
    gen_config = _read_json(path / "generation_config.json", required=False)
    weights = {}
    for f in weight_files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mx.load raises RuntimeError/ValueError with the reason
            raise ModelDirError(f"{f}: cannot read safetensors ({e})") from None
    config_file, gen_file = path / "config.json", path / "generation_config.json"
    declared = {f: {key: _ids(f, cfg, key) for key in ("bos_token_id", "eos_token_id")}
                for f, cfg in ((config_file, config), (gen_file, gen_config))}  # each checked, used or not
    bos_file = config_file if "bos_token_id" in config else gen_file  # the BOS id used: config.json's wins
    bos_ids = declared[bos_file]["bos_token_id"][:1]
    eos = [(f, i) for f in (config_file, gen_file) for i in declared[f]["eos_token_id"]]  # every one stops generation
    tokenizer = Tokenizer.from_model_dir(path, extra_eos_ids=[i for _, i in eos],
                                         bos_token_id=bos_ids[0] if bos_ids else None)
    token_ids = [(f"{bos_file}: bos_token_id", i) for i in bos_ids] + [(f"{f}: eos_token_id", i) for f, i in eos]
    config = {**config, "eos_token_id": list(tokenizer.eos_token_ids)}
    return ModelDir(config=config, weights=weights, tokenizer=tokenizer, token_ids=token_ids)
