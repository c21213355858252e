"""The job file: typed dataclasses, validated once at load.

Unknown keys are errors naming the key's path (with a did-you-mean); values are type- and
range-checked. Names follow vLLM's ``SamplingParams`` and mlx-lm's flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .resolve import DEFAULT_MODEL


class JobSpecError(ValueError):
    """The job file is invalid; the message names the offending key."""


@dataclass
class InputSpec:
    """Where prompts come from.

    Attributes:
        path: a Parquet file, a directory of Parquet files, or a glob (relative to the working directory).
        id_column: column holding unique row ids (integers or strings); None uses the row index.
        prompt_column: column of user text (string).
        messages_column: column of chat conversations (list of ``{role, content}``); rows where it is
            non-null use it instead of ``prompt_column``.
        system_prompt: system turn prepended when a conversation has none.
        apply_chat_template: render prompts with the model's chat template.
        limit: use only the first ``limit`` input rows.
    """

    path: str
    id_column: str | None = None
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    system_prompt: str | None = None
    apply_chat_template: bool = True
    limit: int | None = None

    def check(self):
        if self.prompt_column is None and self.messages_column is None:
            raise JobSpecError("input: set prompt_column or messages_column")
        if self.limit is not None and self.limit < 1:
            raise JobSpecError(f"input.limit must be >= 1, got {self.limit}")
        if self.messages_column and not self.apply_chat_template:
            raise JobSpecError("input.messages_column needs input.apply_chat_template: true")


@dataclass
class GenerationSpec:
    """Sampling settings (vLLM ``SamplingParams`` names).

    Attributes:
        max_tokens: most tokens generated per row (>= 1).
        temperature: 0 is greedy; > 0 samples.
        seed: job seed; each (seed, row id, sample index) gets its own derived seed.
        ignore_eos: keep generating past EOS (benchmarks).
        skip_special_tokens: drop special tokens from the completion text.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def check(self):
        if self.max_tokens < 1:
            raise JobSpecError(f"generation.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise JobSpecError(f"generation.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.seed < 2**63:
            raise JobSpecError(f"generation.seed must be in [0, 2**63), got {self.seed}")


@dataclass
class EngineSpec:
    """Engine settings.

    Attributes:
        dtype: compute dtype: "auto" (float32 on CPU, where float16 matmuls are far slower;
            float16 on GPU), "float32", "float16" or "bfloat16".
        dequantize: expand quantized weights to ``dtype`` at load: true, false, or "auto" (on the CPU
            with OpenBLAS when the expanded weights fit in 4 GiB; same values, faster matmuls).
        prefill_step_size: prompt tokens per prefill chunk.
        compile: run decode steps through the compiled closure set; false = eager, for comparison.
    """

    dtype: str = "auto"
    dequantize: bool | str = "auto"
    prefill_step_size: int = 512
    compile: bool = True

    def check(self):
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise JobSpecError(f"engine.dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.dequantize not in (True, False, "auto"):
            raise JobSpecError(f"engine.dequantize must be true, false or auto, got {self.dequantize!r}")
        if self.prefill_step_size < 1:
            raise JobSpecError(f"engine.prefill_step_size must be >= 1, got {self.prefill_step_size}")


@dataclass
class CacheSpec:
    """KV cache layout (mlx-lm's ``--max-kv-size``, ``--kv-bits``, ``--kv-group-size`` and
    ``--quantized-kv-start``); see ``pipeline.cache.make_caches``.

    Attributes:
        max_kv_size: keep at most this many positions per layer (full-attention layers become sliding
            windows of this size; sliding layers keep the smaller of their window and this); None: no
            bound.
        kv_bits: store keys and values quantized to 4 or 8 bits; None: unquantized.
        kv_group_size: elements per quantization group along head_dim: 32, 64 or 128 (must divide the
            model's head_dim).
        quantized_kv_start: positions kept unquantized before the cache switches to quantized storage.
    """

    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0

    def check(self):
        if self.max_kv_size is not None and self.max_kv_size < 1:
            raise JobSpecError(f"cache.max_kv_size must be >= 1, got {self.max_kv_size}")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            raise JobSpecError(f"cache.kv_bits must be 4 or 8, got {self.kv_bits}")
        if self.kv_group_size not in (32, 64, 128):
            raise JobSpecError(f"cache.kv_group_size must be 32, 64 or 128, got {self.kv_group_size}")
        if self.quantized_kv_start < 0:
            raise JobSpecError(f"cache.quantized_kv_start must be >= 0, got {self.quantized_kv_start}")


@dataclass
class OutputSpec:
    """Where results go.

    Attributes:
        dir: output directory (shards ``part-NNNNN.parquet`` and ``manifest.json``).
        shard_size: rows per shard.
    """

    dir: str
    shard_size: int = 16

    def check(self):
        if self.shard_size < 1:
            raise JobSpecError(f"output.shard_size must be >= 1, got {self.shard_size}")


@dataclass
class JobSpec:
    """A whole job file."""

    input: InputSpec
    output: OutputSpec
    model: str = DEFAULT_MODEL
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_value(value, tp, where: str):
    """Check ``value`` against annotation ``tp``; returns the value (ints accepted as floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise JobSpecError(f"{where} must not be null")
        options = [a for a in args if a is not type(None)]
        for inner in options[:-1]:
            try:
                return _check_value(value, inner, where)
            except JobSpecError:
                pass
        if len(options) > 1 and not isinstance(value, options[-1]):
            names = " or ".join(a.__name__ for a in options)
            raise JobSpecError(f"{where} must be {names}, got {type(value).__name__} {value!r}")
        return _check_value(value, options[-1], where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise JobSpecError(f"{where} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise JobSpecError(f"{where or 'job'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            path = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(fields)})"
            raise JobSpecError(f"unknown key {path!r}{hint}")
    kwargs = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _check_value(data[name], hints[name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise JobSpecError(f"missing required key {path!r}")
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        obj.check()
    return obj


def job_from_dict(data: dict) -> JobSpec:
    """Validate a parsed job mapping into a ``JobSpec``.

    Raises:
        JobSpecError: unknown keys, wrong types, out-of-range values, missing required keys.
    """
    return _build(JobSpec, data, "")


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a YAML job file.

    Raises:
        JobSpecError: unreadable file, invalid YAML, or an invalid job (message names the key).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise JobSpecError(f"cannot read job file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise JobSpecError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    try:
        return job_from_dict(data if data is not None else {})
    except JobSpecError as e:
        raise JobSpecError(f"{path}: {e}") from None
