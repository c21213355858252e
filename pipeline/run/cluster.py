"""The Ray cluster of an ``executor: ray`` run: importing Ray, connecting, sizing the actors, checking shared storage."""

from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from ..jobspec import JobSpec, JobSpecError, RaySpec, host_port
from ..shards import OutputError, disk_full

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
    root = Path(__file__).resolve().parents[2]
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
    return host_port(address)


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
    its core worker), which would bypass ``control._Signals``.

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
    """The Ray cluster of one ``control.run_job`` (``open_cluster``); a context manager that shuts down
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
