"""Planning a job: its fingerprint, its input state, the samples it produces and each sample's prompt and settings."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pyarrow as pa

from .. import __version__, outdir, shards
from ..engine import GenerateParams
from ..engine.sampler import row_seed
from ..errors import RowError
from ..export import within
from ..inputs import InputRow, dataset_files, input_files, local_dataset
from ..jobspec import CacheSpec, GenerationSpec, JobSpec, JobSpecError, structured_from_cell, with_overrides
from ..loader import LoadedModel, model_identity
from ..prompts import Prompt, build_prompt
from ..resolve import resolve_model
from ..results import Result, ScoreResult, result_schema, schema_digest
from ..shards import read_manifest

# The digest (``results.schema_digest``) of the shard schema of every output dir written before the
# fingerprint held one (pipeline 0.2.0): a fingerprint without ``schema`` means this schema.
UNRECORDED_SCHEMA = "11a1bbae2b2944ff4fd7ae4b00cc7baf1cdfe7be0cc7483f17da5f92aa68793f"

def fingerprint(job: JobSpec, model_id: dict) -> dict:
    """What determines a job's outputs; resuming with a different fingerprint is refused.

    The model's content hash covers its tokenizer and chat template (GGUF metadata, or the hashed
    tokenizer files of a model directory). Package versions are included because kernels and
    tokenization may change between versions. The cache settings are included but for the prefix cache's
    size (``_cache_settings``). ``engine.batch_size`` is included (batched decoding runs
    other matmul shapes, so a token may differ at a near-tie); ``engine.max_kv_memory_gb`` is not, nor
    ``engine.fused`` when "auto" (the default: fingerprints of jobs written before it existed hold). The
    input files are not: rows added later are processed
    by the next run (see ``input_state``).

    ``schema`` is the shard schema's digest (``results.schema_digest``: column names, types and
    nullability, the input-dependent ``id`` type left out), so a changed column refuses output dirs
    written with the old one, with no version to bump; left out while it is ``UNRECORDED_SCHEMA``, the
    schema of every output dir written before it existed (their fingerprints hold).

    ``task: score`` adds ``task`` and ``score`` (the choices or continuation column) and leaves out
    ``generation`` (unused), recording ``input.row_overrides`` and ``input.truncate`` (which it does not read)
    at their defaults, so changing them resumes; with ``task: generate`` neither key appears, so fingerprints of jobs written
    before scoring existed hold.
    """
    inp = job.input
    fp = {
        "model": model_id,
        "versions": {"pipeline": __version__, "mlx": mx.__version__, "tokenizers": _version("tokenizers")},
        "prompt": {
            "id_column": inp.id_column,
            "prompt_column": inp.prompt_column,
            "messages_column": inp.messages_column,
            "system_prompt": inp.system_prompt,
            "apply_chat_template": inp.apply_chat_template,
            "parse_special_tokens": inp.parse_special_tokens,
            "row_overrides": inp.row_overrides,
            "truncate": inp.truncate,
            "template": inp.template,
            "filter": None if inp.filter is None else [dataclasses.asdict(f) for f in inp.filter],
            "shuffle_seed": inp.shuffle_seed,
            **({"structured_column": inp.structured_column} if inp.structured_column is not None else {}),
        },
        "generation": job.generation.to_dict(),
        "cache": _cache_settings(job.cache),
        "engine": {k: v for k, v in dataclasses.asdict(job.engine).items()
                   if k != "max_kv_memory_gb" and not (k == "fused" and v == "auto")},
    }
    if job.task == "score":
        fp["task"] = "score"
        fp["score"] = {"choices_column": inp.choices_column, "continuation_column": inp.continuation_column}
        del fp["generation"]
        fp["prompt"].update(row_overrides=True, truncate="error")  # read by generation only: their defaults
        fp["schema"] = schema_digest(result_schema(pa.string(), "score"))
    elif (schema := schema_digest()) != UNRECORDED_SCHEMA:
        fp["schema"] = schema
    return fp


def _cache_settings(cache) -> dict:
    """The cache settings that shape a row's arithmetic: every ``CacheSpec`` field but ``prefix_cache_gb``,
    whose size changes only what is reused, not the result (reused KV is what the one-block prefill chunks
    compute); ``prefix_block_size`` is None with prefix caching off (prefill chunks of
    ``engine.prefill_step_size`` then). Without ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start`` are
    recorded at their defaults (they do nothing then; the keys stay, so the fingerprints of jobs that left them
    at their defaults hold; a dir written with another value, accepted before, needs --force once)."""
    if cache.kv_bits is None:
        cache = dataclasses.replace(cache, kv_group_size=CacheSpec.kv_group_size,
                                    quantized_kv_start=CacheSpec.quantized_kv_start)
    out = dataclasses.asdict(cache)
    gb = out.pop("prefix_cache_gb")
    if not gb:
        out["prefix_block_size"] = None
    return out


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def input_state(job: JobSpec) -> list[dict]:
    """Path, size (bytes) and mtime (ns) of each input file (a local dataset directory's: the files of its
    split, ``inputs.dataset_files``), recorded in the manifest to report changes and, without
    ``input.id_column``, to check the committed rows' positions (``control.check_positions``); a hub dataset:
    its name, config, split and revision."""
    if local_dataset(job.input.dataset) is not None:
        files = dataset_files(job.input.dataset)[0]
    elif job.input.dataset is not None:
        return [dataclasses.asdict(job.input.dataset)]
    else:
        files = input_files(job.input.path)
    return [{"path": str(f), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]


def recorded_job(job: JobSpec) -> dict:
    """``job.to_dict()`` as the manifest records it (``info.job``): a relative ``input.path`` (file, directory or
    glob) and a relative local ``input.dataset`` directory made absolute against the working directory the
    run reads them from, so that ``status``, ``export --join-input`` and ``report``, run from anywhere, read
    the same input."""
    out = job.to_dict()
    given = out["input"]
    if given.get("path") and not os.path.isabs(given["path"]):
        given["path"] = os.path.join(os.getcwd(), given["path"])
    dataset = given.get("dataset")
    if dataset and not os.path.isabs(dataset["name"]) and os.path.isdir(dataset["name"]):
        dataset["name"] = os.path.abspath(dataset["name"])
    return out


def _glob_matches(pattern: str, path: str) -> bool:
    """Whether ``glob.glob(pattern, recursive=True)`` would list ``path`` were it a file: ``**`` as a whole
    component matches any number of directories, other components as ``fnmatch`` (both made absolute); as in
    glob, a wildcard never matches a name that starts with a dot unless the pattern's component does."""
    pat, parts = Path(os.path.abspath(pattern)).parts, Path(os.path.abspath(path)).parts

    def component(name: str, p: str) -> bool:
        return fnmatch.fnmatchcase(name, p) and (not name.startswith(".") or p.startswith("."))

    def match(i: int, j: int) -> bool:
        if i == len(pat):
            return j == len(parts)
        if pat[i] == "**":
            return any(match(i + 1, k) for k in range(j, len(parts) + 1)
                       if not any(n.startswith(".") for n in parts[j:k]))
        return j < len(parts) and component(parts[j], pat[i]) and match(i + 1, j + 1)

    return match(0, 0)


