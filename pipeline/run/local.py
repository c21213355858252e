"""The local generation loop: a job's samples through one loaded model, one at a time or continuously batched."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import mlx.core as mx

from ..chat_template import ChatTemplateCompileError, compile_chat_template
from ..engine import BatchEngine, Engine, Request
from ..engine.batch import check_kv_memory, memory_limit
from ..engine.score import score
from ..errors import RowError
from ..inputs import InputRow
from ..jobspec import GenerationSpec, JobSpec
from ..loader import LoadedModel, load_model
from ..prompts import Prompt, build_score_prompt
from ..results import Result, ScoreResult
from ..tokenizer import TokenizerError
from .plan import Sample, failed_result, failed_score, prepare_sample, row_prompt


class GenerationError(RuntimeError):
    """Generating a row raised something that is not a ``RowError`` (an error from MLX, a bug in a model's
    forward pass): not a problem of that row's data, so the run stops (the CLI exits 1) instead of failing
    every row after it. The rows committed before it stay; the next run resumes.

    Attributes:
        rows: ``(id, sample_index)`` of the rows being generated when it was raised: the one row, or in
            batched mode every row started whose result had not come back, the newest first (a failed
            prefill is the newest's; a failed decode step is all of theirs).
        error: the exception as ``Type: message`` on one line (text, so that it pickles back from a Ray
            actor whatever the exception was).
        trace: its traceback, formatted (``traceback.format_exception``).
        committed: rows committed in the output dir when the run stopped (``run.control.run_job`` sets it),
            else None.
        note: a further line (the run record could not be saved), else None.
        summary: the ``run.control.RunSummary`` of the run it stopped (``run_job``), else None.
    """

    def __init__(self, rows: list[tuple], error: str, trace: str = "", committed: int | None = None,
                 note: str | None = None):
        super().__init__(rows, error, trace, committed, note)  # args: pickles (a Ray actor's error)
        self.rows, self.error, self.trace, self.committed, self.note = list(rows), error, trace, committed, note
        self.summary = None

    @classmethod
    def of(cls, e: BaseException, rows: Iterable[tuple]) -> GenerationError:
        """``e``, raised while generating ``rows`` (``(id, sample_index)`` pairs)."""
        text = " ".join(str(e).split())
        return cls(list(rows), f"{type(e).__name__}: {text}" if text else type(e).__name__,
                   "".join(traceback.format_exception(e)))

    @property
    def reason(self) -> str:
        """``row 'a7' (sample 0) raised ValueError: ...``; batched: ``(sample 0; batched with 'a5', 'a6')``."""
        (row, k), *others = self.rows or [("?", 0)]
        also = ""
        if others:
            also = "; batched with " + ", ".join(repr(i) for i, _ in others[:5]) + (", ..." if len(others) > 5 else "")
        return f"row {row!r} (sample {k}{also}) raised {self.error}"

    def __str__(self) -> str:
        text = self.reason
        if self.committed is not None:
            text += f"; {self.committed} row{'s' * (self.committed != 1)} committed, run again to resume"
        return text + (f"\n{self.note}" if self.note else "")


def sample_result(s: Sample, g, total_s: float, batch_size: int = 1) -> Result:
    """The output row of a finished sample: ``g`` a ``Generation``, or the ``RowError`` the engine
    raised for it (the row then fails with that message)."""
    if isinstance(g, RowError):
        return failed_result(s.row, s.index, s.seed, s.text, str(g), time.perf_counter() - total_s)
    return Result(
        id=s.row.id, sample_index=s.index, prompt=s.text, completion=g.text, finish_reason=g.finish_reason,
        stop_reason=None if g.stop_reason is None else str(g.stop_reason), stop_token_id=g.stop_token_id,
        prompt_tokens=g.prompt_tokens, completion_tokens=len(g.token_ids), ttft_s=g.ttft_s, prefill_tps=g.prefill_tps,
        decode_tps=g.decode_tps, total_s=total_s, peak_memory_bytes=g.peak_memory_bytes,
        compiled=g.compiled, seed=s.seed, error=None, logprobs=g.logprobs, top_token_ids=g.top_token_ids,
        top_logprobs=g.top_logprobs, batch_size=batch_size, cached_prompt_tokens=g.cached_prompt_tokens,
    )


def generate_row(lm: LoadedModel, job: JobSpec, row: InputRow, sample_index: int = 0,
                 gen: GenerationSpec | str | None = None, prompt: Prompt | RowError | None = None,
                 t0: float | None = None) -> Result:
    """Generate one sample of one row alone (sequential mode); failures become a ``Result`` with
    ``error`` set. Arguments as ``prepare_sample``."""
    t0 = time.perf_counter() if t0 is None else t0
    s = prepare_sample(lm, job, row, sample_index, gen, prompt, t0)
    if s.failed is not None:
        return s.failed
    try:
        g = lm.engine.generate(s.ids, s.params)
    except RowError as e:
        g = e
    return sample_result(s, g, time.perf_counter() - t0)


# engine.batch_size: auto's upper bounds. GPU: the measured knee of the H200's batched curve (../shared/GPU.md
# and docs/BENCHMARKS.md, Llama-3.2-1B fp16, 256-512 random prompts x 128 tokens: ours 6,467-6,563 tok/s at
# B=64, 7,664 at B=128, 7,666-8,408 at B=256; the real 1,024-prompt job 1,448 at B=64, 3,247 at B=256), the
# largest B measured there: past it more slots mostly add KV memory and per-step latency. CPU: on 2 cores the
# default model ran 3.9x the sequential loop at B=8 (docs/BENCHMARKS.md), the largest B measured on a CPU; a
# CPU step's matmul work grows with B (few cores, no idle launch time to fill), so more slots are expected to
# add latency and memory more than throughput (not measured).
AUTO_BATCH_GPU = 256
AUTO_BATCH_CPU = 8


def auto_batch_cap() -> int:
    """``engine.batch_size: auto``'s upper bound on this process's device: ``AUTO_BATCH_CPU`` on the CPU,
    else ``AUTO_BATCH_GPU``."""
    return AUTO_BATCH_CPU if mx.default_device() == mx.cpu else AUTO_BATCH_GPU


def load_batch_size(job: JobSpec) -> int:
    """The ``batch_size`` the model is loaded for (the dequantize rule and the decode path depend on it):
    ``engine.batch_size``, or for "auto" its upper bound ``auto_batch_cap()`` (the size it resolves to is
    known only once every prompt is built, ``auto_batch_size``)."""
    return auto_batch_cap() if job.engine.batch_size == "auto" else job.engine.batch_size


def auto_batch_size(engine: Engine, positions: int, max_kv_memory_gb: float | None) -> tuple[int, str]:
    """``engine.batch_size: auto``: the most slots of ``positions`` positions whose KV buffers fit the
    limit ``batch.check_kv_memory`` enforces (``batch.memory_limit()``, and ``engine.max_kv_memory_gb``
    when set), at most ``auto_batch_cap()``, at least 1 (``check_kv_memory`` then refuses a batch of
    which not even one slot fits).

    Returns:
        (slots, why): ``why`` is one line for the log, e.g. ``1843 slots for up to 640 positions fit in
        the GPU's memory; at most 256 on a GPU``.
    """
    per_slot = BatchEngine(engine, 1, positions).slot_bytes()
    limit, what = memory_limit()
    if max_kv_memory_gb is not None and int(max_kv_memory_gb * 1e9) < limit:
        limit, what = int(max_kv_memory_gb * 1e9), f"engine.max_kv_memory_gb ({max_kv_memory_gb:g})"
    fits = max(limit // per_slot, 0)
    cap = auto_batch_cap()
    return max(1, min(fits, cap)), (f"{fits} slots for up to {positions} positions fit in {what}; at most {cap} "
                                    f"on {'the CPU' if cap == AUTO_BATCH_CPU else 'a GPU'}")


def load_job_model(job: JobSpec, path: Path) -> LoadedModel:
    """The job's model from its resolved ``path``, with the job's engine and cache settings (in this
    process, or in a Ray actor); ``engine.batch_size: auto`` loads for ``load_batch_size``.

    Raises:
        GGUFError, ModelDirError, ConfigError, WeightsError: the model cannot be loaded.
        TokenizerError: ``input.apply_chat_template`` and the model has no chat template.
        ChatTemplateCompileError: ``input.apply_chat_template`` and the model's chat template does not compile.
    """
    lm = load_model(job.model, dtype=job.engine.dtype, dequantize=job.engine.dequantize,
                    prefill_step_size=job.engine.prefill_step_size, cache_spec=job.cache,
                    compile=job.engine.compile, path=path, batch_size=load_batch_size(job),
                    fused=job.engine.fused)
    if job.input.apply_chat_template and not lm.tokenizer.chat_template:
        raise TokenizerError(f"model {job.model!r} has no chat template; set input.apply_chat_template: false")
    if job.input.apply_chat_template:
        try:
            compile_chat_template(lm.tokenizer.chat_template)
        except ChatTemplateCompileError as e:
            raise ChatTemplateCompileError(f"model {job.model!r}: {e}") from None
    return lm


def generate_samples(lm: LoadedModel, job: JobSpec, samples, record: Callable[[Result], None],
                     stopping: Callable[[], bool] = lambda: False, *, planned=None, positions: int | None = None,
                     batch_size: int | None = None, warm_up: Callable[[BatchEngine | None], None] | None = None,
                     note: Callable[[str], None] = lambda _line: None) -> int:
    """Generate ``samples`` ((row, sample index, settings) triples, as ``plan_samples`` gives them) as a
    job does, calling ``record`` with each ``Result``: one at a time in order, or with continuous batching
    when ``engine.batch_size`` is > 1 or "auto" (``_run_batched``; rows then finish out of order). Once
    ``stopping()`` is true no new row starts. Returns the compiled closures a batch engine built (0 when
    sequential).

    Args:
        planned: every sample of the job (batched mode sizes its slots from all of them), or None when
            ``positions`` is given.
        positions: batched mode's slot capacity, ``batch_capacity(lm, job, planned)``, when computed
            elsewhere (a Ray actor runs a slice of the job).
        batch_size: batched mode's slots when resolved elsewhere (``engine.batch_size: auto`` on Ray,
            ``auto_batch_size``); None: ``engine.batch_size``, "auto" resolved here.
        warm_up: called once before the first generation with the engine that will run it: None for
            sequential decoding, the ``BatchEngine`` for batched (``LoadedModel.warm_up(batch)`` warms
            exactly that path; its ``B`` is the batch size used); not called when no sample reaches the engine.
        note: called with a line worth showing: the size "auto" resolved to, and why.

    Raises:
        JobSpecError: batched mode's KV buffers would exceed ``engine.max_kv_memory_gb`` or the device's memory.
        GenerationError: generating a row raised something that is not a ``RowError`` (a row's own problem
            becomes its ``error`` column); the rows recorded before it are finished.
    """
    if job.task == "score":
        return score_choices(lm, job, samples, record, stopping, warm_up)
    if lm.engine.path.name == "batched":
        return _run_batched(lm, job, planned, samples, record, stopping, positions, warm_up, batch_size, note)
    if job.input.order == "prefix":
        samples = by_prefix(lm, job, samples)
    prompt_of = (None, None)  # (row index, its Prompt or RowError): samples of a row share it
    for row, k, gen in samples:
        if stopping():
            break
        if warm_up is not None:
            warm_up(None)
            warm_up = None
        try:
            t0 = time.perf_counter()  # the row's first sample: total_s counts building its prompt
            if prompt_of[0] != row.index:
                prompt_of = (row.index, row_prompt(row, job, lm))
            res = generate_row(lm, job, row, k, gen, prompt_of[1], t0)
        except Exception as e:  # not a RowError (generate_row keeps those): stop the run
            raise GenerationError.of(e, [(row.id, k)]) from e
        record(res)
    return 0


def by_prefix(lm: LoadedModel, job: JobSpec, samples) -> list:
    """``input.order: prefix``: ``samples`` ((row, sample index, settings) triples) sorted by their row's
    prompt token ids, so rows sharing a prefix run one after another (a stable sort: a row's samples stay
    together in index order, equal prompts in input order; rows without a prompt first).

    Raises:
        GenerationError: building a prompt raised something that is not a ``RowError``.
    """
    ids: dict[int, list[int]] = {}
    for row, k, _ in samples:
        if row.index not in ids:
            try:
                p = row_prompt(row, job, lm)
            except Exception as e:  # not a RowError (row_prompt returns those)
                raise GenerationError.of(e, [(row.id, k)]) from e
            ids[row.index] = [] if isinstance(p, RowError) else p.token_ids
    return sorted(samples, key=lambda t: ids[t[0].index])


def _no_tokens(k: int, choice: str) -> str:
    """Why choice ``k`` has no continuation tokens (``encode_pair`` split them all into the context)."""
    if choice == "":
        return f"choice {k} ('') encodes to no tokens"
    return (f"choice {k} ({choice!r}) adds no tokens to the context: context + choice encode to as many tokens "
            "as the context alone (the choice's text joins the context's last token)")


def score_row(lm: LoadedModel, job: JobSpec, row: InputRow, indices: list[int],
              choices: list[str] | str) -> list[ScoreResult]:
    """``task: score``: the output rows of the choices ``indices`` of ``row`` (``choices`` from
    ``plan.row_choices``): its context prefilled once, those choices scored in one batch from its KV
    (``engine.score.score``). Row problems (the choices cell, the prompt, a context + continuation longer
    than the model's context) fail every choice of the row; a choice that encodes to no tokens fails alone."""
    t0 = time.perf_counter()
    text = row.prompt if row.messages is None else None
    if isinstance(choices, str):
        return [failed_score(row, k, text, None, choices, t0) for k in indices]
    picked = [choices[k] for k in indices]
    try:
        if row.error is not None:
            raise RowError(row.error)
        sp = build_score_prompt(row, job.input, lm.tokenizer, picked)
    except RowError as e:
        return [failed_score(row, k, text, c, str(e), t0) for k, c in zip(indices, picked)]
    ok = [i for i, ids in enumerate(sp.continuation_ids) if ids]
    out: dict[int, ScoreResult] = {
        i: failed_score(row, indices[i], sp.text, picked[i], _no_tokens(indices[i], picked[i]), t0)
        for i in range(len(picked)) if i not in ok}
    if ok:
        times: dict = {}
        mx.reset_peak_memory()
        try:
            scores, why = score(lm.engine, sp.context_ids, [sp.continuation_ids[i] for i in ok], times)
        except RowError as e:
            scores, why = e, None
        if why:
            lm.engine.note(f"scoring each choice with its own prefill: {why}", kind="score")
        total, peak = time.perf_counter() - t0, mx.get_peak_memory()
        for j, i in enumerate(ok):
            if isinstance(scores, RowError):
                out[i] = failed_score(row, indices[i], sp.text, picked[i], str(scores), t0)
                continue
            s = scores[j]
            out[i] = ScoreResult(id=row.id, choice_index=indices[i], prompt=sp.text, choice=picked[i],
                                 logprob_sum=s.logprob_sum, num_tokens=s.num_tokens, is_greedy=s.is_greedy,
                                 token_logprobs=s.token_logprobs, prompt_tokens=len(sp.context_ids),
                                 ttft_s=times.get("prefill_s"), total_s=total, peak_memory_bytes=peak,
                                 shared_context=why is None, error=None)
    return [out[i] for i in range(len(picked))]


def score_choices(lm: LoadedModel, job: JobSpec, samples, record: Callable[[ScoreResult], None],
                  stopping: Callable[[], bool] = lambda: False,
                  warm_up: Callable[[BatchEngine | None], None] | None = None) -> int:
    """``task: score``: score ``samples`` ((row, choice index, choices) triples in input order, as
    ``plan.plan_choices`` gives them; the pending choices of a row run together, ``score_row``), calling
    ``record`` with each ``ScoreResult``. Once ``stopping()`` is true no new row starts. Returns 0 (no
    compiled closures: scoring runs the model's forward eagerly).

    Raises:
        GenerationError: scoring a row raised something that is not a ``RowError``.
    """
    groups: list[tuple[InputRow, list[int], object]] = []
    for row, k, choices in samples:
        if groups and groups[-1][0].index == row.index:
            groups[-1][1].append(k)
        else:
            groups.append((row, [k], choices))
    for row, indices, choices in groups:
        if stopping():
            break
        if warm_up is not None:
            warm_up(None)
            warm_up = None
        try:
            results = score_row(lm, job, row, indices, choices)
        except Exception as e:  # not a RowError (score_row keeps those): stop the run
            raise GenerationError.of(e, [(row.id, k) for k in indices]) from e
        for res in results:
            record(res)
    return 0


def _prepared(lm: LoadedModel, job: JobSpec, samples):
    """``prepare_sample`` of each sample, lazily; the samples of a row share its built prompt.

    Raises:
        GenerationError: building a prompt raised something that is not a ``RowError``.
    """
    prompt_of = (None, None)  # (row index, its Prompt or RowError)
    for row, k, gen in samples:
        try:
            t0 = time.perf_counter()  # the row's first sample: total_s counts building its prompt
            if prompt_of[0] != row.index:
                prompt_of = (row.index, row_prompt(row, job, lm))
            s = prepare_sample(lm, job, row, k, gen, prompt_of[1], t0)
        except Exception as e:  # not a RowError (prepare_sample keeps those): stop the run
            raise GenerationError.of(e, [(row.id, k)]) from e
        yield s


def _positions(lm: LoadedModel, s: Sample) -> int:
    return min(len(s.ids) + s.params.max_tokens, lm.engine.context_length)


def batch_capacity(lm: LoadedModel, job: JobSpec, planned) -> int:
    """Batched mode's positions per slot for a job: the longest prompt + max_tokens of any sample in
    ``planned`` (every sample of the job), at most the context; 0 if every sample fails."""
    return max((_positions(lm, s) for s in _prepared(lm, job, planned) if s.failed is None), default=0)


def _run_batched(lm: LoadedModel, job: JobSpec, planned, pending, record: Callable[[Result], None],
                 stopping: Callable[[], bool], positions: int | None = None, warm_up=None,
                 batch_size: int | None = None, note: Callable[[str], None] = lambda _line: None) -> int:
    """Generate ``pending`` samples with continuous batching (``batch_size``, else ``engine.batch_size``
    slots, "auto" resolved by ``auto_batch_size``; at most one slot per sample of the job, ``planned``,
    committed ones included, so every run of a job decodes with the same B), calling ``record`` with each result as it finishes (rows
    come out of input order). Returns the compiled closures the batch engine built.

    Every prompt of the job (``planned``, committed rows included) is built first, unless ``positions``
    is given: the longest prompt + max_tokens sets the slots' capacity (``batch_capacity``), so every
    run of a job, resumed or not, decodes with the same step shape (B slots x capacity), and a row's
    tokens do not depend on which rows are still pending. The KV memory is checked
    (``batch.check_kv_memory``) before any generation. Once ``stopping()`` is true no new row starts;
    the rows in flight finish.

    Raises:
        JobSpecError: the KV buffers would exceed ``engine.max_kv_memory_gb`` or the device's memory.
        GenerationError: building a prompt or the engine raised something that is not a ``RowError``.
    """
    todo = {(row.id, k) for row, k, _ in pending}
    samples, failed, seen = [], [], 0
    for s in _prepared(lm, job, pending if positions is not None else planned):
        if s.failed is None:
            seen = max(seen, _positions(lm, s))
        if (s.row.id, s.index) in todo:
            (samples if s.failed is None else failed).append(s)
    positions = seen if positions is None else positions
    if job.input.order == "prefix":  # stable: a row's samples stay together in index order
        samples.sort(key=lambda s: s.ids)
    engine = None
    if samples:
        if batch_size is None and job.engine.batch_size == "auto":
            batch_size, why = auto_batch_size(lm.engine, positions, job.engine.max_kv_memory_gb)
            note(f"engine.batch_size auto: {batch_size} ({why})")
        batch_size = batch_size or job.engine.batch_size
        total = len(planned) if planned is not None and hasattr(planned, "__len__") else None
        if total is not None and 0 < total < batch_size:  # idle slots compute like busy ones
            note(f"engine.batch_size {batch_size}: the job has {total} samples, so {total} slots")
            batch_size = total
        engine = BatchEngine(lm.engine, batch_size, positions)
        check_kv_memory(engine, job.engine.max_kv_memory_gb)
    for s in failed:
        record(s.failed)
    if engine is None:
        return 0
    if warm_up is not None:
        warm_up(engine)

    started, done = [], set()

    def requests():
        for i, s in enumerate(samples):
            if stopping():
                return
            started.append(i)
            yield Request(i, s.ids, s.params)

    def in_flight(first=None) -> list[tuple]:
        order = first if first is not None else [j for j in reversed(started) if j not in done]
        return [(samples[j].row.id, samples[j].index) for j in order]

    for i, g in _guarded(engine.run(requests()), in_flight):
        done.add(i)
        s = samples[i]
        record(sample_result(s, g, s.prep_s + (g.total_s if not isinstance(g, RowError) else 0.0),
                             engine.B))
    return engine.closure_count


def _guarded(results: Iterator, in_flight: Callable[..., list[tuple]]) -> Iterator:
    """``results`` (a ``BatchEngine.run``), with what it raises (the engine yields a row's ``RowError``,
    never raises it) as a ``GenerationError`` naming the rows in flight then: ``in_flight(tags)`` for the
    requests the error names (``request_tags``, set by a failed prefill: the culprits first), else
    ``in_flight()`` (every row started and not back, the latest first)."""
    try:
        yield from results
    except Exception as e:
        tags = getattr(e, "request_tags", None)
        raise GenerationError.of(e, in_flight(tags) if tags is not None else in_flight()) from e
