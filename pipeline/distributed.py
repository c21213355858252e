"""``executor: ray``: a job's pending rows on a Ray cluster, through Ray Data.

``runner.run_job`` plans as in local mode (pending samples, fingerprint, ``ShardStore``, run records), and the
driver holds the output dir's lock (``outdir.RunLock``) as a local run does, until the cluster is closed.
It connects to the cluster (``open_cluster``: ``ray.address``; Ray is imported only here, only then)
before it writes anything in the output directory; sizes the actors for the units that will run
(``Cluster.prepare``: ``actor_resources``) and checks that every node sees the output directory
(``probe_storage``) before it records the run; then hands the pending samples to ``run_units``, which

1. cuts the pending samples, in input order, into work units of ``ray.unit_rows`` and records the plan
   in the manifest (``ShardStore.plan_units``: a fresh ``unit-NNNNN.parquet`` name per unit);
2. in batched mode (``engine.batch_size`` > 1) computes the slot capacity once, in a Ray task, from
   every prompt of the job as local mode does (``runner.batch_capacity``), so the rows are the same;
3. runs a Ray dataset with one block per unit through ``map_batches(_UnitWorker, batch_size=1,
   compute=ActorPoolStrategy(size=actors))``: each actor loads the model once and runs a unit exactly
   as local mode runs those samples (``runner.generate_samples``: same seeds, prompts and engine), then
   writes the unit's shard itself with ``shards.write_shard`` (temporary file, fsync, rename) and
   returns one small record (unit, shard entry, rows, failures, tokens, seconds, actor);
4. commits each unit (``ShardStore.commit_written``) as its record arrives: the driver is the only
   manifest writer.

Failures: a failed row is a row with ``error`` set, as in local mode. An actor that dies (a crash,
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
import math
import os
import pickle
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .jobspec import JobSpec, JobSpecError, RaySpec
from .shards import OutputError, ShardStore, disk_full, write_shard

UNIT_RETRIES = 3  # runs of a unit after its actor died, before the job fails
CPU_SHARE = 0.75  # of the cluster's CPUs reserved for CPU actors by default; the rest for Ray Data's tasks
CONNECT_TIMEOUT_S = 5.0  # the plain TCP check of an explicit cluster address, before ray.init


class DistributedError(RuntimeError):
    """Ray is missing or unreachable, the cluster cannot run the actors, or the run failed on it."""


class ResourceError(JobSpecError, DistributedError):
    """The job's ``ray`` settings ask for more CPUs or GPUs than the cluster has: a problem with the job
    (``JobSpecError``: the CLI exits 2), found before any work."""


def install_hint() -> str:
    """How to install Ray Data for this project: the ``ray`` extra of its checkout (the PyPI package
    named ``pipeline`` is another project)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return f'pip install -e "{root}[ray]" (the ray extra of this checkout)'
    return 'pip install -e ".[ray]" in the pipeline checkout (its ray extra; PyPI\'s "pipeline" is another project)'


def import_ray():
    """``ray`` with Ray Data, imported on first use.

    Raises:
        DistributedError: Ray Data is not installed (one line saying how to install it).
    """
    try:
        import ray
        import ray.data
    except ImportError:
        raise DistributedError(f"executor: ray needs Ray Data: {install_hint()}") from None
    return ray


@dataclass
class Resources:
    """What each actor gets: ``num_cpus`` and ``num_gpus`` reserved in Ray, ``threads`` for its BLAS /
    OpenMP thread pools (Ray would otherwise pin them to 1 for fractional CPUs)."""

    actors: int
    num_cpus: float
    num_gpus: float
    threads: int


