"""``load_model``: a model spec -> model, tokenizer and engine, ready to generate."""

from __future__ import annotations

import re
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import _blas
from .engine.compiled import warn_if_no_cpu_compile
from .engine import Engine, GenerateParams, Request
from .engine.batch import device_memory
from .engine.cuda.backend import on_cuda
from .engine.structured import StructuredOutputsParams
from .gguf import read_gguf
from .modeldir import model_files, read_model_dir, weight_files
from .models import FAMILIES, build_model, dense_prefill, dequantize_model, dequantized_nbytes
from .models.base import ConfigError, WeightsMismatch, fuse_projections
from .resolve import ALIASES, cached_sha256, resolve_model
from .tokenizer import Tokenizer

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def compute_dtype(name: str = "auto") -> mx.Dtype:
    """"auto" is float32 on the CPU (float16 matmuls there are ~30x slower) and float16 on a GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.float16
    return _DTYPES[name]


DEQUANTIZE_MAX_BYTES = 4 << 30
# Largest model (its weights expanded to the compute dtype) whose quantized layers take several rows through
# weights dequantized at the call on a CUDA GPU (``should_dense_prefill``). An estimate, not a measurement: the
# dequantized copy written and read again (~2 GiB of traffic at ~3 TB/s) adds under ~1 ms to a prefill chunk.
DENSE_PREFILL_MAX_BYTES = 1 << 30


class WeightsError(ValueError):
    """The model's weights do not fit its config (missing, unexpected or wrongly shaped tensors); the
    message names the weight file(s) and the tensors."""


def _weights_problem(e: WeightsMismatch) -> str:
    """MLX's ``load_weights(strict=True)`` message (names one per line) as one line."""
    m = re.match(r"(Received|Missing) \d+ parameters(?: not in model)?: \n(.*)\.$", str(e), re.S)
    if m:
        names = m.group(2).split(",\n")
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"{'unexpected' if m.group(1) == 'Received' else 'missing'} {len(names)} tensor(s): {shown}"
    m = re.match(r"Expected shape (.*) but received shape (.*) for parameter (\S+)$", str(e))
    if m:
        return f"tensor {m.group(3)} has shape {m.group(2)}, expected {m.group(1)}"
    return " ".join(str(e).split())


def _build(path: Path, config: dict, weights: dict, dtype: mx.Dtype):
    """``build_model`` with errors naming the file at fault: ``config.json`` (or the ``.gguf`` file)
    for config problems, the weight file(s) for tensors that do not fit."""
    config_file = path / "config.json" if path.is_dir() else path
    if "model_type" not in config:
        raise ConfigError(f"{config_file}: lacks required key model_type (supported: {', '.join(sorted(FAMILIES))})")
    try:
        return build_model(config, weights, dtype)
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}") from None
    except WeightsMismatch as e:  # MLX's load_weights(strict=True), or a tensor nn.quantize cannot take
        if path.is_dir():
            files = weight_files(path)
            where = str(files[0]) if len(files) == 1 else f"{path} ({', '.join(f.name for f in files)})"
        else:
            where = str(path)
        raise WeightsError(
            f"{where}: weights do not fit the {config['model_type']} model of {config_file.name}: {_weights_problem(e)}"
        ) from None


def check_token_ids(token_ids: list[tuple[str, int]], vocab_size: int) -> None:
    """Every declared special-token id (``(where, id)``: ``ModelDir.token_ids``, ``GGUFModel.token_ids``) is a
    row of the embedding (``0 <= id < vocab_size``): the warm-up feeds the BOS id as a token, and an id past the
    embedding read other memory (a segfault on the CPU).

    Raises:
        ConfigError: the first id that is not, naming where it is declared.
    """
    for where, i in token_ids:
        if not 0 <= i < vocab_size:
            raise ConfigError(f"{where}: {i} is outside the vocabulary of {vocab_size} tokens (the embedding's rows)")


