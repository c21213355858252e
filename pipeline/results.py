"""One result row per (input row, sample) (``Result``), or per (input row, choice) for ``task: score``
(``ScoreResult``); their fields are the output Parquet columns, 1:1."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import pyarrow as pa


@dataclass
class Result:
    """One generated row.

    Attributes:
        id: the input row's id.
        sample_index: 0..n-1 for the samples of one row.
        prompt: the user text (last user turn of a conversation).
        completion: generated text (None when the row failed).
        finish_reason: "stop" (EOS, a stop token or a stop string) or "length" (max_tokens / context);
            None when the row failed.
        stop_reason: what stopped it (vLLM's ``stop_reason``): the matched stop string, or the id of the
            EOS / stop token written as decimal text (a Parquet column has one type); None for "length".
        stop_token_id: the EOS / stop token id that ended the sample, or None.
        prompt_tokens: prompt length in tokens.
        completion_tokens: generated tokens (EOS excluded).
        ttft_s: seconds from the start of prefill to the first generated token.
        prefill_tps: prompt tokens per second.
        decode_tps: generated tokens per second after the first token (tokens/s).
        total_s: seconds for the row, prompt building and detokenization included.
        peak_memory_bytes: MLX peak memory while generating the row, in bytes.
        compiled: whether decode ran through the compiled closure set (None when the row failed).
        seed: the row's sampling seed (derived from the job seed, id and sample index).
        error: why the row failed, or None.
        logprobs: natural-log probability of each generated token (``generation.logprobs`` set), in
            the raw model distribution.
        top_token_ids: per generated token, the ``generation.logprobs`` most likely ids, most likely first.
        top_logprobs: their log probabilities.
        batch_size: the decode slots of the engine the row ran in (``engine.batch_size``; 1:
            sequential); None when the row failed before generating.
        cached_prompt_tokens: prompt tokens whose KV was reused from the prefix cache or the row's previous
            sample instead of computed (``cache.prefix_cache_gb``; 0 with it off); None when the row failed.
    """

    id: int | str
    sample_index: int
    prompt: str | None
    completion: str | None
    finish_reason: str | None
    stop_reason: str | None
    stop_token_id: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    prefill_tps: float | None
    decode_tps: float | None
    total_s: float | None
    peak_memory_bytes: int | None
    compiled: bool | None
    seed: int
    error: str | None
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    batch_size: int | None = None
    cached_prompt_tokens: int | None = None

    @property
    def key(self) -> tuple:
        """``(id, sample_index)``: the row's key in the output dir."""
        return (self.id, self.sample_index)


@dataclass
class ScoreResult:
    """One scored (row, choice) of ``task: score`` (lm-evaluation-harness's ``loglikelihood``).

    Attributes:
        id: the input row's id.
        choice_index: 0..C-1, the choice's position in the row's ``input.choices_column`` list (0 for
            ``input.continuation_column``, and for a row that failed before its choices were known).
        prompt: the user text (last user turn of a conversation), as for generation.
        choice: the continuation text as in the input (before its context's trailing whitespace moved to
            it); None when the row's choices cell was not a list of strings.
        logprob_sum: sum of the continuation tokens' log-probabilities (natural log); None if failed.
        num_tokens: continuation tokens scored; None if failed.
        is_greedy: every continuation token is the argmax of its position's distribution; None if failed.
        token_logprobs: each continuation token's log-probability (float32); None if failed.
        prompt_tokens: context length in tokens (chat template included, its trailing whitespace moved to
            the continuation); None if failed.
        ttft_s: seconds of the context's prefill (shared by the row's choices).
        total_s: seconds for the whole row (prompt building, the context and every choice), shared by its
            choices.
        peak_memory_bytes: MLX peak memory while scoring the row, in bytes.
        shared_context: the choices ran as one batch from the context's KV (``engine.score.score_shared``);
            False: each had its own full prefill (``engine.score.shared_blocker`` says why; the log names the
            reason once); None if failed.
        error: why the row (or this choice) failed, or None.
    """

    id: int | str
    choice_index: int
    prompt: str | None
    choice: str | None
    logprob_sum: float | None
    num_tokens: int | None
    is_greedy: bool | None
    token_logprobs: list[float] | None
    prompt_tokens: int | None
    ttft_s: float | None
    total_s: float | None
    peak_memory_bytes: int | None
    shared_context: bool | None
    error: str | None

    @property
    def key(self) -> tuple:
        """``(id, choice_index)``: the row's key in the output dir."""
        return (self.id, self.choice_index)


_SCORE_TYPES = {
    "choice_index": pa.int32(),
    "prompt": pa.string(),
    "choice": pa.string(),
    "logprob_sum": pa.float64(),
    "num_tokens": pa.int32(),
    "is_greedy": pa.bool_(),
    "token_logprobs": pa.list_(pa.float32()),
    "prompt_tokens": pa.int32(),
    "ttft_s": pa.float64(),
    "total_s": pa.float64(),
    "peak_memory_bytes": pa.int64(),
    "shared_context": pa.bool_(),
    "error": pa.string(),
}

_TYPES = {
    "sample_index": pa.int32(),
    "prompt": pa.string(),
    "completion": pa.string(),
    "finish_reason": pa.string(),
    "stop_reason": pa.string(),
    "stop_token_id": pa.int64(),
    "prompt_tokens": pa.int32(),
    "completion_tokens": pa.int32(),
    "ttft_s": pa.float64(),
    "prefill_tps": pa.float64(),
    "decode_tps": pa.float64(),
    "total_s": pa.float64(),
    "peak_memory_bytes": pa.int64(),
    "compiled": pa.bool_(),
    "seed": pa.int64(),
    "error": pa.string(),
    "logprobs": pa.list_(pa.float32()),
    "top_token_ids": pa.list_(pa.list_(pa.int32())),
    "top_logprobs": pa.list_(pa.list_(pa.float32())),
    "batch_size": pa.int32(),
    "cached_prompt_tokens": pa.int32(),
}
_NOT_NULL = {"id", "sample_index", "seed", "choice_index"}


def result_schema(id_type: pa.DataType, task: str = "generate") -> pa.Schema:
    """The output schema of ``task`` ("generate": ``Result``, "score": ``ScoreResult``); ``id_type`` (int64
    or string) follows the input's id column."""
    cls, types = (ScoreResult, _SCORE_TYPES) if task == "score" else (Result, _TYPES)
    types = {"id": id_type, **types}
    return pa.schema(
        [pa.field(f.name, types[f.name], nullable=f.name not in _NOT_NULL) for f in dataclasses.fields(cls)]
    )


def key_column(task: str) -> str:
    """The column that, with ``id``, keys an output row: ``sample_index``, or ``choice_index`` for "score"."""
    return "choice_index" if task == "score" else "sample_index"


def schema_digest(schema: pa.Schema | None = None) -> str:
    """sha256 (hex) of ``schema`` (default: the output schema, ``result_schema``) as Arrow prints it: one
    ``name: type`` line per column in order, `` not null`` where set, the ``id`` column's type left out (it
    follows the input's id column, which the job fingerprint leaves to the input). Any change of a column's
    name, order, type or nullability changes it (``run.plan.fingerprint`` records it)."""
    schema = result_schema(pa.string()) if schema is None else schema
    lines = [f"{f.name}: {'(input)' if f.name == 'id' else f.type}{'' if f.nullable else ' not null'}"
             for f in schema]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def results_table(results: list[Result] | list[ScoreResult], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist([dataclasses.asdict(r) for r in results], schema=schema)