def check_output_apart(job: JobSpec, out_dir: str | Path) -> None:
    """The output dir must not be where the input is read from: inside the directory of ``input.path`` (searched
    recursively) or of a local ``input.dataset`` (whose files ``datasets`` picks from the whole directory: the
    most common suffix, which the shards' .parquet may become), or where the glob of ``input.path`` would list
    the shards or the manifest. The first run would work, and every later one would read its own output as
    input rows.

    Raises:
        OutputError: naming both keys.
    """
    out, dataset, path = Path(out_dir), local_dataset(job.input.dataset), job.input.path
    if dataset is not None:
        key, name, inside = "input.dataset", job.input.dataset.name, within(out, dataset)
    elif path is not None:
        key, name = "input.path", path
        inside = within(out, Path(path)) if Path(path).is_dir() else \
            any(_glob_matches(path, str(out / f)) for f in ("part-00000.parquet", shards.MANIFEST))
    else:
        return
    if inside:
        raise shards.OutputError(f"output.dir {str(out)!r} is inside what {key} {name!r} reads: a later run "
                                 f"would read its shards as input rows; write the output elsewhere")


def job_fingerprint(job: JobSpec) -> dict:
    """``fingerprint`` with the model resolved (resolving may download a model not yet cached)."""
    return fingerprint(job, model_identity(job.model, resolve_model(job.model)))


def check_output_dir(job: JobSpec, output_dir: str | None = None) -> dict | None:
    """Check without writing that the job's output dir is new, empty, or holds this job's results
    (for ``pipeline validate``), and that each committed shard is there with its recorded size and an
    intact Parquet footer (``shards.check_shards``; no hashing). First, that it is apart from the input
    (``check_output_apart``), that no run holds its lock (``outdir.check_not_in_use``) and that it can be written (``outdir.check_writable``: a test file created
    and removed in it, or in its nearest existing parent).

    Returns:
        The output dir's manifest, or None when it has none (new or empty).

    Raises:
        OutputError: the dir is inside what input.path reads, in use by a run, or not writable; naming the fingerprint fields that differ,
            or foreign files; or the committed shards that are missing or damaged, one line each.
        DiskFullError: not even the test file fits.
    """
    out_dir = Path(output_dir or job.output.dir)
    check_output_apart(job, out_dir)
    outdir.check_not_in_use(out_dir)
    outdir.check_writable(out_dir)
    if read_manifest(out_dir) is None:
        shards.check_output_dir(out_dir, {})
        return None
    manifest = shards.check_output_dir(out_dir, job_fingerprint(job))
    shards.check_shards(out_dir, manifest["shards"], footer=True).raise_bad()
    return manifest