def check_tokenizer_size(path: Path, tokenizer, vocab_size: int) -> None:
    """The ids of the tokenizer's own vocabulary (``Tokenizer.base_vocab_end``, added tokens left out) fit the
    model's ``vocab_size`` embedding rows, or ordinary text would feed ids past the embedding (garbage, or other
    memory). A smaller vocabulary is normal (embeddings padded to a multiple of 64 or 128); so are added tokens
    past ``vocab_size`` (Gemma 3 1B: ``<image_soft_token>`` at 262144 of 262144 rows): ``tokenizer.id_limit``
    is set, and a prompt holding one fails its row (``prompts``).

    Raises:
        ConfigError: a vocabulary past the embedding, naming the tokenizer's file, the config's and both sizes.
    """
    end = tokenizer.base_vocab_end
    if end > vocab_size:
        tok_file, cfg_file = (path / "tokenizer.json", path / "config.json") if path.is_dir() else (path, path)
        raise ConfigError(f"{tok_file}: the tokenizer's vocabulary has ids up to {end - 1}, past the vocab_size "
                          f"{vocab_size} of {cfg_file} (the embedding's rows)")
    tokenizer.id_limit = vocab_size


def should_dequantize(model, dtype: mx.Dtype, batch_size: int = 1) -> bool:
    """The "auto" rule.

    - CPU: dequantize when OpenBLAS serves MLX's matmuls (``pipeline._blas``) and the expanded weights fit in ``DEQUANTIZE_MAX_BYTES``
      (4 GiB). Measured on a 2-core x86_64 CPU, float32 576x576: OpenBLAS GEMV ~50 us vs MLX's 4-bit
      quantized GEMV ~300 us; a 40-row GEMM ~0.3 ms vs ~11 ms.
    - GPU: dequantize for batched decoding (``batch_size`` > 1) when the expanded weights take at most a
      quarter of the device's memory (``engine.batch.device_memory``); batch-1 decoding keeps the 4-bit weights (a GEMV reads 4x fewer
      bytes). Measured on an H200 (mlx 0.32.4, docs/BENCHMARKS.md): at 64 rows MLX's 4-bit matmul
      (``qmm``) took 84% of a Llama-3.2-1B decode step (1,447 tok/s); float16 weights ran 6,467 tok/s.
    """
    if mx.default_device() == mx.cpu:
        return _blas.LOADED is not None and dequantized_nbytes(model, dtype) <= DEQUANTIZE_MAX_BYTES
    return batch_size > 1 and dequantized_nbytes(model, dtype) <= (device_memory() or 0) // 4


def should_dense_prefill(model, dtype: mx.Dtype) -> bool:
    """Whether a model that keeps its quantized weights should multiply inputs of several rows by weights
    dequantized at the call (``models.DensePrefillLinear``): on MLX's CUDA backend, for models whose expanded
    weights take at most ``DENSE_PREFILL_MAX_BYTES``. MLX compiles its multi-row quantized matmuls (CUTLASS)
    with NVRTC on first use: on an H100 with empty kernel caches the default model's first row was done 140.5 s
    after the load, 23.8 s with dense prefill matmuls, and its warm rate did not change (793-823 tok/s against
    801; docs/BENCHMARKS.md, 2026-12-05). For larger models the per-chunk dequantize is not free and was not
    measured, so they keep MLX's kernels (compiled once per machine into the kernel cache,
    ``pipeline._kernel_cache``). CPUs and Apple GPUs: False (no compile)."""
    return on_cuda() and dequantized_nbytes(model, dtype) <= DENSE_PREFILL_MAX_BYTES


def prepare_model(model, dtype: mx.Dtype, dequantize: str | bool = "auto", batch_size: int = 1,
                  fuse: bool = True) -> bool:
    """What ``load_model`` does to a freshly built model, in place: expand its quantized weights to
    ``dtype`` if ``dequantize`` says so ("auto": ``should_dequantize`` for ``batch_size``), then, with
    ``fuse``, run the projections that read the same input as one (``models.base.fuse_projections``); at
    ``batch_size`` 1, weights kept quantized take multi-row inputs through dense matmuls where
    ``should_dense_prefill`` says so.

    Returns:
        Whether the weights were dequantized.
    """
    if dequantize == "auto":
        dequantize = should_dequantize(model, dtype, batch_size)
    if dequantize:
        dequantize_model(model, dtype)
    if fuse:
        fuse_projections(model)
    if not dequantize and batch_size == 1 and should_dense_prefill(model, dtype):
        # batch 1 only: a batched step's B rows would take the dense path every token (batched jobs of such
        # models are dequantized by the "auto" rule anyway)
        dense_prefill(model)
    return bool(dequantize)


