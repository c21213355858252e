"""Command line: ``pipeline run JOB``, ``validate JOB``, ``status OUT_DIR``, ``export OUT_DIR``, ``report OUT_DIR``,
``convert SRC DST``, ``inspect MODEL``, ``bench``. Each command parses and calls a plain function.

Errors print one ``error: ...`` line per problem on stderr. ``run`` and ``validate`` exit 2 for a problem with
the job or its inputs, found before the model loads (``JOB_ERRORS``): the job file (every bad key at once), a
model spec naming no alias, file, directory or repo id, the input files and columns, an output dir holding
other files or another job's results, in use by another run or not writable; fixing the job file or data is the
remedy and ``validate`` finds the same problems. Every other failure exits 1: downloading or hashing the model, a
model that cannot be loaded (corrupt file, unknown architecture), job settings only the loaded model can refute
(``cache.kv_group_size`` not dividing its head_dim, ``input.apply_chat_template`` without a chat template),
a write into the output dir failing mid-run (``OutputWriteError``: no space left, a read-only remount, the
directory removed), and a row whose generation raised what is not a row's own
problem (``GenerationError``: an error from MLX, a bug in a model; one line naming the row and the exception);
for these two ``run`` prints its summary line first, and the rows committed stay. Failed rows are not errors:
``run`` exits 3 (``--failed-exit-code``) when the output holds rows whose ``error`` is set.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from .engine.cache import CacheConfigError
from .chat_template import ChatTemplateError
from .run.cluster import DistributedError
from .gguf import GGUFError
from .inputs import InputError, read_rows
from .modeldir import ModelDirError
from .jobspec import JobSpecError, load_job
from .loader import WeightsError
from .models.base import ConfigError
from .resolve import ModelResolveError, check_model_spec
from .shards import OutputError, OutputWriteError
from .tokenizer import TokenizerError

USER_ERRORS = (CacheConfigError, JobSpecError, InputError, OutputError, ModelResolveError, GGUFError, ModelDirError, TokenizerError,
               ConfigError, ChatTemplateError, WeightsError, DistributedError, OutputWriteError)
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class ModelSpecError(ModelResolveError):
    """``check_model_spec`` rejected the job's model spec (a job problem, unlike a failed download)."""


JOB_ERRORS = (JobSpecError, InputError, OutputError, ModelSpecError)  # exit 2; see the module docstring


def _check_model_spec(spec: str) -> None:
    try:
        check_model_spec(spec)
    except ModelResolveError as e:
        raise ModelSpecError(str(e)) from None


def _print_error(e: Exception) -> None:
    for line in str(e).splitlines() or [type(e).__name__]:
        click.echo(f"error: {line}", err=True)


def _fail(e: Exception, exit_code: int | None = None):
    """Print ``e`` (one line per problem) and exit ``exit_code``; None: 2 for ``JOB_ERRORS``, else 1."""
    _print_error(e)
    sys.exit(exit_code if exit_code is not None else 2 if isinstance(e, JOB_ERRORS) else 1)


