"""The job file: typed dataclasses, validated once at load.

Unknown keys are errors naming the key's path (with a did-you-mean); values are type- and
range-checked. Names follow vLLM's ``SamplingParams`` and mlx-lm's flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import yaml

from .engine.params import INT32_LIMIT, GenerateParams
from .engine.structured import KEYS, StructuredOutputsParams, problem_line
from . import row_template
from .errors import JobSpecError
from .resolve import DEFAULT_MODEL

# generation.n: samples per input row. Every sample is planned (one (row, sample index) entry, about 170 bytes
# in `pipeline validate`) before anything runs, so an absurd n exhausts memory instead of failing; 2**16 is
# far above repeated-sampling studies (10,000 samples a problem) and plans one row in about 11 MB.
MAX_N = 2**16
# Memory sizes in gigabytes (cache.prefix_cache_gb, engine.max_kv_memory_gb) become byte counts
# (int(gb * 10**9)); 10**6 GB (a petabyte) is far above any device's memory, catches a size given in bytes by
# mistake, and keeps the byte count finite and within int64.
MAX_MEMORY_GB = 10**6


class _Problems(list):
    """Problems found by a ``check()``; ``raise_any()`` raises them together as one ``JobSpecError``."""

    def raise_any(self):
        if self:
            raise JobSpecError(self)


@dataclass
class DatasetSpec:
    """A Hugging Face hub dataset, read with ``datasets.load_dataset(name, config, split=split,
    revision=revision, streaming=True)``.

    Attributes:
        name: the dataset's repo id (``owner/name``).
        config: its configuration (subset) name, or None for the default.
        split: the split to read.
        revision: a branch, tag or commit; None for the default branch.
    """

    name: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None

    def check(self):
        """Raises: JobSpecError: an empty name or split."""
        bad = _Problems()
        if not self.name:
            bad.append("input.dataset.name must be a non-empty string")
        if not self.split:
            bad.append("input.dataset.split must be a non-empty string")
        bad.raise_any()


@dataclass
class FilterSpec:
    """One condition on an input column: keep rows whose ``column`` equals ``equals``, or is one of
    ``one_of``. Rows where the column is null never match.

    Attributes:
        column: the input column.
        equals: the value to match (string, number or boolean).
        one_of: the values to match (a non-empty list).
    """

    column: str
    equals: str | int | float | bool | None = None
    one_of: list[str | int | float | bool] | None = None

    def check(self):
        """Raises: JobSpecError: not exactly one of ``equals`` and ``one_of``, or an empty ``one_of``."""
        bad = _Problems()
        if (self.equals is None) == (self.one_of is None):
            bad.append(f"input.filter on column {self.column!r}: set exactly one of equals or one_of")
        elif self.one_of is not None and not self.one_of:
            bad.append(f"input.filter on column {self.column!r}: one_of must not be empty")
        bad.raise_any()


@dataclass
class InputSpec:
    """Where prompts come from and which rows are used.

    Rows are selected in this order: ``filter`` (keep matching rows), then ``shuffle_seed`` (reorder
    them), then ``limit`` (keep the first N).

    Attributes:
        path: a Parquet, JSON Lines (``.jsonl``), JSON (``.json``) or CSV (``.csv``) file, a directory of
            such files (searched recursively, one format), or a glob (relative to the working directory).
            Parquet is read with pyarrow; the others with ``datasets.load_dataset`` in streaming mode.
        dataset: a Hugging Face hub dataset instead of ``path`` (exactly one of the two is set).
        id_column: column holding unique row ids (integers or strings); None uses the row's position in
            the input (before filtering and shuffling).
        prompt_column: column of user text (string); unused when ``template`` is set.
        messages_column: column of chat conversations (list of ``{role, content}``); rows where it is
            non-null use it instead of ``prompt_column`` / ``template``.
        template: a jinja2 template building each row's prompt from its columns, e.g.
            ``"Question: {{ question }}\\nAnswer:"`` (sandboxed; a column it names must exist; a null value
            it prints fails the row, as does an error it raises, unless it raises on every row: then the job
            stops before the model loads). The rendered text becomes the user turn of the chat template.
        filter: one condition or a list of conditions (all must hold) on input columns; a list after loading.
        shuffle_seed: reorder the rows by a hash of (seed, row id): the same seed gives the same order on
            every run and machine; None keeps the input order.
        system_prompt: system turn prepended when a conversation has none.
        apply_chat_template: render prompts with the model's chat template.
        limit: use only the first ``limit`` rows (after filter and shuffle).
        parse_special_tokens: when false (the default), special-token text inside prompt and message
            content (a user string containing ``<|im_end|>``, say) is encoded as plain text, so input
            data cannot forge chat turns; only the chat template's own markup yields special tokens.
            True encodes the whole rendered prompt with special tokens parsed, as HF transformers does.
        truncate: a prompt that does not fit the model's context (with room for one generated token):
            "error" fails the row; "left" drops its first tokens (keeping a BOS the tokenizer adds,
            ``Tokenizer.add_bos_token``); "right" drops its last. The first row cut is logged, once per run.
        row_overrides: input columns named like generation keys (``ROW_OVERRIDES``: max_tokens,
            temperature, stop, ...) set that key for their row where non-null; false ignores them.
        choices_column: ``task: score``: column of lists of strings, the continuations (choices) scored
            after each row's context (its prompt, messages or template, built as for generation).
        continuation_column: ``task: score``: column of one string per row, the one continuation scored
            (instead of ``choices_column``).
        order: the order rows run in: "input" (as selected), or "prefix": sorted by their prompt token ids,
            so rows sharing a prefix run one after another and reuse it while it is in the prefix cache
            (``cache.prefix_cache_gb``). Row keys, resume and ``pipeline export``'s order do not change.
        structured_column: column of one JSON string per row holding that row's ``generation.structured``
            mapping (e.g. ``{"regex": "[0-9]+"}``), which replaces the job's for the row; null: the job's
            (unconstrained when it has none). A value that does not parse or compile fails its row.
    """

    path: str | None = None
    dataset: DatasetSpec | None = None
    id_column: str | None = None
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    template: str | None = None
    filter: list[FilterSpec] | FilterSpec | None = None
    shuffle_seed: int | None = None
    system_prompt: str | None = None
    apply_chat_template: bool = True
    limit: int | None = None
    parse_special_tokens: bool = False
    truncate: str = "error"
    row_overrides: bool = True
    choices_column: str | None = None
    continuation_column: str | None = None
    order: str = "input"
    structured_column: str | None = None

    def __post_init__(self):
        if isinstance(self.filter, FilterSpec):
            self.filter = [self.filter]

    def check(self):
        """Raises: JobSpecError: every value out of range; a ``template`` that does not compile (a syntax
        error, an unknown filter or test)."""
        bad = _Problems()
        if self.path is None and self.dataset is None:
            bad.append("input: set path (a file, directory or glob) or dataset")
        if self.path is not None and self.dataset is not None:
            bad.append("input: set path or dataset, not both")
        if self.prompt_column is None and self.messages_column is None and self.template is None:
            bad.append("input: set prompt_column or messages_column (or template)")
        if self.limit is not None and self.limit < 1:
            bad.append(f"input.limit must be >= 1, got {self.limit}")
        if self.shuffle_seed is not None and not 0 <= self.shuffle_seed < 2**63:
            bad.append(f"input.shuffle_seed must be in [0, 2**63), got {self.shuffle_seed}")
        if self.template is not None:
            try:  # an unknown filter or test, inside {% if %} too, is found here
                row_template.compile_template(self.template)
            except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError (unknown filter, test) included
                bad.append(f"input.template does not compile: {e.message} (line {e.lineno})")
        if self.truncate not in ("error", "left", "right"):
            bad.append(f"input.truncate must be error, left or right, got {self.truncate!r}")
        if self.messages_column and not self.apply_chat_template:
            bad.append("input.messages_column needs input.apply_chat_template: true")
        if self.system_prompt is not None and not self.apply_chat_template:
            bad.append("input.system_prompt needs input.apply_chat_template: true (a raw prompt has no system turn)")
        if self.order not in ("input", "prefix"):
            bad.append(f"input.order must be input or prefix, got {self.order!r}")
        bad.raise_any()


@dataclass(frozen=True)
class GenerationSpec(GenerateParams):
    """The job's ``generation`` settings: every field of ``pipeline.engine.GenerateParams`` (sampling and
    stop settings with vLLM ``SamplingParams``'s names, meanings and ranges; each field's exact effect is
    documented there), plus what a job adds. ``seed`` is the job seed: each (seed, row id, sample index)
    gets its own derived seed (``engine.sampler.row_seed``).

    Attributes:
        n: samples per input row (output rows with ``sample_index`` 0..n-1), in [1, ``MAX_N``] (65536):
            every sample of every row is planned in memory before the run (and by ``pipeline validate``),
            so the cap turns a mistyped n into an error instead of an out-of-memory kill, far above any
            repeated-sampling use; an input column ``n`` over it fails its row.

    In a job file ``stop`` may be one string; ``stop`` and ``stop_token_ids`` are lists there (tuples
    here: ``GenerateParams`` turns them). Ranges: ``check``.
    """

    n: int = 1

    def to_dict(self) -> dict:
        """The settings as JSON values (tuples as lists), as the fingerprint and the manifest record them;
        ``structured`` only when set (fingerprints of jobs written before it existed hold)."""
        out = _plain(dataclasses.asdict(self))
        if out["structured"] is None:
            del out["structured"]
        else:
            out["structured"] = {k: v for k, v in out["structured"].items() if v not in (None, False)}
        return out

    def check(self, where: str = "generation."):
        """Range checks (``GenerateParams.problems``, and ``n``); ``where`` prefixes the key in messages (an
        input column for row overrides).

        Raises:
            JobSpecError: every value out of range, one problem each.
        """
        problems = _Problems(self.problems(where))
        if self.n < 1:
            problems.append(f"{where}n must be >= 1, got {self.n!r}")
        elif self.n > MAX_N:
            problems.append(f"{where}n must be <= {MAX_N} (samples per row), got {self.n!r}")
        problems.raise_any()


def structured_from_cell(text, where: str) -> StructuredOutputsParams:
    """One ``input.structured_column`` cell (a JSON string holding a ``generation.structured`` mapping)
    as ``StructuredOutputsParams``, checked like the job key.

    Raises:
        JobSpecError: one line starting with ``where``: not a string, not JSON, not a mapping, an unknown
            key, a value of the wrong type, or a schema / regex / grammar that does not compile
            (``StructuredOutputsParams.problem``); several problems joined by "; ", e.g.
            "input.structured_column 'format' of row 'r9': unknown key 'extra' (known: ...)" or
            "... of row 'r9': regex must be a string, got int 5".
    """
    if not isinstance(text, str):
        raise JobSpecError(f"{where}: must be a JSON string, got {type(text).__name__}")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise JobSpecError(f"{where}: is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise JobSpecError(f"{where}: must be a JSON object such as {{\"regex\": \"...\"}}, got {type(data).__name__}")
    problems = _unknown_keys(data, KEYS, "")
    params = StructuredOutputsParams(**{k: v for k, v in data.items() if k in KEYS})
    found = params.problem()
    if found is not None:
        problems.append(problem_line("", *found))
    if problems:
        raise JobSpecError(f"{where}: " + "; ".join(problems))
    return params


# Generation keys an input column of the same name may set per row.
ROW_OVERRIDES = ("max_tokens", "min_tokens", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids")


def with_overrides(spec: GenerationSpec, overrides: dict) -> GenerationSpec:
    """``spec`` with one row's override values (``{column: value}``, nulls already dropped), type- and
    range-checked like the job file.

    Raises:
        JobSpecError: one problem per bad column, naming it, e.g. "input column 'temperature' must be ...".
    """
    if not overrides:
        return spec
    hints = typing.get_type_hints(GenerationSpec)
    values, problems = {}, _Problems()
    for name, value in overrides.items():
        where = f"input column {name!r}"
        if hints[name] is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # integer columns with nulls often arrive as float64 (pandas)
        try:
            values[name] = _check_value(value, hints[name], where)
        except JobSpecError as e:
            problems += e.problems
    problems.raise_any()
    out = dataclasses.replace(spec, **values)
    try:
        out.check(where="input column ")
    except JobSpecError as e:
        raise JobSpecError([re.sub(r"^input column (\w+)", r"input column '\1'", p) for p in e.problems]) from None
    return out


@dataclass
class EngineSpec:
    """Engine settings.

    Attributes:
        dtype: compute dtype: "auto" (float32 on CPU, where float16 matmuls are far slower;
            float16 on GPU), "float32", "float16" or "bfloat16".
        dequantize: expand quantized weights to ``dtype`` at load: true, false, or "auto" (on the CPU
            with OpenBLAS when the expanded weights fit in 4 GiB; on a GPU for ``batch_size`` > 1 when
            they take at most a quarter of its memory; ``pipeline.loader.should_dequantize``).
        prefill_step_size: prompt tokens per prefill chunk, in [1, 2**31).
        compile: run decode steps through the compiled closure set: true, false (eager), or "auto"
            (compiled, except on the CUDA backend with only full caches, where eager decode measured
            faster; ``pipeline.engine.step.compile_by_default``).
        fused: decode through the fused CUDA step (``pipeline.engine.cuda``: five custom kernels per layer)
            where it applies (MLX's CUDA backend, Llama/Qwen2 families, full KV caches, sequential
            decoding): "auto" or true; false keeps the unfused step. Same model to rounding; "auto" is
            left out of the job fingerprint, so jobs written before the option existed resume.
        batch_size: rows decoded together (continuous batching, ``pipeline.engine.batch``); 1 decodes one row
            at a time (the default: every row's tokens are exactly those of the model run alone); "auto": the
            largest batch whose KV buffers fit (``engine.batch.check_kv_memory``'s limit) for the job's
            longest prompt + max_tokens, at most ``run.local.AUTO_BATCH_GPU`` (256) on a GPU and
            ``run.local.AUTO_BATCH_CPU`` (8) on the CPU (``run.local.auto_batch_size``); the fingerprint holds
            "auto", the run record the size it resolved to. An integer is in [1, 2**31).
        max_kv_memory_gb: refuse to start a batched job whose KV buffers (batch_size x capacity
            positions) would exceed this many gigabytes (10**9 bytes), in (0, ``MAX_MEMORY_GB``] (10**6);
            None: the device's memory (``pipeline.engine.batch.memory_limit``) is the only limit. Not part
            of the job fingerprint.
    """

    dtype: str = "auto"
    dequantize: bool | str = "auto"
    prefill_step_size: int = 512
    compile: bool | str = "auto"
    fused: bool | str = "auto"
    batch_size: int | str = 1
    max_kv_memory_gb: float | None = None

    def check(self):
        """Raises: JobSpecError: every value out of range (a non-finite ``max_kv_memory_gb`` included)."""
        bad = _Problems()
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            bad.append(f"engine.dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.dequantize not in (True, False, "auto"):
            bad.append(f"engine.dequantize must be true, false or auto, got {self.dequantize!r}")
        if self.compile not in (True, False, "auto"):
            bad.append(f"engine.compile must be true, false or auto, got {self.compile!r}")
        if self.fused not in (True, False, "auto"):
            bad.append(f"engine.fused must be true, false or auto, got {self.fused!r}")
        if self.prefill_step_size < 1:
            bad.append(f"engine.prefill_step_size must be >= 1, got {self.prefill_step_size}")
        elif self.prefill_step_size >= INT32_LIMIT:
            bad.append(f"engine.prefill_step_size must be < 2**31, got {self.prefill_step_size}")
        if self.batch_size != "auto" and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            bad.append(f"engine.batch_size must be an integer >= 1 or auto, got {self.batch_size!r}")
        elif isinstance(self.batch_size, int) and self.batch_size >= INT32_LIMIT:
            bad.append(f"engine.batch_size must be < 2**31, got {self.batch_size}")
        if self.max_kv_memory_gb is not None and not 0 < self.max_kv_memory_gb <= MAX_MEMORY_GB:
            bad.append(f"engine.max_kv_memory_gb must be > 0 and <= {MAX_MEMORY_GB} (GB), got {self.max_kv_memory_gb}")
        bad.raise_any()


@dataclass
class CacheSpec:
    """KV cache layout (mlx-lm's ``--max-kv-size``, ``--kv-bits``, ``--kv-group-size`` and
    ``--quantized-kv-start``); see ``pipeline.engine.cache.make_caches``.

    Attributes:
        max_kv_size: keep at most this many positions per layer (full-attention layers become sliding
            windows of this size; sliding layers keep the smaller of their window and this), in [1, 2**31)
            (positions reach the device as int32); None: no bound.
        kv_bits: store keys and values quantized to 4 or 8 bits; None: unquantized.
        kv_group_size: elements per quantization group along head_dim: 32, 64 or 128 (must divide the
            model's head_dim); only with ``kv_bits`` (otherwise only the default, 64, is accepted).
        quantized_kv_start: positions kept unquantized before the cache switches to quantized storage, in
            [0, 2**31) (compared with int32 offsets on the device); only with ``kv_bits`` (otherwise only the
            default, 0, is accepted).
        prefix_cache_gb: memory (10**9 bytes, on the model's device; in [0, ``MAX_MEMORY_GB``], 10**6) for
            the KV of prompt blocks kept
            across rows, so prompts sharing a prefix reuse it (``pipeline.engine.prefix``); least recently
            used blocks are evicted; 0 turns prefix caching off (prompts prefilled in chunks of
            ``engine.prefill_step_size``). Default 1: about 21,700 positions of the default model's float32
            KV (46 KB each), 7,600 of an 8B model's float16 (128 KB), enough for a few-shot context and the
            latest rows' prompts, and small against the memory a run holds anyway.
        prefix_block_size: tokens per prefix block; with prefix caching on, prefill runs in chunks of
            exactly one block (so reused KV is bitwise what a prefill computes) and a prompt reuses whole
            blocks. 32: a reusing row recomputes 16 tokens past its shared prefix on average; on the 2-core
            CPU 32-token chunks prefill at 126 tok/s vs 157 for 64 and 147 for 512 (docs/BENCHMARKS.md).
    """

    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    prefix_cache_gb: float = 1.0
    prefix_block_size: int = 32

    def check(self):
        """Raises: JobSpecError: every value out of range; ``kv_group_size`` or ``quantized_kv_start`` other
        than its default without ``kv_bits`` (it would do nothing)."""
        bad = _Problems()
        if self.max_kv_size is not None and self.max_kv_size < 1:
            bad.append(f"cache.max_kv_size must be >= 1, got {self.max_kv_size}")
        elif self.max_kv_size is not None and self.max_kv_size >= INT32_LIMIT:
            bad.append(f"cache.max_kv_size must be < 2**31, got {self.max_kv_size}")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            bad.append(f"cache.kv_bits must be 4 or 8, got {self.kv_bits}")
        if self.kv_group_size not in (32, 64, 128):
            bad.append(f"cache.kv_group_size must be 32, 64 or 128, got {self.kv_group_size}")
        elif self.kv_bits is None and self.kv_group_size != CacheSpec.kv_group_size:
            bad.append(_without_kv_bits("kv_group_size", self.kv_group_size))
        if self.quantized_kv_start < 0:
            bad.append(f"cache.quantized_kv_start must be >= 0, got {self.quantized_kv_start}")
        elif self.quantized_kv_start >= INT32_LIMIT:
            bad.append(f"cache.quantized_kv_start must be < 2**31, got {self.quantized_kv_start}")
        elif self.kv_bits is None and self.quantized_kv_start != CacheSpec.quantized_kv_start:
            bad.append(_without_kv_bits("quantized_kv_start", self.quantized_kv_start))
        if not 0 <= self.prefix_cache_gb <= MAX_MEMORY_GB:
            bad.append(f"cache.prefix_cache_gb must be a number >= 0 and <= {MAX_MEMORY_GB} (GB), "
                       f"got {self.prefix_cache_gb}")
        if not 1 <= self.prefix_block_size <= 4096:
            bad.append(f"cache.prefix_block_size must be in [1, 4096], got {self.prefix_block_size}")
        bad.raise_any()


def _without_kv_bits(key: str, value: int) -> str:
    return f"cache.{key}: {value} has no effect without cache.kv_bits; set kv_bits to 4 or 8, or remove {key}"


@dataclass
class OutputSpec:
    """Where results go.

    Attributes:
        dir: output directory (shards ``part-NNNNN.parquet``, or ``unit-NNNNN.parquet`` with
            ``executor: ray``, and ``manifest.json``); not empty (nor only blanks): "." names the working
            directory.
        shard_size: rows per shard.
        flush_seconds: commit the rows finished so far after this many seconds even if the shard is not
            full, so a crash loses at most this much work.
    """

    dir: str
    shard_size: int = 16
    flush_seconds: float = 300.0

    def check(self):
        """Raises: JobSpecError: every value out of range."""
        bad = _Problems()
        if self.dir is not None and not self.dir.strip():  # None: missing, reported by _build
            bad.append(f"output.dir must be a non-empty path, got {self.dir!r}")
        if self.shard_size < 1:
            bad.append(f"output.shard_size must be >= 1, got {self.shard_size}")
        if not 0 < self.flush_seconds < float("inf"):
            bad.append(f"output.flush_seconds must be a number > 0, got {self.flush_seconds}")
        bad.raise_any()


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address ``HOST:PORT`` or ``SCHEME://HOST:PORT`` (an IPv6 host's brackets
    dropped), or None without a port."""
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


@dataclass
class RaySpec:
    """Where and how ``executor: ray`` runs (``pipeline.run.ray``); not part of the job fingerprint.

    Attributes:
        address: the Ray cluster, as ``ray.init(address=...)`` takes it: None finds one (``RAY_ADDRESS``,
            as ``ray job submit`` sets it, or a cluster started on this machine) or starts a local one;
            "auto" needs an existing one; "local" always starts a new local one; or "HOST:PORT" /
            "ray://HOST:PORT".
        actors: Ray actors, each loading the model once; None: the cluster's GPUs divided by
            ``num_gpus``, or on a cluster without GPUs one per CPU.
        unit_rows: output rows per work unit (one shard each, committed when it arrives); None:
            ``output.shard_size``.
        num_cpus: CPUs reserved per actor (fractions allowed); None: 1 on GPUs, else 3/4 of the
            cluster's CPUs shared among the actors (the rest stays free for Ray Data's own tasks).
        num_gpus: GPUs per actor; None: 1 when the cluster has GPUs, else 0 (the actor then runs on
            the CPU and sees no GPU).
    """

    address: str | None = None
    actors: int | None = None
    unit_rows: int | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None

    def check(self):
        """Raises: JobSpecError: every value out of range."""
        bad = _Problems()
        if self.address is not None and self.address not in ("auto", "local"):
            end = host_port(self.address)  # Ray raises "Invalid address format" on a host without its port
            if end is None or not end[0] or self.address.split("://", 1)[0] not in (self.address, "ray"):
                bad.append(f"ray.address must be null, auto, local, HOST:PORT or ray://HOST:PORT, got "
                           f"{self.address!r}")
        if self.actors is not None and self.actors < 1:
            bad.append(f"ray.actors must be >= 1, got {self.actors}")
        if self.unit_rows is not None and self.unit_rows < 1:
            bad.append(f"ray.unit_rows must be >= 1, got {self.unit_rows}")
        if self.num_cpus is not None and not 0 < self.num_cpus < float("inf"):
            bad.append(f"ray.num_cpus must be a number > 0, got {self.num_cpus}")
        if self.num_gpus is not None and not 0 <= self.num_gpus < float("inf"):
            bad.append(f"ray.num_gpus must be a number >= 0, got {self.num_gpus}")
        bad.raise_any()


EXECUTORS = ("local", "ray")
TASKS = ("generate", "score")


@dataclass
class JobSpec:
    """A whole job file.

    Attributes:
        task: "generate" (completions) or "score" (lm-evaluation-harness's ``loglikelihood``: each row's
            context with ``input.choices_column`` or ``input.continuation_column``; one output row per
            (id, choice index), ``pipeline.results.ScoreResult``; ``pipeline.engine.score``).
        executor: "local" runs the job in this process; "ray" on a Ray cluster with Ray Data (``ray``
            section; ``pipeline.run.ray``). Same rows either way; not part of the fingerprint.
    """

    input: InputSpec
    output: OutputSpec
    model: str = DEFAULT_MODEL
    task: str = "generate"
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    executor: str = "local"
    ray: RaySpec = field(default_factory=RaySpec)

    def check(self):
        """Raises: JobSpecError: an unknown executor or task; the score columns missing (``task: score``:
        exactly one of ``input.choices_column`` and ``input.continuation_column``) or set for ``task:
        generate``; ``task: score`` with ``engine.batch_size`` other than 1 or ``executor: ray``; ``task: generate``
        with an ``input.template`` that renders "" whatever the row."""
        bad = _Problems()
        if self.executor not in EXECUTORS:
            bad.append(f"executor must be local or ray, got {self.executor!r}")
        inp = self.input
        if self.task not in TASKS:
            bad.append(f"task must be generate or score, got {self.task!r}")
        elif inp is None:
            pass
        elif self.task == "score":
            if (inp.choices_column is None) == (inp.continuation_column is None):
                bad.append("task: score needs exactly one of input.choices_column (lists of strings) and "
                           "input.continuation_column (strings)")
            if self.engine.batch_size != 1:
                bad.append("engine.batch_size must be 1 with task: score (the choices of a row run as one batch)")
            if self.executor == "ray":
                bad.append("task: score runs with executor: local only")
            if self.generation.structured is not None or inp.structured_column is not None:
                bad.append("generation.structured and input.structured_column are for task: generate")
        else:
            for key in ("choices_column", "continuation_column"):
                if getattr(inp, key) is not None:
                    bad.append(f"input.{key} is for task: score (this job's task is generate)")
            if inp.template is not None and row_template.renders_empty(inp.template):
                bad.append("input.template is empty: every row's prompt would be empty (an empty context is "
                           "for task: score)")
        bad.raise_any()

    @property
    def uses_structured(self) -> bool:
        """Some row may be constrained: ``generation.structured`` or ``input.structured_column`` is set."""
        return self.generation.structured is not None or self.input.structured_column is not None

    def to_dict(self) -> dict:
        """The job as JSON values (tuples as lists)."""
        return _plain(dataclasses.asdict(self))


def _plain(value):
    """``value`` with every tuple a list (as JSON reads it back), recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_value(value, tp, where: str):
    """Check ``value`` against annotation ``tp``; returns the value (ints accepted as floats).

    Raises:
        JobSpecError: the value's problems (all of a nested mapping's or list's, one otherwise).
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise JobSpecError(f"{where} must not be null")
        options = [a for a in args if a is not type(None)]
        for inner in options:  # the option of the value's own type gives the clearest message
            base = dict if dataclasses.is_dataclass(inner) else typing.get_origin(inner) or inner
            if isinstance(value, base) and not (base is int and isinstance(value, bool)):
                return _check_value(value, inner, where)
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
    if origin is tuple:  # tuple[X, ...]: a list in the job file; a single string for tuple[str, ...]
        item = typing.get_args(tp)[0]
        if item is str and isinstance(value, str):
            value = [value]
        return tuple(_check_value(value, list[item], where))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise JobSpecError(f"{where} must be a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        out, problems = [], _Problems()
        for i, v in enumerate(value):
            try:
                out.append(_check_value(v, item, f"{where}[{i}]"))
            except JobSpecError as e:
                problems += e.problems
        problems.raise_any()
        return out
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # beyond float64: 10**400
            raise JobSpecError(f"{where} must be a finite number, got an integer of {len(str(abs(value)))} digits") \
                from None
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        got = "null" if value is None else f"{type(value).__name__} {value!r}"
        raise JobSpecError(f"{where} must be {tp.__name__}, got {got}")
    return value


def _unknown_keys(data: dict, known, where: str) -> list[str]:
    """One problem per key of ``data`` not in ``known`` (at key path ``where``), with the closest known key."""
    problems = []
    for key in data:
        if key not in known:
            path = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
            problems.append(f"unknown key {path!r}{hint}")
    return problems


def _judged_default(problem: str, failed: list[str], where: str) -> bool:
    """Whether ``check()``'s ``problem`` judged the default put in place of a field of ``failed`` (a value of the
    wrong type, or missing), so it is false or said already: it names the field's dotted path
    (``input.dataset.name must be a non-empty string`` after a missing name), or asks to set it
    (``input: set path ... or dataset`` after a dataset of the wrong type; ``set exactly one of equals or one_of``
    after a bad ``equals``). A problem that merely mentions the word (``one_of must not be empty`` beside a bad
    ``column``) is kept."""
    for name in failed:
        path = f"{where}.{name}" if where else name
        if "." in path and re.search(rf"(?<![\w.]){re.escape(path)}(?![\w])", problem):  # a dotted path, not a word
            return True
        if re.search(rf"\bset\b.*\b{re.escape(name)}\b", problem.split(": ", 1)[-1]):
            return True
    return False


def _build(cls, data, where: str):
    """The dataclass ``cls`` from mapping ``data`` (at key path ``where``).

    Raises:
        JobSpecError: every problem found: unknown and missing keys, wrong types, and the range
            checks of ``cls.check()`` (run with defaults in place of the keys of the wrong type; its problems
            that name such a key are left out, as they judged the default).
    """
    if not isinstance(data, dict):
        raise JobSpecError(f"{where or 'job'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = _Problems()
    problems += _unknown_keys(data, fields, where)
    kwargs = {}
    failed = []  # fields with a problem of their own: check() sees their defaults, not their values
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name in data:
            try:
                kwargs[name] = _check_value(data[name], hints[name], path)
                continue
            except JobSpecError as e:
                problems += e.problems
                failed.append(name)
        elif required:
            problems.append(f"missing required key {path!r}")
            failed.append(name)
        if required:
            kwargs[name] = None  # a placeholder so that check() still reports the other keys' problems
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        try:
            obj.check()
        except JobSpecError as e:
            problems += [p for p in e.problems if not _judged_default(p, failed, where)]
    problems.raise_any()
    return obj


def job_from_dict(data: dict) -> JobSpec:
    """Validate a parsed job mapping into a ``JobSpec``.

    Raises:
        JobSpecError: every unknown key, wrong type, out-of-range value and missing required key, one
            problem each (``problems``).
    """
    return _build(JobSpec, data, "")


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping of the job file holds a key twice (plain YAML keeps the last silently).

    Attributes:
        key: the key's path, e.g. ``generation.max_tokens`` (``input.filter[0].column`` inside a list).
        line, first_line: the 1-based lines of the repeated key and of its first occurrence.
    """

    def __init__(self, key: str, line: int, first_line: int):
        super().__init__(problem=f"duplicate key {key!r}")
        self.key, self.line, self.first_line = key, line, first_line

    def __str__(self):
        return f"duplicate key {self.key!r} (line {self.line}; first at line {self.first_line})"


class _JobLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that records each key repeated in one mapping (``duplicates``: ``DuplicateKeyError``,
    naming its path), so that they are reported with the job's other problems.

    Keys are compared as constructed values (``1`` and ``0x1`` are one key); the keys a merge (``<<: *a``)
    brings in may be overridden by the mapping's own, as YAML defines. The constructor builds mappings
    parent first, so each node's path is known (``_paths``) before its own keys are checked."""

    def __init__(self, stream):
        super().__init__(stream)
        self._paths: dict[int, str] = {}
        self.duplicates: list[DuplicateKeyError] = []  # every repeated key (the last value is kept meanwhile)

    def _path(self, node) -> str:
        return self._paths.get(id(node), "")

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            where, seen = self._path(node), {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                path = f"{where}.{key}" if where else str(key)
                if first is not key_node:
                    self.duplicates.append(DuplicateKeyError(path, key_node.start_mark.line + 1,
                                                             first.start_mark.line + 1))
                self._paths.setdefault(id(value_node), path)
        return super().construct_mapping(node, deep=deep)

    def construct_sequence(self, node, deep=False):
        if isinstance(node, yaml.SequenceNode):
            where = self._path(node) or "job"
            for i, item in enumerate(node.value):
                self._paths.setdefault(id(item), f"{where}[{i}]")
        return super().construct_sequence(node, deep=deep)


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a YAML job file (UTF-8 text; a key repeated in one mapping is an error).

    Raises:
        JobSpecError: unreadable file, not UTF-8, invalid YAML, a duplicate key, or an invalid job: one
            problem per line, each starting with the file's path and naming the key.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        loader = _JobLoader(raw.decode("utf-8"))
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except OSError as e:
        raise JobSpecError(f"cannot read job file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        bom = "; it starts with a UTF-16 byte order mark" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise JobSpecError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}){bom}; "
                           "save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobSpecError(f"{path}: invalid YAML{where}: {problem}") from None
    problems = [str(d) for d in loader.duplicates]
    try:
        job = job_from_dict(data if data is not None else {})
    except JobSpecError as e:
        problems += e.problems
    if problems:
        raise JobSpecError([f"{path}: {p}" for p in problems])
    return job