def generate_params(gen: GenerationSpec, seed: int) -> GenerateParams:
    """The engine's settings for one sample of a row whose settings are ``gen``: ``gen`` itself (a
    ``GenerationSpec`` is a ``GenerateParams``) with the sample's own ``seed``."""
    return dataclasses.replace(gen, seed=seed)


def row_generation(job: JobSpec, row: InputRow) -> GenerationSpec | str:
    """The row's generation settings (the job's, with the row's override columns and its
    ``input.structured_column`` value), or why they are invalid (the row then fails with that error)."""
    try:
        gen = with_overrides(job.generation, row.overrides)
        if row.structured is not None:
            where = f"input.structured_column {job.input.structured_column!r} of row {row.id!r}"
            gen = dataclasses.replace(gen, structured=structured_from_cell(row.structured, where))
        return gen
    except JobSpecError as e:
        return str(e)


def fit_context(ids: list[int], lm: LoadedModel, policy: str) -> list[int]:
    """``ids`` cut to leave room for at least one generated token, per ``input.truncate``: "left" drops
    the first tokens (a leading BOS stays when the tokenizer adds one, ``Tokenizer.add_bos_token``: a
    template's first token that merely shares the BOS id, SmolLM2's ``<|im_start|>``, is cut like the
    rest), "right" the last.

    Raises:
        RowError: the prompt does not fit and the policy is "error".
    """
    room = lm.engine.context_length - 1
    if len(ids) <= room:
        return ids
    if policy == "error":
        raise RowError(f"prompt has {len(ids)} tokens; the model's context is {lm.engine.context_length} "
                       "(input.truncate: left or right cuts it to fit)")
    if policy == "right":
        return ids[:room]
    tok = lm.tokenizer
    keep = ids[:1] if tok.add_bos_token and ids[0] == tok.bos_token_id else []
    return keep + ids[len(ids) - (room - len(keep)):]


def truncation_note(row_id, n_prompt: int, n_kept: int, policy: str, context_length: int) -> str:
    """The once-per-run line that says a prompt of ``n_prompt`` tokens was cut to ``n_kept`` (``fit_context``)."""
    side = "start" if policy == "left" else "end"
    return (f"row {row_id!r}: input.truncate: {policy} cut {n_prompt - n_kept} of its {n_prompt} prompt tokens "
            f"(from the {side}) to fit the model's context of {context_length}; later cut rows are not logged "
            "(prompt_tokens gives each row's kept length)")


def failed_result(row: InputRow, sample_index: int, seed: int, text: str | None, error: str, t0: float) -> Result:
    """The output row of a sample that failed with ``error`` (the ``error`` column's text); ``t0`` is when it
    started (``time.perf_counter()``), so ``total_s`` counts the seconds since."""
    return Result(id=row.id, sample_index=sample_index, prompt=text, completion=None, finish_reason=None,
                  stop_reason=None, stop_token_id=None, prompt_tokens=None, completion_tokens=None, ttft_s=None,
                  prefill_tps=None, decode_tps=None, total_s=time.perf_counter() - t0, peak_memory_bytes=None,
                  compiled=None, seed=seed, error=error)


@dataclass
class Sample:
    """One sample of one row, ready for the engine (or already failed).

    Attributes:
        row, index: the input row and the sample index.
        seed: the sample's sampling seed (``sampler.row_seed``).
        text: the prompt text reported in the ``prompt`` column.
        ids: prompt token ids, cut to the context per ``input.truncate`` (None if failed).
        params: the engine's settings (None if failed).
        failed: the failed ``Result`` when the row cannot be generated (bad overrides, bad prompt).
        prep_s: seconds spent building the prompt and the settings (added to the row's ``total_s``; the
            row's first sample counts the prompt's building, which its other samples share).
    """

    row: InputRow
    index: int
    seed: int
    text: str | None
    ids: list[int] | None = None
    params: GenerateParams | None = None
    failed: Result | None = None
    prep_s: float = 0.0


