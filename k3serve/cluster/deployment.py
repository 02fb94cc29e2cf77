"""Bring a whole deployment up and down: Ray, Redis, the checkpoint, clusters, routers.

Used by ``k3serve serve``, ``k3serve drill`` and the end-to-end tests. With no ``RAY_ADDRESS`` it starts a
local Ray instance; with no Redis URL (deploy file or ``REDIS_URL``) it starts a private redis-server; with no
checkpoint in the deploy file it makes one from the preset (on a shared path when Ray spans several nodes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import psutil  # Ray's own copy (ray/thirdparty_files, which `import ray` puts on sys.path)

from k3serve.cluster.deploy import DeployConfig, DeployError
from k3serve.cluster.nodes import LostNode

log = logging.getLogger(__name__)

# Ray's wait for its GCS server's port file (its own default 30 s; 120 s with its RocksDB backend), raised for
# local starts on small loaded machines (Deployment._start_local_ray)
GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
GCS_PORT_WAIT_S = 120
# the two start timeouts a local start is retried on (Ray 2.60, ray/_private/node.py): the raylet did not register
# with the GCS within Ray's fixed 30 s (a plain Exception), and the GCS did not write its port file in time (a
# RuntimeError from ray._raylet.wait_for_persisted_port)
_RAYLET_TIMEOUT = "timed out during startup"
_GCS_PORT_TIMEOUT = ("Timed out waiting for file", "gcs_server_port")
# how long the processes a failed start left get after SIGTERM, and then after SIGKILL
LEFTOVER_STOP_S = 10.0


# Ray turns a node address of 127.0.0.1 into this machine's outbound address (services.resolve_ip_for_localhost)
# and then listens on every interface, unless "clusters" are off: then its node address, every gRPC server and
# its agents stay on loopback (Ray 2.60). Its processes read the variable at import; this one read it already.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def _ray_on_loopback(on: bool):
    """While the block runs: Ray's processes started with ``RAY_LOOPBACK_ENV=0``, and this process's already
    imported copy of the flag off (unless the operator set the variable)."""
    from ray._private import ray_constants

    if not on or RAY_LOOPBACK_ENV in os.environ:
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with _env(RAY_LOOPBACK_ENV, "0"):
            yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``name`` = ``value`` in this process's environment while the block runs, unless the operator set it (then
    untouched) or value is None; removed again afterwards."""
    if value is None or name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _gcs_port_wait():
    """``GCS_PORT_WAIT_ENV`` = ``GCS_PORT_WAIT_S`` while the block runs, unless the operator set it."""
    return _env(GCS_PORT_WAIT_ENV, str(GCS_PORT_WAIT_S))


