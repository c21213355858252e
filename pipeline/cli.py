"""Command line: ``pipeline run JOB``, ``validate JOB``, ``convert SRC DST``, ``inspect MODEL``. Each command parses
and calls a plain function."""

from __future__ import annotations

import sys

import click

from .chat_template import ChatTemplateError
from .gguf import GGUFError
from .inputs import InputError, read_rows
from .modeldir import ModelDirError
from .jobspec import JobSpecError, load_job
from .loader import WeightsError
from .models.base import ConfigError
from .resolve import ModelResolveError
from .shards import OutputError
from .tokenizer import TokenizerError

USER_ERRORS = (JobSpecError, InputError, OutputError, ModelResolveError, GGUFError, ModelDirError, TokenizerError,
               ConfigError, ChatTemplateError, WeightsError)
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


def _fail(e: Exception):
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


@click.group()
@click.version_option(package_name="pipeline")
def main():
    """Batch offline text generation on MLX."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--output-dir", help="Write here instead of the job's output.dir.")
@click.option("--limit", type=click.IntRange(min=1), help="Use only the first N input rows.")
@click.option("--force", is_flag=True, help="Resume even if the job's settings or model changed.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def run(job_file, output_dir, limit, force, no_progress):
    """Run JOB_FILE, or resume it where an earlier run stopped."""
    from .runner import run_job

    try:
        job = load_job(job_file)
        summary = run_job(job, output_dir=output_dir, limit=limit, force=force, progress=not no_progress,
                          echo=click.echo)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(summary.line())
    if summary.interrupted:
        sys.exit(EXIT_CODES[summary.interrupted])


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
def validate(job_file):
    """Check JOB_FILE and its input without loading the model."""
    try:
        job = load_job(job_file)
        rows, _ = read_rows(job.input)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(f"ok: {job_file}: {len(rows)} input rows, model {job.model}, output {job.output.dir}")


@main.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
def convert(src, dst, overwrite):
    """Write the GGUF llama model SRC as an MLX model directory DST."""
    from .convert import convert_gguf

    try:
        out = convert_gguf(src, dst, overwrite=overwrite)
    except (FileExistsError, *USER_ERRORS) as e:
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
        d = describe_model(model)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(json.dumps(d, indent=2, ensure_ascii=False) if as_json else format_description(d))