@click.group()
@click.version_option(package_name="pipeline")
def main():
    """Batch offline text generation on MLX.

    Errors print `error: ...` lines on stderr.

    \b
    Exit status:
      0    success (run: done, no failed rows; a finished job prints "nothing to do")
      3    run: done, but some rows failed; their error column says why
           (--failed-exit-code N changes it, 0 makes it a success; --retry-failed redoes them)
      2    a problem with the job or its inputs (job file, model spec, input files and
           columns, output dir: also one in use by another run, or not writable), found
           before the model loads; or a bad command line
      1    any other failure (model download or loading, Ray missing or failing, no space
           left in the output dir: free some and run again to resume)
      130  run stopped by SIGINT (Ctrl-C); 143 by SIGTERM: run it again to resume
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    # datasets and huggingface_hub give their loggers a handler of their own: a record that also reached
    # ours through the root logger printed twice ("Retrying in 1s", then "WARNING: Retrying in 1s")
    for name in ("datasets", "huggingface_hub"):
        logging.getLogger(name).propagate = False


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--output-dir", help="Write here instead of the job's output.dir (a non-empty path).")
@click.option("--limit", type=click.IntRange(min=1),
              help="Use only the first N rows the job selects (input.limit, if set, still caps them).")
@click.option("--force", is_flag=True,
              help="Resume even if the job's settings or model changed, adding rows made with the new settings "
                   "(each row's settings stay recorded; pipeline status shows them).")
@click.option("--no-progress", is_flag=True,
              help="No progress on stderr: no download bar, load and warm-up lines, or progress bar.")
@click.option("--retry-failed", is_flag=True, help="Generate the committed rows whose error is set again, replacing them.")
@click.option("--redo-corrupt", is_flag=True,
              help="Check every committed shard (sha256 included), drop the missing or damaged ones from the "
                   "manifest (recorded under 'dropped') and generate their rows again; the other rows are kept.")
@click.option("--failed-exit-code", type=click.IntRange(0, 255), default=3, show_default=True,
              help="Exit status when the output holds failed rows (0: treat them as success).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", metavar="[ADDRESS|auto|local]",
              help="Run on a Ray cluster (executor: ray): --ray alone connects to the running cluster (auto), "
                   "--ray local starts one for this run, --ray HOST:PORT names one. Put it after JOB_FILE.")
def run(job_file, output_dir, limit, force, no_progress, retry_failed, redo_corrupt, failed_exit_code, ray_address):
    """Run JOB_FILE, or resume it where an earlier run stopped.

    Exit status: 0 all rows done; FAILED_EXIT_CODE (3) done but some rows failed (see their error
    column; --retry-failed redoes them); 2 a problem with the job, its input or its output dir, such as
    a committed shard that is missing or damaged (--redo-corrupt regenerates its rows; nothing generated);
    1 another error (model download or load, Ray missing or failing, no space left in the output dir: free
    some and run again); 130 / 143 stopped by SIGINT / SIGTERM (run again to resume). Another run on the
    same output dir is refused (exit 2).
    """
    import dataclasses

    from .run import GenerationError, run_job

    try:
        if output_dir is not None and not output_dir.strip():  # else '' would fall back to output.dir
            raise JobSpecError(f"--output-dir must be a non-empty path, got {output_dir!r}")
        job = load_job(job_file)
        if ray_address is not None:
            job = dataclasses.replace(job, executor="ray", ray=dataclasses.replace(job.ray, address=ray_address))
            try:  # the checks that executor: ray in the job file gets (a score job is refused)
                job.ray.check()
                job.check()
            except JobSpecError as e:
                raise JobSpecError(f"--ray: {e}") from None
        _check_model_spec(job.model)
        summary = run_job(job, output_dir=output_dir, limit=limit, force=force, retry_failed=retry_failed,
                          redo_corrupt=redo_corrupt, progress=not no_progress, echo=click.echo)
    except (OutputWriteError, GenerationError) as e:  # exit 1, after the summary line of the run it stopped
        if e.summary is not None:
            click.echo(e.summary.line())
        _fail(e)
    except USER_ERRORS as e:
        _fail(e)
    except KeyboardInterrupt:
        click.echo("interrupted; committed rows are safe; run the same command again to resume", err=True)
        sys.exit(EXIT_CODES["SIGINT"])
    click.echo(summary.line())
    if summary.interrupted:
        sys.exit(EXIT_CODES[summary.interrupted])
    if summary.failed_total:
        click.echo(f"{summary.failed_total} row(s) failed (error column set); "
                   "fix the input and run with --retry-failed to redo them", err=True)
        sys.exit(failed_exit_code)


def validate_job(job_file: str) -> tuple[list[Exception], str]:
    """Every problem with a job found without loading the model: the job file, the model spec's form, the
    input files and columns, the output dir (in use by a run, not writable, foreign files, or another job's
    results: comparing with those resolves the model, which may download it), and for ``executor: ray``
    whether Ray Data imports.

    Returns:
        (problems, summary): the problems (``JOB_ERRORS``) and, when there are none, the ok line
        (input rows, output rows = samples planned over the rows, model, output dir; for an output dir
        with committed rows, how many of the planned rows it holds: complete, or how many are to do).

    Raises:
        ModelResolveError, ...: resolving the model for the output-dir comparison failed (not a job problem).
        DiskFullError: the output dir has no space for a test file (an ``OutputWriteError``).
    """
    from .run.plan import check_output_dir, plan_samples

    try:
        job = load_job(job_file)
    except JobSpecError as e:
        return [e], ""
    problems, rows, model_ok, manifest = [], None, True, None
    try:
        _check_model_spec(job.model)
    except ModelSpecError as e:
        problems.append(e)
        model_ok = False
    try:
        rows, _ = read_rows(job.input)
    except InputError as e:
        problems.append(e)
    try:
        manifest = check_output_dir(job)
    except OutputError as e:
        problems.append(e)
    except ModelResolveError:
        if model_ok:
            raise  # a well-formed spec that cannot be fetched; a bad one is reported above
    if job.executor == "ray":
        from .run.cluster import import_ray

        try:
            import_ray()
        except DistributedError as e:
            problems.append(e)
    if problems:
        return problems, ""
    planned = [(r.id, k) for r, k, _ in plan_samples(job, rows)]
    per_row = "task: score, one per choice" if job.task == "score" else f"n={job.generation.n}"
    line = (f"ok: {job_file}: {len(rows)} input rows ({len(planned)} output rows, {per_row}), "
            f"model {job.model}, output {job.output.dir}")
    return [], line + _output_progress(job.output.dir, manifest, planned)


def _output_progress(out_dir: str, manifest: dict | None, planned: list[tuple]) -> str:
    """How much of ``planned`` (``(id, sample_index)`` keys) the output dir holds, for validate's ok line:
    empty for a new dir, else `` is complete (32/32 rows; nothing to do)`` or `` has 12/32 rows (20 to do)``."""
    from .shards import key_column, read_committed

    key = None if manifest is None else key_column(manifest.get("fingerprint"))
    table = None if manifest is None else read_committed(out_dir, manifest, ["id", key, "error"])
    if table is None:
        return ""
    want = set(planned)
    done = failed = 0
    for key in zip(table["id"].to_pylist(), table[key].to_pylist(), table["error"].to_pylist()):
        if key[:2] in want:
            done, failed = done + 1, failed + (key[2] is not None)
    rows = f"{done}/{len(planned)} rows" + (f", {failed} failed" if failed else "")
    if done == len(planned):
        return f" is complete ({rows}; nothing to do)"
    return f" has {rows} ({len(planned) - done} to do)"


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
def validate(job_file):
    """Check JOB_FILE, its model spec, input and output dir without loading the model.

    Prints every problem (one `error:` line each) and exits 2, or prints an ok line with the number of
    input and output rows. Exits 1 when the model cannot be fetched to compare with an existing output dir.
    """
    try:
        problems, line = validate_job(job_file)
    except USER_ERRORS as e:
        _fail(e)
    for e in problems:
        _print_error(e)
    if problems:
        sys.exit(2)
    click.echo(line)


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--verify", is_flag=True,
              help="Also check every committed shard's Parquet footer and sha256 against the manifest (reads them all).")
def status(out_dir, as_json, verify):
    """Progress of the job whose output is OUT_DIR: rows done / failed / pending, tokens, tok/s, wall
    time, ETA and the job's fingerprint.

    A committed shard that is missing, has another size or (--verify) fails its footer or sha256 check is
    one `error:` line each, naming it; exit 2.
    """
    import json

    from .status import format_status, job_status

    try:
        st = job_status(out_dir, verify=verify)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(json.dumps(st, indent=2) if as_json else format_status(st))


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--to", "to", required=True, metavar="PATH",
              help="results.parquet, results.jsonl, or a directory (datasets' save_to_disk; load_from_disk reads it); "
                   "a name that is only a suffix (.parquet) is refused, a hidden directory ends with / (.data/), "
                   "as does a directory named like a file (x.parquet/).")
@click.option("--join-input", is_flag=True, help="Add the input's columns (joined by id).")
@click.option("--overwrite", is_flag=True, help="Replace PATH if it exists.")
@click.option("--pivot", is_flag=True,
              help="task: score: one row per id, the choices' scores as lists, pred and pred_norm (argmax of "
                   "logprob_sum, of logprob_sum / num_tokens).")
@click.option("--json-fields", is_flag=True,
              help="Parse each completion as a JSON object into columns (every key met, and the job's schema "
                   "fields), plus json_error; rows that do not parse keep null fields.")
def export(out_dir, to, join_input, overwrite, pivot, json_fields):
    """Merge the committed rows of OUT_DIR into one file or dataset directory, in input order.

    It is written under a temporary name beside PATH and renamed, so a failed export leaves nothing there.

    Exit status: 2 for a bad command line (unknown format, PATH exists, lies in OUT_DIR or holds it, --pivot of a
    generate output, ...), a PATH that cannot be written (a parent that is a file, a read-only file system)
    or a problem with OUT_DIR or its input; 1 when no space is left at PATH.
    """
    from .export import ExportError, export_results

    try:
        summary = export_results(out_dir, to, join_input=join_input, overwrite=overwrite,
                                 warn=lambda line: click.echo(line, err=True), pivot=pivot, json_fields=json_fields)
    except ExportError as e:  # the command line or its destination: exit 2 (1 when no space was left)
        _fail(e, e.exit_code)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(summary.line())


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="HTML file to write [default: OUT_DIR/report/report.html].")
def report(out_dir, out):
    """Write an HTML report of OUT_DIR with PNG charts: decode tok/s over the run, TTFT vs prompt length,
    completion lengths, finish reasons, failed rows, fingerprint and summary numbers.

    Exit status: 2 for a bad command line (a task: score OUT_DIR, an --out in OUT_DIR itself or over its files,
    an --out that cannot be written: a parent that is a file, a read-only file system) or a damaged OUT_DIR; 1
    when matplotlib is missing or no space is left."""
    from .report import ReportError, write_report

    try:
        page = write_report(out_dir, out)
    except ReportError as e:  # exit 2 for the command line or --out, 1 for a missing matplotlib or no space left
        _fail(e, e.exit_code)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(f"wrote {page}")


@main.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
def convert(src, dst, overwrite):
    """Write the GGUF llama model SRC as an MLX model directory DST.

    Exits 2 when DST exists (without --overwrite, or not a directory convert may replace) or cannot be written
    (a parent that is a file, a read-only file system); 1 when no space is left. A failed convert leaves
    nothing at DST."""
    from .convert import ConvertError, convert_gguf

    try:
        out = convert_gguf(src, dst, overwrite=overwrite)
    except FileExistsError as e:  # the command line's destination: exit 2, as export's
        _fail(e, 2)
    except ConvertError as e:  # DST cannot be written: exit 2, 1 when no space is left
        _fail(e, e.exit_code)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(f"wrote {out}")


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect(model, as_json):
    """Describe MODEL (alias, .gguf path or model directory): architecture, weights, cache, special tokens."""
    import json

    from .describe import describe_model, format_description

    try:
        _check_model_spec(model)  # as run and validate check the job's model: one line, exit 2
        d = describe_model(model)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(json.dumps(d, indent=2, ensure_ascii=False) if as_json else format_description(d))


def _int_list(ctx, param, value):
    try:
        out = [int(v) for v in value.split(",")]  # an empty item ("8,,16") is an error, not skipped
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter("expected positive integers")
    return out


@main.command()
@click.argument("model", required=False)
@click.option("--random", "random_shape", metavar="SHAPE",
              help="Random 4-bit weights of a real model's shape, built in memory: smollm2-135m, llama-3.2-1b, "
                   "qwen2.5-7b, qwen3-0.6b, qwen3-8b or gemma-3-1b.")
@click.option("--prompt-tokens", default="64,512,2048", show_default=True, callback=_int_list,
              help="Prompt lengths (random tokens), comma-separated.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=256, show_default=True, help="New tokens per run.")
@click.option("--trials", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs per row (median reported), after one warm-up run.")
@click.option("--cache", "caches", default="full", show_default=True,
              help="KV cache kinds, comma-separated: full, rotating:N, q8, q4, rotating-q8:N.")
@click.option("--variants", default=None,
              help="Engine decode variants to run: eager, compiled, fused (the fused CUDA step; CUDA only), "
                   "fused-replay (the same step compiled once and replayed), fused-layers (replayed, each layer one "
                   "kernel) "
                   "[default: eager,compiled]; with --batch-size: "
                   "the engine's compile setting, auto, eager, compiled [default: auto].")
@click.option("--dequantize/--no-dequantize", default=None,
              help="Expand quantized weights (default: load_model's auto rule). mlx-lm gets the same format: "
                   "dense weights of the same dtype when ours are expanded, the quantized ones when not.")
@click.option("--no-peer", is_flag=True, help="Skip mlx-lm (generate_step; with --batch-size: batch_generate).")
@click.option("--batch-size", "batch_sizes", default=None,
              callback=lambda ctx, param, value: None if value is None else _int_list(ctx, param, value),
              help="Job throughput mode: batch sizes, comma-separated (e.g. 1,8,32,64,128): --prompts prompts of the "
                   "first --prompt-tokens length through the batching engine at each size (at 1 also the sequential "
                   "loop), with mlx-lm's batch_generate as the peer.")
@click.option("--prompts", type=click.IntRange(min=1), default=None,
              help="With --batch-size: distinct random prompts per run [default: 256]; with --prompts-file: its "
                   "first N rows [default: all].")
@click.option("--prompts-b1", type=click.IntRange(min=1), default=None,
              help="With --batch-size: prompts per run at batch size 1 (default: --prompts).")
@click.option("--temperature", type=float, default=None,
              help="With --batch-size: sampling temperature, ours and mlx-lm's (make_sampler) [default: 0, greedy].")
@click.option("--top-p", type=float, default=None,
              help="With --batch-size and --temperature: nucleus mass in (0, 1] [default: 1, off].")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="With --batch-size and a MODEL: real prompts, the rows of this Parquet (or .jsonl/.csv) file built "
                   "as a job builds them (chat template), EOS ending a row, at most --max-tokens new tokens each.")
@click.option("--prompt-column", default="prompt", show_default=True,
              help="With --prompts-file: the column of user text (as input.prompt_column).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every row and trial as JSON.")
def bench(model, random_shape, prompt_tokens, max_tokens, trials, caches, variants, dequantize, no_peer, batch_sizes,
          prompts, prompts_b1, temperature, top_p, prompts_file, prompt_column, json_path):
    """Decode tok/s, prefill tok/s and TTFT of MODEL (or --random SHAPE): eager vs compiled, per cache kind and
    prompt length, with mlx-lm's generate_step on the same weights in the same run. With --batch-size: job
    throughput (generated tokens / wall s) of batched decoding per batch size, greedy or sampled, random prompts
    or a prompts file, with mlx-lm's batch_generate."""
    from .bench import BenchError, BenchFailed, run_bench

    if variants is None:
        variants = "auto" if batch_sizes else "eager,compiled"
    try:
        run_bench(model, random=random_shape, prompt_tokens=prompt_tokens, max_tokens=max_tokens, trials=trials,
                  caches=[c for c in caches.split(",") if c.strip()],
                  variants=[v.strip() for v in variants.split(",") if v.strip()],
                  dequantize="auto" if dequantize is None else dequantize, peer=not no_peer, json_path=json_path,
                  echo=click.echo, progress=lambda line: click.echo(line, err=True), batch_sizes=batch_sizes,
                  prompts=prompts, prompts_b1=prompts_b1, temperature=temperature, top_p=top_p,
                  prompts_file=prompts_file, prompt_column=prompt_column)
    except BenchError as e:  # the command line's settings: exit 2, as for click's own checks
        _fail(e, 2)
    except (BenchFailed, *USER_ERRORS) as e:
        _fail(e)


def entry() -> None:
    """The ``pipeline`` console script: ``main``, and on an error exit the process ends at once after
    flushing its output (``os._exit``), skipping interpreter finalization and C++ static destructors.

    On a 2-core x86_64 Linux VM a command that had printed its error line and called ``sys.exit`` aborted
    now and then during finalization instead ("terminate called without an active exception", SIGABRT;
    seen twice in ~2,000 subprocess runs of the tests, in ``pipeline report`` and ``pipeline export``),
    so the exit status was lost although the command's work and output were complete. By the time an
    error reaches here every file is closed, the run record is saved and the output dir's lock released
    (``run_job`` exits its contexts first); a flock dies with the process anyway. A success exit
    finalizes normally (Ray's and MLX's exit handlers run)."""
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 0:
            raise
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