def prepare_sample(lm: LoadedModel, job: JobSpec, row: InputRow, sample_index: int = 0,
                   gen: GenerationSpec | str | None = None, prompt: Prompt | RowError | None = None,
                   t0: float | None = None) -> Sample:
    """Settings, seed and prompt ids of one sample; a ``Sample`` with ``failed`` set when the row's
    overrides or prompt are invalid.

    Args:
        gen: the row's settings from ``row_generation`` (computed when None).
        prompt: the row's built prompt, or the ``RowError`` building it raised (built when None), so
            the samples of one row share it.
        t0: when the sample's time starts (``time.perf_counter()``; None: now): before building ``prompt``
            for the first sample of a row, so that its ``total_s`` counts that too.
    """
    t0 = time.perf_counter() if t0 is None else t0
    gen = row_generation(job, row) if gen is None else gen
    seed = row_seed(job.generation.seed if isinstance(gen, str) else gen.seed, row.id, sample_index)
    s = Sample(row, sample_index, seed, row.prompt if row.messages is None else None)
    if isinstance(gen, str):
        s.failed = failed_result(row, sample_index, seed, s.text, gen, t0)
        return s
    try:
        prompt = row_prompt(row, job, lm) if prompt is None else prompt
        if isinstance(prompt, RowError):
            raise prompt
        s.text = prompt.text
        s.ids = fit_context(prompt.token_ids, lm, job.input.truncate)
        if len(s.ids) < len(prompt.token_ids):
            lm.engine.note(truncation_note(row.id, len(prompt.token_ids), len(s.ids), job.input.truncate,
                                           lm.engine.context_length), kind="truncate")
        s.params = generate_params(gen, seed)
    except RowError as e:
        s.failed = failed_result(row, sample_index, seed, s.text, str(e), t0)
    s.prep_s = time.perf_counter() - t0
    return s


def plan_samples(job: JobSpec, rows: list[InputRow]) -> list[tuple]:
    """Every (row, sample index, settings) the job produces, in input order: ``n`` samples per row
    (the row's own ``n`` override if valid; 1 for a row whose overrides are invalid). ``task: score``:
    ``plan_choices``."""
    if job.task == "score":
        return plan_choices(job, rows)
    out = []
    for row in rows:
        gen = row_generation(job, row)
        out += [(row, k, gen) for k in range(1 if isinstance(gen, str) else gen.n)]
    return out


def row_prompt(row: InputRow, job: JobSpec, lm: LoadedModel) -> Prompt | RowError:
    """The row's built prompt (``prompts.build_prompt``), or the ``RowError`` that says why it has none (an
    input problem of the row, or one building it raised); the samples of a row share it."""
    if row.error is not None:
        return RowError(row.error)
    try:
        return build_prompt(row, job.input, lm.tokenizer)
    except RowError as e:
        return e


def row_choices(job: JobSpec, row: InputRow) -> list[str] | str:
    """The continuations ``task: score`` scores for ``row``: its ``input.choices_column`` list, or its
    ``input.continuation_column`` string as a list of one; or why the cell is unusable (the row fails with
    that error, naming the row and the column)."""
    inp = job.input
    if inp.continuation_column is not None:
        if not isinstance(row.choices, str):
            got = "is null" if row.choices is None else f"must be a string, got {type(row.choices).__name__}"
            return f"input.continuation_column {inp.continuation_column!r} of row {row.id!r} {got}"
        return [row.choices]
    cell = row.choices
    if not isinstance(cell, list) or not cell or not all(isinstance(c, str) for c in cell):
        got = "null" if cell is None else "an empty list" if cell == [] else type(cell).__name__
        if isinstance(cell, list) and cell:
            bad = next(c for c in cell if not isinstance(c, str))
            got = "a list with a null" if bad is None else f"a list with a {type(bad).__name__} ({bad!r})"
        return (f"input.choices_column {inp.choices_column!r} of row {row.id!r} must be a non-empty list of "
                f"strings, got {got}")
    return cell


def plan_choices(job: JobSpec, rows: list[InputRow]) -> list[tuple[InputRow, int, list[str] | str]]:
    """``task: score``: every (row, choice index, the row's choices or why they are unusable) in input
    order, one per choice (``row_choices``; one, index 0, for a row whose choices cell is unusable)."""
    out = []
    for row in rows:
        choices = row_choices(job, row)
        out += [(row, k, choices) for k in range(1 if isinstance(choices, str) else len(choices))]
    return out


def failed_score(row: InputRow, choice_index: int, text: str | None, choice: str | None, error: str,
                 t0: float) -> ScoreResult:
    """The output row of a (row, choice) of ``task: score`` that failed with ``error``; ``t0`` as
    ``failed_result``."""
    return ScoreResult(id=row.id, choice_index=choice_index, prompt=text, choice=choice, logprob_sum=None,
                       num_tokens=None, is_greedy=None, token_logprobs=None, prompt_tokens=None, ttft_s=None,
                       total_s=time.perf_counter() - t0, peak_memory_bytes=None, shared_context=None, error=error)
