"""``executor: ray``: a job's pending rows on a Ray cluster, through Ray Data.

``control.run_job`` plans as in local mode (pending samples, fingerprint, ``ShardStore``, run records), and the
driver holds the output dir's lock (``outdir.RunLock``) as a local run does, until the cluster is closed.
It connects to the cluster (``cluster.open_cluster``: ``ray.address``; Ray is imported only there, only
then) before it writes anything in the output directory; sizes the actors for the units that will run
(``Cluster.prepare``: ``actor_resources``) and checks that every node sees the output directory
(``probe_storage``) before it records the run; then hands the pending samples to ``run_units``, which

1. cuts the pending samples, in input order, into work units of ``ray.unit_rows`` and records the plan
   in the manifest (``ShardStore.plan_units``: a fresh ``unit-NNNNN.parquet`` name per unit);
2. in batched mode (``engine.batch_size`` > 1 or "auto") computes the slot capacity once, in a Ray task, from
   every prompt of the job as local mode does (``local.batch_capacity``), so the rows are the same, and
   there resolves "auto" to a number of slots (``local.auto_batch_size``) that every actor then uses;
3. runs a Ray dataset with one block per unit through ``map_batches(_UnitWorker, batch_size=1,
   compute=ActorPoolStrategy(size=actors))``: each actor loads the model once and runs a unit exactly
   as local mode runs those samples (``local.generate_samples``: same seeds, prompts and engine), then
   writes the unit's shard itself with ``shards.write_shard`` (temporary file, fsync, rename) and
   returns one small record (unit, shard entry, rows, failures, tokens, seconds, actor);
4. commits each unit (``ShardStore.commit_written``) as its record arrives: the driver is the only
   manifest writer.

Failures: a failed row is a row with ``error`` set, as in local mode, and anything else a row raises stops
the run as in local mode (``local.GenerationError``, raised again by the driver as itself). An actor that dies (a crash,
``os._exit``, a lost node) is restarted by Ray and its unit is run again, rewriting the same file; a
unit that has killed its actor ``UNIT_RETRIES`` + 1 times fails the run (its attempts are counted in
a hidden ``.unit-NNNNN.parquet.attempts.tmp`` file beside the shards, as Ray Data retries actor tasks
without limit). ``DataContext.max_errored_blocks`` is 0, so no unit is ever dropped: any other error
stops the run and is raised here. A unit shard written but not committed (the driver died
in between) is verified and adopted when the output dir is next opened (``shards.ShardStore``).

Test hook: ``PIPELINE_TEST_CRASH_UNIT=UNIT:MARKER`` (e.g. ``unit-00001.parquet:/tmp/crashed``) makes the
actor running unit UNIT exit with ``os._exit(1)`` halfway through it, once: only if it can create the
file MARKER. Every ``PIPELINE_*`` variable of the driver is passed to the actors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import time
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from ..engine import BatchEngine
from ..engine.batch import check_kv_memory
from ..jobspec import JobSpec, job_from_dict
from ..resolve import resolve_model
from ..results import result_schema, results_table
from ..shards import ShardStore, write_error, write_shard
from .cluster import Cluster, DistributedError, actor_env, unit_rows
from .local import auto_batch_size, batch_capacity, generate_samples, load_job_model

UNIT_RETRIES = 3  # runs of a unit after its actor died, before the job fails

def _load(job: JobSpec, model_path: str):
    """The model, loaded as ``run_job`` loads it (in an actor or task process): from the driver's
    ``model_path`` when this node has it (one machine, or a shared file system), else resolved here
    (an alias is downloaded into this node's ``$PIPELINE_HOME`` and checked against its sha256)."""
    return load_job_model(job, Path(model_path) if Path(model_path).exists() else resolve_model(job.model))


def _capacity(job: dict, model_path: str, planned: bytes) -> tuple[int, int | None, str | None]:
    """In a Ray task: ``(positions, slots, why)``: batched mode's slot capacity from every sample of the job
    (``local.batch_capacity``) and the slots (``engine.batch_size``, or "auto" resolved by
    ``local.auto_batch_size`` with its reason, else ``why`` None; both None when every sample fails before
    the engine), the KV memory checked on the device that runs it (``batch.check_kv_memory``)."""
    spec = job_from_dict(job)
    lm = _load(spec, model_path)
    positions = batch_capacity(lm, spec, pickle.loads(planned))
    slots, why = spec.engine.batch_size, None
    if not positions:  # every sample fails before the engine: no batch runs
        return positions, None, None
    if slots == "auto":
        slots, why = auto_batch_size(lm.engine, positions, spec.engine.max_kv_memory_gb)
    check_kv_memory(BatchEngine(lm.engine, slots, positions), spec.engine.max_kv_memory_gb)
    return positions, slots, why


def _crash_after(unit: str, rows: int) -> int | None:
    """The test hook (module docstring): after how many rows of ``unit`` this actor exits, or None."""
    spec = os.environ.get("PIPELINE_TEST_CRASH_UNIT", "")
    name, _, marker = spec.partition(":")
    if name != unit or not marker:
        return None
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    return max(1, rows // 2)


class _UnitWorker:
    """A Ray Data actor: loads the model once (at its first unit: an error raised there reaches the
    driver as itself, one raised in the constructor only as Ray's ``ActorDiedError``), then runs one
    unit per call and writes its shard.

    Args:
        job: ``JobSpec.to_dict()``.
        model_path: the model file or directory the driver resolved (see ``_load``).
        out_dir: the output directory (absolute).
        id_type: "int64" or "string", the output ``id`` column's type.
        positions: batched mode's slot capacity (``_capacity``), else None.
        batch_size: batched mode's slots (``_capacity``: "auto" resolved), else None.
    """

    def __init__(self, job: dict, model_path: str, out_dir: str, id_type: str, positions: int | None,
                 batch_size: int | None = None):
        self.job = job_from_dict(job)
        self.out_dir, self.positions, self.model_path, self.batch_size = out_dir, positions, model_path, batch_size
        self.schema = result_schema(pa.type_for_alias(id_type))
        self.lm = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.batch_closures = 0
        self.warmup_s = 0.0

    def __call__(self, batch: dict) -> dict:
        """Run the units of ``batch`` (one, with ``batch_size=1``); returns one record per unit. An
        exception is returned in the record's ``error`` column (pickled) for the driver to raise as
        itself: Ray Data would pass on only its text. A dying actor returns nothing; Ray reruns its unit."""
        out = {k: [] for k in ("unit", "entry", "failed", "tokens", "prompt_tokens", "cached_prompt_tokens", "seconds",
                               "worker", "closures", "warmup_s", "error")}
        for unit, payload in zip(batch["unit"], batch["samples"]):
            unit = str(unit)
            try:
                rec = self._run(unit, pickle.loads(payload))
                error = b""
            except Exception as e:  # noqa: BLE001 (any error stops the run, raised by the driver)
                rec = {"entry": "", "failed": 0, "tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "seconds": 0.0,
                       "closures": 0, "warmup_s": 0.0}
                error = _pickled(e)
            for k, v in {**rec, "unit": unit, "worker": self.name, "error": error}.items():
                out[k].append(v)
        return out

    def _run(self, unit: str, samples: list) -> dict:
        attempts = Path(self.out_dir) / f".{unit}.attempts.tmp"
        try:
            with open(attempts, "a") as f:
                f.write(".")
        except OSError as e:
            raise write_error(e, self.out_dir, attempts.name) or e  # an OutputWriteError pickles back to the driver
        if attempts.stat().st_size > UNIT_RETRIES + 1:
            raise DistributedError(f"unit {unit}: its actor died {UNIT_RETRIES + 1} times running it; see the "
                                   "actors' logs (ray logs, or the Ray dashboard)")
        warm_up = None
        if self.lm is None:
            self.lm = _load(self.job, self.model_path)

            def warm_up(batch):  # once per actor, on the path the job decodes on: out of the rows' statistics
                self.warmup_s = self.lm.warm_up(batch, structured=self.job.uses_structured)
        order = {(row.id, k): i for i, (row, k, _) in enumerate(samples)}
        crash_at = _crash_after(unit, len(samples))
        results = []

        def record(res):
            results.append(res)
            if crash_at is not None and len(results) >= crash_at:
                os._exit(1)

        t0 = time.perf_counter()
        closures = generate_samples(self.lm, self.job, samples, record, positions=self.positions,
                                    batch_size=self.batch_size, warm_up=warm_up)
        self.batch_closures = max(self.batch_closures, closures)
        results.sort(key=lambda r: order[r.key])
        entry = write_shard(self.out_dir, unit, results_table(results, self.schema))
        attempts.unlink(missing_ok=True)
        return {"entry": json.dumps(entry), "failed": sum(r.error is not None for r in results),
                "tokens": sum(r.completion_tokens or 0 for r in results), "seconds": time.perf_counter() - t0,
                "prompt_tokens": sum(r.prompt_tokens or 0 for r in results if r.error is None),
                "cached_prompt_tokens": sum(getattr(r, "cached_prompt_tokens", None) or 0 for r in results),
                "closures": self.lm.engine.closure_count + self.batch_closures, "warmup_s": self.warmup_s}


def _pickled(e: Exception) -> bytes:
    """``e`` pickled, or as a ``DistributedError`` with its type and text if it does not pickle."""
    try:
        data = pickle.dumps(e)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 (unpicklable: keep its type name and text)
        return pickle.dumps(DistributedError(f"{type(e).__name__}: {e}"))


def _root_cause(e: BaseException) -> BaseException:
    """The exception an actor or task raised, out of Ray's wrappers."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "cause", None) or e.__cause__
        if inner is None:
            break
        e = inner
    return e


def run_units(cluster: Cluster, job: JobSpec, store: ShardStore, model_path: Path, id_type, planned: list,
              pending: list, retry: set, summary, *, hold=contextlib.nullcontext, progress: bool = True,
              echo=print) -> None:
    """Generate ``pending`` samples on Ray and commit them unit by unit (see the module docstring),
    updating ``summary`` (a ``control.RunSummary``: rows written and failed, tokens, seconds, closures,
    per-actor ``workers``). A signal stops it through ``control._Signals`` (``Aborted``): the units
    committed are kept; units in flight are redone, or their shards adopted, by the next run. ``hold()``
    (``control._Signals.holding``) wraps each unit's commit and counting, so a stop falls before or after
    both, never between.

    Args:
        cluster: the connected cluster (``open_cluster``), after ``Cluster.prepare`` for ``pending``.
        job, store, model_path, id_type: the job, its open output dir, its resolved model and the output
            ``id`` type, as ``run_job`` has them.
        planned: every sample of the job (batched mode sizes its slots from all of them).
        pending: the samples to generate, in input order.
        retry: keys of committed failed rows to replace (``--retry-failed``).

    Raises:
        DistributedError: a failed run on the cluster.
        GenerationError: a row raised something that is not a ``RowError`` in an actor (``local.GenerationError``).
        JobSpecError, TokenizerError, ...: what an actor or task raised (model load, KV memory refused).
    """
    ray, res = cluster.ray, cluster.resources
    bar = None
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.max_errored_blocks = 0
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
        out_dir = store.dir.resolve()
        size = unit_rows(job)
        units = [pending[i:i + size] for i in range(0, len(pending), size)]
        names = store.plan_units([[(row.id, k) for row, k, _ in u] for u in units], size)
        keys = {n: {(row.id, k) for row, k, _ in u} for n, u in zip(names, units)}
        actors = min(res.actors, len(units))  # res is sized for the units (Cluster.prepare): equal
        echo(f"ray: {len(units)} unit(s) of up to {size} rows on {actors} actor(s) "
             f"({res.num_cpus:g} CPU, {res.num_gpus:g} GPU, {res.threads} thread(s) each)")
        remote = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "runtime_env": {"env_vars": actor_env(res)}}
        job_dict = job.to_dict()
        t0 = time.perf_counter()
        positions, slots = None, 1
        if job.engine.batch_size != 1:
            task = ray.remote(_capacity).options(max_retries=UNIT_RETRIES, **remote)
            positions, slots, why = ray.get(task.remote(job_dict, str(model_path), pickle.dumps(planned)))
            if why is not None:
                echo(f"engine.batch_size auto: {slots} ({why})")
        if slots is not None:
            summary.batch_size = slots
            store.update_run(batch_size=slots)
        ds = ray.data.from_items([{"unit": n, "samples": pickle.dumps(u)} for n, u in zip(names, units)],
                                 override_num_blocks=len(units))
        ds = ds.map_batches(
            _UnitWorker, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
            fn_constructor_kwargs={"job": job_dict, "model_path": str(model_path), "out_dir": str(out_dir),
                                   "id_type": str(id_type), "positions": positions,
                                   "batch_size": None if positions is None else slots},
            **remote)

        bar = tqdm(total=summary.rows_total, initial=summary.rows_skipped, unit="row", desc="generating",
                   disable=not progress, dynamic_ncols=True)
        records = iter(ds.iter_rows())
        try:
            for rec in records:
                if rec["error"]:
                    raise pickle.loads(rec["error"])
                unit = rec["unit"]
                entry = json.loads(rec["entry"])
                with hold():
                    store.commit_written(entry, replaces=keys[unit] & retry)
                    summary.rows_written += entry["rows"]
                    summary.rows_failed += int(rec["failed"])
                    summary.completion_tokens += int(rec["tokens"])
                    summary.prompt_tokens += int(rec["prompt_tokens"])
                    summary.cached_prompt_tokens += int(rec["cached_prompt_tokens"])
                    w = summary.workers.setdefault(rec["worker"],
                                                   {"units": 0, "rows": 0, "tokens": 0, "seconds": 0.0})
                    w.update(units=w["units"] + 1, rows=w["rows"] + entry["rows"],
                             tokens=w["tokens"] + int(rec["tokens"]), seconds=w["seconds"] + float(rec["seconds"]),
                             closures=int(rec["closures"]), warmup_s=max(w.get("warmup_s", 0.0), float(rec["warmup_s"])))
                bar.set_postfix_str(_rates(summary, time.perf_counter() - t0), refresh=False)
                bar.update(entry["rows"])
        finally:
            getattr(records, "close", lambda: None)()
            summary.elapsed_s = time.perf_counter() - t0
        summary.closures = sum(w.get("closures", 0) for w in summary.workers.values())
    except Exception as e:
        cause = _root_cause(e)
        if cause is not e and not isinstance(cause, ray.exceptions.RayError):
            raise cause from None
        if isinstance(e, ray.exceptions.RayError):
            raise DistributedError(f"the run failed on Ray: {' '.join(str(e).split())[:500]}") from None
        raise
    finally:
        if bar is not None:
            bar.close()


def _rates(summary, elapsed: float) -> str:
    """Progress-bar postfix: resumed rows, tokens/s of the whole run, tokens/s of each actor's units."""
    resumed = f"{summary.rows_skipped} resumed, " if summary.rows_skipped else ""
    each = ", ".join(f"{w['tokens'] / w['seconds']:.1f}" for w in summary.workers.values() if w["seconds"] > 0)
    return (f"{resumed}{summary.completion_tokens / max(elapsed, 1e-9):.1f} tok/s; "
            f"{len(summary.workers)} actor(s): {each} tok/s")