class LoadedModel:
    """One loaded model with its tokenizer and generation engine.

    Attributes:
        spec: the model spec it was loaded from.
        path: the local model file.
        config: HF-style config dict.
        tokenizer: the model's ``Tokenizer``.
        engine: the ``Engine`` that generates with it.
    """

    def __init__(self, spec: str, path: Path, config: dict, model, tokenizer: Tokenizer, prefill_step_size: int = 512,
                 cache_spec=None, compile: bool | str = "auto", fused: bool | str = "auto", batch_size: int = 1):
        self.spec, self.path, self.config, self.model, self.tokenizer = spec, path, config, model, tokenizer
        self.engine = Engine(
            model,
            eos_token_ids=tokenizer.eos_token_ids,
            context_length=int(model.args.max_position_embeddings),
            prefill_step_size=prefill_step_size,
            cache_spec=cache_spec,
            compile=compile,
            tokenizer=tokenizer,
            fused=fused,
            batch_size=batch_size,
        )

    def warm_up(self, batch=None, structured: bool = False) -> float:
        """Generate 3 tokens from an 8-token prompt on the path the job decodes on and return the wall
        seconds it took: the first use of a model compiles its kernels (MLX's CUDA backend: NVRTC, tens of
        seconds on an H200) and traces the decode step, which should not land in the first row's
        statistics. With ``batch`` (the job's ``BatchEngine``) one prompt per prefill shape the job can
        meet (``BatchEngine.warm_up_lengths``: every group-prefill bucket) runs through it, so those
        shapes compile, its batched step is traced and its buffers allocated; else through ``engine.generate`` (the fused, compiled
        or eager step of ``engine.path``). The caches (and a batch's slot) are overwritten by the next
        generation, so nothing of it reaches later rows; it logs no warnings and leaves the
        once-per-engine ones (a prompt longer than ``cache.max_kv_size``, eager decoding) to the first
        row that meets them (``Engine.quiet``). ``structured`` (a job with structured output): one more
        request, held to any JSON object, builds the tokenizer's llguidance copy (~0.4 s) and, in sequential
        mode, traces the forward-only step constrained requests decode with."""
        t = time.perf_counter()
        vocab = self.model.args.vocab_size
        prompt = lambda n: [self.tokenizer.bos_token_id or 0] + [i % vocab for i in range(1, n)]  # noqa: E731
        params = GenerateParams(max_tokens=3, ignore_eos=True)
        constrained = GenerateParams(max_tokens=3, structured=StructuredOutputsParams(json_object=True))
        with self.engine.quiet():
            if batch is None:
                self.engine.generate(prompt(8), params)
                if structured:
                    self.engine.generate(prompt(8), constrained)
            else:
                reqs = [Request(("warm-up", n), prompt(n), params) for n in batch.warm_up_lengths()]
                if structured:
                    reqs.append(Request(("warm-up", "structured"), prompt(8), constrained))
                for _ in batch.run(reqs):
                    pass
        self.engine.drop_prefixes()  # the made-up prompt's blocks would only take room in the prefix cache
        return time.perf_counter() - t

    def logprobs(self, token_ids: list[int]) -> np.ndarray:
        """Natural-log next-token probabilities after ``token_ids``: numpy float32, shape ``(vocab,)``."""
        logits = self.engine.forward(list(token_ids))
        return np.array(logits - mx.logsumexp(logits), dtype=np.float32)

    def generate(self, prompt: str, *, apply_chat_template: bool = True, system_prompt: str | None = None,
                 **params) -> str:
        """Completion text for one user ``prompt``, built as a job builds it (chat template unless told
        not to, special-token text in ``prompt`` encoded as plain text, one BOS).

        ``params`` are ``GenerateParams`` fields (max_tokens defaults to 64 here; ``stop`` and
        ``stop_token_ids`` may be one value or a list), range-checked as a job's ``generation`` settings.

        Raises:
            GenerateParamsError: a ValueError, one line naming every setting out of range
                (``GenerateParams.check``); RowError: an empty prompt; ValueError: a prompt that fills the
                model's context.
        """
        from .inputs import InputRow
        from .jobspec import InputSpec
        from .prompts import build_prompt

        spec = InputSpec(path="", apply_chat_template=apply_chat_template, system_prompt=system_prompt)
        ids = build_prompt(InputRow(index=0, id=0, prompt=prompt, messages=None), spec, self.tokenizer).token_ids
        checked = GenerateParams(**{"max_tokens": 64, **params})
        checked.check()
        return self.engine.generate(ids, checked).text