def actor_resources(spec: RaySpec, cluster: dict, units: int | None = None) -> Resources:
    """Actor count and per-actor resources from the job's ``ray`` section and ``cluster``
    (``ray.cluster_resources()``: ``{"CPU": n, "GPU": n, ...}``); see ``RaySpec`` for the defaults.
    Given ``units`` (the work units to run), no more actors than units, and the CPUs and threads not
    set in the job are sized for the actors that run.

    CPU actors get fractional CPUs by default (3/4 of the cluster's shared among them) so that Ray
    Data's own tasks are never starved of a CPU, and the cluster's CPUs divided among the actors as
    threads.

    Raises:
        ResourceError: the actors need more CPUs or GPUs than the cluster has (Ray would wait forever).
    """
    cpus, gpus = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    num_gpus = spec.num_gpus if spec.num_gpus is not None else (1.0 if gpus >= 1 else 0.0)
    if spec.actors is not None:
        actors = spec.actors
    elif num_gpus > 0:
        actors = max(1, int(gpus // num_gpus))
    else:
        actors = max(1, int(cpus))
    if units is not None:
        actors = max(1, min(actors, units))
    if spec.num_cpus is not None:
        num_cpus = spec.num_cpus
    else:
        num_cpus = 1.0 if num_gpus > 0 else round(CPU_SHARE * cpus / actors, 3)
    threads = max(1, math.ceil(num_cpus)) if num_gpus > 0 else max(1, int(cpus // actors))
    for what, each, have in (("CPU", num_cpus, cpus), ("GPU", num_gpus, gpus)):
        if actors * each > have + 1e-9:
            raise ResourceError(f"ray: {actors} actor(s) x {each:g} {what} need {actors * each:g} {what}(s), the "
                                f"cluster has {have:g}; lower ray.actors or ray.num_{what.lower()}s")
    if num_cpus <= 0:
        raise ResourceError("ray: the cluster has no CPUs for the actors; set ray.num_cpus")
    return Resources(actors, num_cpus, num_gpus, threads)


def gcs_endpoint(address: str | None) -> tuple[str, int] | None:
    """``(host, port)`` that ``ray.init(address=...)`` connects to by address: ``address`` itself
    (``HOST:PORT`` or ``ray://HOST:PORT``), or ``$RAY_ADDRESS`` for None and "auto"; None without such an
    address (a cluster Ray finds on this machine or starts) or without a port."""
    if address in (None, "auto"):
        address = os.environ.get("RAY_ADDRESS") or None
    if address is None or address in ("auto", "local"):
        return None
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str | None, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail at once when nothing accepts TCP connections at the cluster's address (``gcs_endpoint``):
    ``ray.init`` would retry for many minutes.

    Raises:
        DistributedError: naming ``ray.address`` / ``--ray`` and the address.
    """
    end = gcs_endpoint(address)
    if end is None:
        return
    host, port = end
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise DistributedError(f"ray.address / --ray {address!r}: nothing accepts connections at {host}:{port} "
                               f"({why}); start the cluster there (ray start --head) or fix the address") from None


def connect(ray, address: str | None) -> bool:
    """Connect to the cluster at ``address`` (``RaySpec.address``) unless Ray is initialized already.
    Returns whether this call connected (the caller then shuts Ray down). The SIGINT and SIGTERM
    handlers are those of before: ``ray.init`` installs its own (SIGTERM: exit 15 and a crash dump of
    its core worker), which would bypass ``runner._Signals``.

    Raises:
        DistributedError: nothing at ``address`` (``check_reachable``), or ``ray.init`` could not connect.
    """
    if ray.is_initialized():
        return False
    check_reachable(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    handlers = _handlers()
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=True)
    except ConnectionError as e:
        if gcs_endpoint(address) is None:
            hint = "start one with `ray start --head`, or use --ray local (ray.address: local) to start one for this run"
        else:  # the TCP check passed: something listens there
            hint = ("the address accepts connections: a cluster with token authentication (Ray 2.60's default) "
                    "also needs RAY_AUTH_MODE=token in the driver's environment")
        raise DistributedError(f"ray.address {address!r}: cannot connect to a Ray cluster ({e}); {hint}") from None
    finally:
        _restore(handlers)
    return True


def _handlers() -> dict:
    """The SIGINT and SIGTERM handlers now (none outside the main thread, where they cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict) -> None:
    """Install ``handlers`` (``_handlers``) again, also where Ray replaced them below Python."""
    for s, h in handlers.items():
        signal.signal(s, signal.SIG_DFL if h is None else h)


class Cluster:
    """The Ray cluster of one ``runner.run_job`` (``open_cluster``); a context manager that shuts down
    a cluster this run connected to, keeping the signal handlers.

    Attributes:
        ray: the ``ray`` module.
        started: this run connected (``connect``); False when Ray was initialized already.
        resources: the actors' resources, once ``prepare`` has run.
    """

    def __init__(self, ray, started: bool):
        self.ray, self.started, self.resources = ray, started, None

    def prepare(self, job: JobSpec, out_dir: Path, pending: int) -> Resources:
        """Size the actors for the units of ``pending`` samples (``actor_resources``) and check that
        every node sees ``out_dir`` (``probe_storage``): before the run is recorded.

        Raises:
            ResourceError: the actors need more CPUs or GPUs than the cluster has.
            OutputError: a node does not see ``out_dir``.
        """
        units = math.ceil(pending / unit_rows(job))
        self.resources = actor_resources(job.ray, self.ray.cluster_resources(), units)
        probe_storage(self.ray, out_dir.resolve())
        return self.resources

    def close(self) -> None:
        if self.started:
            handlers = _handlers()
            self.ray.shutdown()
            _restore(handlers)
            self.started = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_cluster(address: str | None) -> Cluster:
    """Import Ray and connect to the cluster at ``address`` (``connect``).

    Raises:
        DistributedError: Ray Data missing, nothing at ``address``, or ``ray.init`` could not connect.
    """
    ray = import_ray()
    return Cluster(ray, connect(ray, address))


def unit_rows(job: JobSpec) -> int:
    """Output rows per work unit: ``ray.unit_rows``, else ``output.shard_size``."""
    return job.ray.unit_rows or job.output.shard_size


def _probe(out_dir: str, token: str, node: int) -> tuple[str, bool]:
    """On node number ``node``: whether it sees the driver's probe file; leaves one of its own for the
    driver to find."""
    d = Path(out_dir)
    try:
        saw = (d / f".probe-{token}.tmp").read_text() == token
        (d / f".probe-{token}-{node}.tmp").write_text(token)
    except OSError:
        saw = False
    return socket.gethostname(), saw


def probe_storage(ray, out_dir: Path) -> None:
    """Check that every node that can run actors (CPUs or GPUs) sees ``out_dir`` at the same path and
    can write to it: a probe task pinned to each node reads a file the driver wrote there and writes
    one back, which the driver then reads. The probe files are removed.

    Raises:
        OutputError: a node that does not share the directory (named by address and host name).
        DiskFullError: no space for the driver's probe file.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    mark = out_dir / f".probe-{token}.tmp"
    try:
        mark.write_text(token)
    except OSError as e:
        raise disk_full(e, out_dir, mark.name) or e
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive") and
                 (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)]
        probe = ray.remote(_probe)
        refs = [probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(out_dir), token, i) for i, n in enumerate(nodes)]
        answers = ray.get(refs, timeout=120)
        for i, (node, (host, saw)) in enumerate(zip(nodes, answers)):
            if not saw or not (out_dir / f".probe-{token}-{i}.tmp").is_file():
                raise OutputError(
                    f"output.dir {str(out_dir)!r} is not shared with Ray node {node['NodeManagerAddress']} ({host}): "
                    "every node must see it at the same path (NFS or another shared mount)")
    finally:
        for p in out_dir.glob(f".probe-{token}*.tmp"):
            p.unlink(missing_ok=True)


def actor_env(res: Resources) -> dict[str, str]:
    """Environment of the actors: the driver's ``PIPELINE_*`` variables, thread counts, and for CPU
    actors no visible CUDA device (so that a CPU actor on a GPU node cannot take GPU 0)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIPELINE_")}
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(res.threads)
    if res.num_gpus == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _load(job: JobSpec, model_path: str):
    """The model, loaded as ``run_job`` loads it (in an actor or task process): from the driver's
    ``model_path`` when this node has it (one machine, or a shared file system), else resolved here
    (an alias is downloaded into this node's ``$PIPELINE_HOME`` and checked against its sha256)."""
    from .resolve import resolve_model
    from .runner import load_job_model

    return load_job_model(job, Path(model_path) if Path(model_path).exists() else resolve_model(job.model))


def _capacity(job: dict, model_path: str, planned: bytes) -> int:
    """In a Ray task: batched mode's slot capacity from every sample of the job, with the KV memory
    checked on the device that runs it (``runner.batch_capacity``, ``batch.check_kv_memory``)."""
    from .engine.batch import BatchEngine, check_kv_memory
    from .jobspec import job_from_dict
    from .runner import batch_capacity

    spec = job_from_dict(job)
    lm = _load(spec, model_path)
    positions = batch_capacity(lm, spec, pickle.loads(planned))
    if positions:
        check_kv_memory(BatchEngine(lm.engine, spec.engine.batch_size, positions), spec.engine.max_kv_memory_gb)
    return positions


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
    """

    def __init__(self, job: dict, model_path: str, out_dir: str, id_type: str, positions: int | None):
        import pyarrow as pa

        from .jobspec import job_from_dict
        from .results import result_schema

        self.job = job_from_dict(job)
        self.out_dir, self.positions, self.model_path = out_dir, positions, model_path
        self.schema = result_schema(pa.type_for_alias(id_type))
        self.lm = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.batch_closures = 0
        self.warmup_s = 0.0

    def __call__(self, batch: dict) -> dict:
        """Run the units of ``batch`` (one, with ``batch_size=1``); returns one record per unit. An
        exception is returned in the record's ``error`` column (pickled) for the driver to raise as
        itself: Ray Data would pass on only its text. A dying actor returns nothing; Ray reruns its unit."""
        out = {k: [] for k in ("unit", "entry", "failed", "tokens", "seconds", "worker", "closures", "warmup_s",
                               "error")}
        for unit, payload in zip(batch["unit"], batch["samples"]):
            unit = str(unit)
            try:
                rec = self._run(unit, pickle.loads(payload))
                error = b""
            except Exception as e:  # noqa: BLE001 (any error stops the run, raised by the driver)
                rec = {"entry": "", "failed": 0, "tokens": 0, "seconds": 0.0, "closures": 0, "warmup_s": 0.0}
                error = _pickled(e)
            for k, v in {**rec, "unit": unit, "worker": self.name, "error": error}.items():
                out[k].append(v)
        return out

    def _run(self, unit: str, samples: list) -> dict:
        from .results import results_table
        from .runner import generate_samples

        attempts = Path(self.out_dir) / f".{unit}.attempts.tmp"
        try:
            with open(attempts, "a") as f:
                f.write(".")
        except OSError as e:
            raise disk_full(e, self.out_dir, attempts.name) or e  # a DiskFullError pickles back to the driver
        if attempts.stat().st_size > UNIT_RETRIES + 1:
            raise DistributedError(f"unit {unit}: its actor died {UNIT_RETRIES + 1} times running it; see the "
                                   "actors' logs (ray logs, or the Ray dashboard)")
        if self.lm is None:
            self.lm = _load(self.job, self.model_path)
            self.warmup_s = self.lm.warm_up()  # kernel compilation stays out of the rows' statistics
        order = {(row.id, k): i for i, (row, k, _) in enumerate(samples)}
        crash_at = _crash_after(unit, len(samples))
        results = []

        def record(res):
            results.append(res)
            if crash_at is not None and len(results) >= crash_at:
                os._exit(1)

        t0 = time.perf_counter()
        closures = generate_samples(self.lm, self.job, samples, record, positions=self.positions)
        self.batch_closures = max(self.batch_closures, closures)
        results.sort(key=lambda r: order[(r.id, r.sample_index)])
        entry = write_shard(self.out_dir, unit, results_table(results, self.schema))
        attempts.unlink(missing_ok=True)
        return {"entry": json.dumps(entry), "failed": sum(r.error is not None for r in results),
                "tokens": sum(r.completion_tokens or 0 for r in results), "seconds": time.perf_counter() - t0,
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
    updating ``summary`` (a ``runner.RunSummary``: rows written and failed, tokens, seconds, closures,
    per-actor ``workers``). A signal stops it through ``runner._Signals`` (``Aborted``): the units
    committed are kept; units in flight are redone, or their shards adopted, by the next run. ``hold()``
    (``runner._Signals.holding``) wraps each unit's commit and counting, so a stop falls before or after
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
        positions = None
        if job.engine.batch_size > 1:
            task = ray.remote(_capacity).options(max_retries=UNIT_RETRIES, **remote)
            positions = ray.get(task.remote(job_dict, str(model_path), pickle.dumps(planned)))
        ds = ray.data.from_items([{"unit": n, "samples": pickle.dumps(u)} for n, u in zip(names, units)],
                                 override_num_blocks=len(units))
        ds = ds.map_batches(
            _UnitWorker, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
            fn_constructor_kwargs={"job": job_dict, "model_path": str(model_path), "out_dir": str(out_dir),
                                   "id_type": str(id_type), "positions": positions},
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