@dataclass
class Deployment:
    deploy: DeployConfig
    workdir: str = ""
    checkpoint: str = ""
    redis_url: str = field(default="", repr=False)  # holds the private server's password
    cluster_endpoints: dict[str, str] = field(default_factory=dict)
    router_addresses: list[str] = field(default_factory=list)
    http_addresses: list[str] = field(default_factory=list)  # the routers' OpenAI-compatible HTTP doors
    clusters: dict[str, object] = field(default_factory=dict)  # cluster id -> ClusterActor handle
    routers: list[object] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)  # cluster id -> ClusterActors started to replace it
    _redis: object = None
    _own_ray: bool = False
    _tmp: object = None
    _uid: str = field(default_factory=lambda: secrets.token_hex(4))  # names this deployment's placement groups
    _stopping: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None
    _stopped: bool = False
    # called right after Ray is initialised (ray.init installs its own SIGTERM handler; `serve` puts back its own)
    on_ray_ready: Callable[[], None] | None = None

    # ------------------------------------------------------------------------------------------- start
    def start(self, timeout_s: float = 300.0) -> "Deployment":
        from k3serve.cluster.router_actor import RouterActor

        self.deploy = self.deploy.with_secret()
        if not self.workdir:
            self._tmp = tempfile.TemporaryDirectory(prefix="k3serve-deploy-")
            self.workdir = self._tmp.name
        self._prepare_planes()
        self._start_ray()
        if self.on_ray_ready is not None:
            self.on_ray_ready()
        self._start_redis()
        self.checkpoint = self._checkpoint()
        handles = {cid: self._new_cluster(cid) for cid in self.deploy.clusters.cluster_ids}
        builds = [h.start.remote() for h in handles.values()]
        router = RouterActor.options(resources=dict(self.deploy.router_resources)) \
            if self.deploy.router_resources else RouterActor
        # the routers' processes start while the clusters build; they serve once every cluster is up
        self.routers = [router.remote(self.deploy, self.checkpoint, self.redis_url, i)
                        for i in range(self.deploy.routers)]
        endpoints = ray.get(builds, timeout=timeout_s)
        self.clusters = handles
        self.cluster_endpoints = dict(zip(handles, endpoints))
        self.router_addresses = ray.get([r.start.remote() for r in self.routers], timeout=timeout_s)
        self.http_addresses = ray.get([r.http_endpoint.remote() for r in self.routers], timeout=timeout_s)
        self.wait_healthy(len(handles), timeout_s=30.0)
        if self.deploy.clusters.rebuild:
            self._supervisor = threading.Thread(target=self._supervise, name="k3serve-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _prepare_planes(self) -> None:
        """Fail before anything starts when a Mooncake cluster's engine cannot be kept on its host here (its
        bind() library is built now, on this node, for the clusters that run here too)."""
        if any(self.deploy.for_cluster(cid).clusters.transfer == "mooncake"
               for cid in self.deploy.clusters.cluster_ids) and not self.deploy.clusters.mooncake.listen_any:
            from k3serve.transfer.mooncake.listeners import ListenerError, build_shim

            try:
                build_shim()
            except ListenerError as e:
                raise DeployError(f"clusters.mooncake: {e}") from None

    def _pg_name(self, cluster_id: str) -> str:
        return f"k3serve-{self._uid}-{cluster_id}"

    def _new_cluster(self, cluster_id: str):
        """A ClusterActor for this id, on the node its placement's `front` resources name (cluster/placement.py),
        running with its own transfer plane if its placement entry names one."""
        from k3serve.cluster.actors import ClusterActor

        front = self.deploy.clusters.placement_of(cluster_id).front
        actor = ClusterActor.options(resources=dict(front)) if front else ClusterActor
        return actor.remote(cluster_id, self.deploy.for_cluster(cluster_id), self.checkpoint, self.redis_url,
                            self._pg_name(cluster_id))

    def cluster_nodes(self) -> dict[str, dict]:
        """Ray node ids per cluster: {cluster id: {"front": id, "prefill": [ids], "decode": [ids]}} (a cluster
        that does not answer maps to {})."""
        out = {}
        for cid, h in list(self.clusters.items()):
            try:
                out[cid] = ray.get(h.nodes.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("nodes of cluster %s: %s", cid, str(e).splitlines()[0] if str(e) else type(e).__name__)
                out[cid] = {}
        return out

    def _supervise(self) -> None:
        """Replace a ClusterActor that died (killed, its node lost) with a new one under the same cluster id.

        A broken *rank* is the ClusterActor's own business (it rebuilds in place); this covers the actor itself.
        Its rank actors died with it (Ray fate-shares owned actors); its placement group outlives it (groups
        are scoped to the job), so it is found by name and removed before the new actor makes its own."""
        from ray.util import get_placement_group
        from ray.util.placement_group import remove_placement_group

        watches = {cid: h.watch.remote() for cid, h in self.clusters.items()}
        delay: dict[str, float] = {}
        while not self._stopping.wait(1.0):
            ready, _ = ray.wait(list(watches.values()), num_returns=len(watches), timeout=0)
            for cid in [c for c, ref in watches.items() if ref in ready]:
                if self._stopping.is_set():
                    return
                try:
                    remove_placement_group(get_placement_group(self._pg_name(cid)))
                except ValueError:  # no such group (it never got that far)
                    pass
                handle = self._new_cluster(cid)
                try:
                    endpoint = self._wait_started(handle.start.remote(), timeout_s=300)
                    if endpoint is None:
                        ray.kill(handle, no_restart=True)
                        return
                except Exception as e:  # noqa: BLE001 - no resources yet, ...: keep the dead ref, try again later
                    log.warning("restarting cluster %s failed: %s", cid, e)
                    ray.kill(handle, no_restart=True)
                    delay[cid] = min(2 * delay.get(cid, 1.0), 30.0)
                    self._stopping.wait(delay[cid])
                    continue
                self.clusters[cid], self.cluster_endpoints[cid] = handle, endpoint
                self.restarts[cid] = self.restarts.get(cid, 0) + 1
                watches[cid] = handle.watch.remote()
                delay.pop(cid, None)
                log.warning("cluster %s restarted (%d): %s", cid, self.restarts[cid], endpoint)

    def _wait_started(self, ref, timeout_s: float) -> str | None:
        """ray.get(ref), in steps so that a stop is not held up by a cluster that cannot be placed (its node
        lost): None when stopping; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self._stopping.is_set():
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                return ray.get(ref)
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster did not start within {timeout_s:.0f} s")
        return None

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        env = {"env_vars": {"OMP_NUM_THREADS": str(self.deploy.torch_threads), "TOKENIZERS_PARALLELISM": "false"}}
        if os.environ.get("K3SERVE_TEST_MUTATION"):  # the tests' fault hook reaches every worker (engine/mutation.py)
            env["env_vars"]["K3SERVE_TEST_MUTATION"] = os.environ["K3SERVE_TEST_MUTATION"]
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=False)
        else:
            self._start_local_ray(env)
            self._own_ray = True

    def _start_local_ray(self, env: dict, attempts: int = 3) -> None:
        """Start a private local Ray instance, kept on loopback (rank rendezvous and gRPC never leave this
        machine). Ray waits a fixed 30 s for its raylet to register and then raises a bare Exception; on a
        loaded 2-core machine that wait is sometimes too short, so a start that timed out is stopped and
        tried again (the other start errors are raised at once).

        Ray also waits 30 s (by default) for its GCS server to write its port file; that wait is lengthened to
        ``GCS_PORT_WAIT_S`` unless the operator set ``RAY_gcs_server_port_wait_time_s`` (seen in the test suite
        on a loaded 2-core machine: a GCS that needed over 30 s failed every test of the package's deployment).
        Ray reads that wait from the driver's environment inside ``ray.init``, so it is set for the call only.
        A first start whose GCS misses even that wait is raised; a retried one's is retried, since it started
        right after a start that had timed out, on a machine that was just as loaded (seen in the suite: start
        1 of 3 timed out, then start 2's GCS missed the 120 s).

        Both timeouts are raised from inside the constructor of Ray's ``Node``, before ``ray.init`` records
        the node, so ``ray.shutdown()`` does not stop what it had started: the GCS server, raylet, monitors
        and agents run on (until this process exits) and load the machine under the next start. So after
        any failed start the processes it started (this process's new children and all below them) are
        stopped and waited for."""
        for attempt in range(1, attempts + 1):
            before = _children()
            try:
                with _gcs_port_wait(), _ray_on_loopback(self.deploy.bind_host in _LOOPBACK_HOSTS):
                    ray.init(num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False, log_to_driver=False,
                             runtime_env=env, _node_ip_address="127.0.0.1")
                return
            except Exception as exc:  # the raylet timeout is a plain Exception
                retry = attempt < attempts and _retryable_start_error(exc, attempt)
                if retry:
                    log.warning("local Ray start %d of %d timed out (%s); stopping it and starting again", attempt,
                                attempts, str(exc).splitlines()[0])
                ray.shutdown()
                _stop_started_since(before)
                if not retry:
                    raise

    def _start_redis(self) -> None:
        url = self.deploy.control.redis_url or os.environ.get("REDIS_URL", "")
        if url:
            self.redis_url = url
            return
        from k3serve.cluster.redis_server import RedisServer

        self._redis = RedisServer()
        self.redis_url = self._redis.start(Path(self.workdir) / "redis")

    def _checkpoint(self) -> str:
        if self.deploy.model.checkpoint:
            return self.deploy.model.checkpoint
        from k3serve.model.presets import write_preset_checkpoint

        out = Path(self.workdir) / f"ckpt-{self.deploy.model.preset}"
        return str(write_preset_checkpoint(self.deploy.model.preset, out, seed=self.deploy.model.seed))

    def wait_healthy(self, n: int, timeout_s: float) -> None:
        from k3serve.cluster.redis_server import connect
        from k3serve.router.membership import Membership

        members = Membership(connect(self.redis_url), self.deploy.control.namespace, self.deploy.secret)
        deadline = time.monotonic() + timeout_s
        while len(members.healthy_clusters()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(members.healthy_clusters())} of {n} clusters registered")
            time.sleep(0.1)

    # -------------------------------------------------------------------------------------------- faults
    def kill_cluster(self, cluster_id: str) -> None:
        ray.kill(self.clusters[cluster_id], no_restart=True)

    def kill_rank(self, cluster_id: str, role: str, rank: int = 0) -> None:
        actors = ray.get(self.clusters[cluster_id].rank_actors.remote())
        ray.kill(actors[role][rank], no_restart=True)

    def kill_node(self, spec: str) -> "LostNode":
        """Kill every Ray process of one node (its raylet and workers) and wait until Ray declares it dead; `spec`
        is a custom resource only that node has, or a node id (prefix). See cluster/nodes.py."""
        from k3serve.cluster.nodes import kill_node

        return kill_node(spec, self.cluster_nodes())

    def kill_router(self, index: int) -> None:
        ray.kill(self.routers[index], no_restart=True)

    def pause_redis(self) -> None:
        """Kill the private redis-server (the `redis` drill); resume_redis brings an empty one back at the same URL."""
        if self._redis is None:
            raise RuntimeError("the redis drill needs the private redis-server (no REDIS_URL)")
        self._redis.pause()

    def resume_redis(self) -> None:
        # empty state on purpose: heartbeats re-register the clusters and HRW recomputes the same pins
        self._redis.resume()

    # --------------------------------------------------------------------------------------------- stop
    def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Every router stops taking requests (health NOT_SERVING, new calls UNAVAILABLE); wait up to
        timeout_s (default: the deploy file's drain_timeout_s) for the in-flight streams to finish."""
        timeout_s = self.deploy.drain_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        before = sum(_get(r.inflight.remote(), 10, 0) for r in self.routers)
        # all routers at once: each waits for its own streams
        refs = [r.drain.remote(timeout_s) for r in self.routers]
        left = sum(_get(ref, timeout_s + 30, 0) for ref in refs)
        return DrainReport(before, left, time.monotonic() - t0)

    def stop(self, drain_timeout_s: float | None = 0.0) -> DrainReport:
        """Drain the routers (drain_timeout_s; None: the deploy file's), then stop routers, clusters, Redis and
        (if we started it) Ray."""
        if self._stopped:
            return DrainReport(0, 0, 0.0)
        self._stopped = True
        report = self.drain(drain_timeout_s) if self.routers else DrainReport(0, 0, 0.0)
        t0 = time.monotonic()
        self._stopping.set()  # the supervisor must not bring back what is being stopped
        if self._supervisor is not None:
            self._supervisor.join(timeout=330)
        phases = {"supervisor": time.monotonic() - t0}
        for r in self.routers:
            _get(r.stop.remote(), 10, None)
        phases["routers"] = time.monotonic() - t0
        for cid, h in self.clusters.items():
            _get(h.stop.remote(), 20, None)
            _kill(h, f"cluster {cid}")
        phases["clusters"] = time.monotonic() - t0
        for i, r in enumerate(self.routers):
            _kill(r, f"router {i}")
        if self._redis is not None:
            self._redis.stop()
        if self._own_ray:
            ray.shutdown()
        phases["ray"] = time.monotonic() - t0
        if self._tmp is not None:
            self._tmp.cleanup()
        log.info("stopped: %s", {k: round(v, 2) for k, v in phases.items()})
        return dataclasses.replace(report, stop_s=time.monotonic() - t0)

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class DrainReport:
    inflight_at_start: int  # streams in flight at the routers when the drain began
    cut: int  # still in flight when the drain timeout passed (then stopped)
    drain_s: float
    stop_s: float = 0.0  # from the end of the drain until everything was stopped


def _retryable_start_error(exc: Exception, attempt: int) -> bool:
    msg = str(exc)
    return _RAYLET_TIMEOUT in msg or (attempt > 1 and all(s in msg for s in _GCS_PORT_TIMEOUT))


def _children() -> set[psutil.Process]:
    return set(psutil.Process().children())


def _stop_started_since(before: set[psutil.Process]) -> None:
    """Stop what a failed ``ray.init`` started: this process's direct children that are not in ``before`` (the
    GCS server, raylet, monitors: Ray starts them as children of the driver) and everything below them (the
    raylet's workers and agents). SIGTERM, then SIGKILL for any still running after ``LEFTOVER_STOP_S``, and
    wait for them (which also reaps the direct children). Only new direct children count: a process that was
    already a child keeps whatever it starts meanwhile (a Ray instance already running in this process, as in
    the test suite, spawns workers under its own raylet at any time)."""
    new = _children() - before
    procs = set(new)
    for child in new:
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since it was listed: nothing below it to stop
            procs.update(child.children(recursive=True))
    if not procs:
        return
    log.warning("stopping %d processes a failed Ray start left running: %s", len(procs),
                sorted(p.pid for p in procs))
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since it was listed: nothing to stop
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=LEFTOVER_STOP_S)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, alive = psutil.wait_procs(alive, timeout=LEFTOVER_STOP_S)
    if alive:  # e.g. stuck in a disk write (uninterruptible); Ray's own shutdown gives up on these too
        log.warning("still running after SIGKILL: %s", sorted(p.pid for p in alive))


def _get(ref, timeout_s: float, default):
    """ray.get(ref), or `default` when its actor is gone or slow (logged: a stop goes on regardless)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:
        log.warning("during stop: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return default


def _kill(actor, what: str) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except ValueError as e:  # not an actor handle any more
        log.warning("killing %s: %s", what, e)