def model_identity(spec: str, path: Path) -> dict:
    """What identifies the model's content: the sha256 of its file (known for built-in aliases), or
    of a model directory's files (weights, config, tokenizer, chat template) by name."""
    if spec in ALIASES:
        return {"spec": spec, "file": path.name, "sha256": ALIASES[spec].sha256}
    if path.is_dir():
        return {"spec": spec, "files": {f.name: cached_sha256(f) for f in model_files(path)}}
    return {"spec": spec, "file": path.name, "sha256": cached_sha256(path)}


def load_model(spec: str = "smollm2-135m-instruct", *, dtype: str = "auto", dequantize: str | bool = "auto",
               prefill_step_size: int = 512, cache_spec=None, compile: bool | str = "auto",
               path: Path | None = None, fuse: bool = True, batch_size: int = 1,
               fused: bool | str = "auto") -> LoadedModel:
    """Load a model: a built-in alias, a ``.gguf`` path, or a Hugging Face repo id.

    Args:
        spec: the model spec.
        dtype: "auto", "float32", "float16" or "bfloat16" (see ``compute_dtype``).
        dequantize: expand quantized weights to ``dtype`` (see ``should_dequantize`` for "auto").
        batch_size: the engine's ``batch_size`` (the "auto" dequantize rule depends on it on a GPU; > 1 is the
            batched path, ``engine.step.choose_path``).
        prefill_step_size: prompt tokens per prefill chunk.
        cache_spec: a ``pipeline.jobspec.CacheSpec`` (rotating / quantized KV caches), or None for the
            model's own cache layout.
        compile: decode through the compiled closure set: true, false (eager) or "auto"
            (``pipeline.engine.step.compile_by_default``).
        path: the already-resolved local file for ``spec``, if known.
        fused: decode through the fused CUDA step where it applies (``pipeline.engine.cuda``): "auto"/true,
            or false.
        fuse: run projections that read the same input as one (``models.base.fuse_projections``;
            same values, fewer kernels: on an H200 eager decode ran 4-7% faster, on the CPU no
            measurable change); false keeps the stored layout (``pipeline inspect``).

    Raises:
        ModelResolveError, GGUFError, ModelDirError, TokenizerError, ConfigError, WeightsError: one line
        naming the file and the key or tensor at fault (``check_tokenizer_size``: a tokenizer vocabulary past
        the embedding).
    """
    path = path or resolve_model(spec)
    g = read_model_dir(path) if path.is_dir() else read_gguf(path)
    if mx.default_device() == mx.cpu:  # after the model's files are read: a bad spec is one error line alone
        _blas.warn_if_slow()
        warn_if_no_cpu_compile()
    dt = compute_dtype(dtype)
    model = _build(path, g.config, g.weights, dt)
    check_token_ids(g.token_ids, model.args.vocab_size)  # _build checked the embedding has vocab_size rows
    check_tokenizer_size(path, g.tokenizer, model.args.vocab_size)
    if fuse:
        g.weights = None  # the fused copies prepare_model makes replace these arrays; let them go
    prepare_model(model, dt, dequantize, batch_size, fuse)
    return LoadedModel(spec, path, g.config, model, g.tokenizer, prefill_step_size, cache_spec, compile, fused,
                       batch_size)
