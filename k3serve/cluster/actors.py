"""Ray actors of a deployment: one ClusterActor per cluster (it owns its rank actors) and RouterActors
(``router_actor.py``: a module of their own, without torch).

```
 ClusterActor c0 ── placement group: prefill rank 0..P-1, decode rank 0..D-1 (RankActor); one node
   │                 (STRICT_PACK), or the nodes clusters.placement names by resources (PACK; placement.py)
   ├ PrefillEngine / DecodeEngine over RayExecutors
   ├ ClusterFront: internal gRPC (port 0) for routers; one warm-up request runs before it registers
   └ agent thread: register endpoints, heartbeat load into Redis; silent once the cluster is broken
 RouterActor r0..  ── RouterService (public gRPC, port 0) over Redis membership + pins
```
Rank actors are owned by their ClusterActor, so killing a cluster actor takes its whole cluster down (that is
what the `cluster:` drill does); killing one rank actor breaks its group: the front fails its in-flight
requests over to other clusters, the agent takes the cluster out of the membership, tears it down (front, rank
actors, placement group) and builds it again (``clusters.rebuild``, with backoff), then registers the new
endpoint. Pins do not move back: sessions stay where they failed over to, new sessions spread over it again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from redis.exceptions import RedisError

from k3serve.cluster.deploy import DeployConfig
from k3serve.cluster.placement import ACTOR_CPU
from k3serve.cluster.rank_actor import RayExecutor, ray_worker_spec

log = logging.getLogger(__name__)

PG_READY_TIMEOUT_S = 30.0  # how long one build waits for its placement group (then rebuild backs off, retries)


@ray.remote(num_cpus=ACTOR_CPU, max_restarts=0, max_concurrency=8)
class ClusterActor:
    def __init__(self, cluster_id: str, deploy: DeployConfig, checkpoint: str, redis_url: str,
                 pg_name: str = "") -> None:
        """pg_name: a name for the placement group (unique in the Ray namespace), so that whoever replaces a
        dead ClusterActor can find and remove the group it left behind; empty: unnamed."""
        import torch

        torch.set_num_threads(deploy.torch_threads)
        self.cluster_id, self.deploy, self.checkpoint, self.redis_url = cluster_id, deploy, checkpoint, redis_url
        self.pg_name = pg_name
        self.front = None
        self.executors: dict[str, RayExecutor] = {}
        self.rebuilds = 0
        self._pg = None
        self._agent: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> str:
        """Build the cluster, then register it and heartbeat (and rebuild it when it breaks) in the agent."""
        endpoint = self._build()
        self._agent = threading.Thread(target=self._agent_loop, args=(endpoint,), daemon=True)
        self._agent.start()
        return endpoint

    def _build(self) -> str:
        """Placement group, rank actors, engines and the front; returns the front's endpoint."""
        from ray.util.placement_group import placement_group

        from k3serve.decode.engine import DecodeConfig, DecodeEngine
        from k3serve.engine.block_hash import model_fingerprint, prefix_key
        from k3serve.model.checkpoint import load_config
        from k3serve.prefill.engine import PrefillConfig, PrefillEngine

        from k3serve.cluster.front import ClusterFront
        from k3serve.disagg.loop import DisaggLoop

        d, c = self.deploy, self.deploy.clusters
        cfg = load_config(self.checkpoint)
        where = c.placement_of(self.cluster_id)  # nodes by custom resources (cluster/placement.py)
        pg = self._pg = placement_group(where.bundles(ACTOR_CPU, c.prefill_tp, c.decode_tp), strategy=where.strategy,
                                        name=self.pg_name)
        # bounded, and cut short by stop(): a group whose node is lost stays pending; the rebuild retries later
        ready, deadline = pg.ready(), time.monotonic() + PG_READY_TIMEOUT_S
        while not ray.wait([ready], timeout=1.0)[0]:
            if self._stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"cluster {self.cluster_id}: no nodes with the resources of its placement group "
                                   f"{where.bundles(ACTOR_CPU, c.prefill_tp, c.decode_tp)} within "
                                   f"{PG_READY_TIMEOUT_S:.0f} s" if not self._stop.is_set() else "stopping")
        pre_pools = c.prefill_pools.pool_config(cfg, c.prefill_tp)
        dec_pools = c.decode_pools.pool_config(cfg, c.decode_tp)
        spec = c.speculative.spec_config(d.request_classes)
        if spec is not None:  # record buffers for one verify of every request of a full batch
            dec_pools = dataclasses.replace(dec_pools, spec_slots=c.max_decode_batch,
                                            spec_tokens=spec.num_draft_tokens + 1)
        send_hooks, receive_hooks = self._transfer_hooks()
        groups = {"prefill": (ray_worker_spec(self.checkpoint, c.prefill_tp, pre_pools, d.torch_threads, send_hooks,
                                              d.numerics), 0),
                  # decode ranks take the bundles after the prefill ranks
                  "decode": (ray_worker_spec(self.checkpoint, c.decode_tp, dec_pools, d.torch_threads, receive_hooks,
                                             d.numerics), c.prefill_tp)}
        # both groups' processes start and load the weights at once (one after the other, the decode group's
        # start added its whole time to every cluster build)
        with ThreadPoolExecutor(len(groups)) as pool:
            env = self._rank_env()
            started = {g: pool.submit(RayExecutor, spec, pg, offset, env) for g, (spec, offset) in groups.items()}
        errors = [e for e in (f.exception() for f in started.values()) if e is not None]
        self.executors.update({g: f.result() for g, f in started.items() if not f.exception()})
        if errors:  # a group that did start is closed with the cluster's teardown
            raise errors[0]
        channel = self._channel(cfg)
        policy = c.prefix_policy()
        decode = DecodeEngine(cfg, self.executors["decode"], DecodeConfig(dec_pools, max_batch=c.max_decode_batch,
                                                                          speculative=spec),
                              channel)
        prefill = PrefillEngine(cfg, self.executors["prefill"],
                                PrefillConfig(pre_pools, policy, step_token_budget=c.step_token_budget,
                                              long_threshold=_long_threshold(d),
                                              long_step_tokens=c.long_step_tokens or None, numerics=d.numerics,
                                              draft_capture=decode.draft_capture,  # the drafter's warm start
                                              layerwise_export=c.layerwise_export),
                                prefix_key(model_fingerprint(cfg.to_hf_dict()), d.secret), channel)
        front = ClusterFront(self.cluster_id, DisaggLoop(prefill, decode), d.secret, c.prefill_tp, c.decode_tp,
                             d.numerics, tls=d.tls)
        client = getattr(channel, "client", None)  # the gRPC channel's receivers report their staging
        if client is not None:
            front.staging = lambda: _staging(client)
        endpoint = front.start(d.internal_bind)
        self.front = front
        # before it registers (the agent): a cold cluster's first requests run 3-4x as long (ClusterFront.warm_up)
        log.info("cluster %s warmed up in %.2f s", self.cluster_id, front.warm_up())
        return endpoint

    def _transfer_hooks(self) -> tuple[object, object]:
        """(prefill ranks' hooks, decode ranks' hooks) for `clusters.transfer`."""
        d = self.deploy
        if d.clusters.transfer == "object_store":
            return None, None
        from k3serve.auth import AuthConfig
        from k3serve.transfer.decode_host import ReceiverHooks
        from k3serve.transfer.handoff_send import GrpcSendHooks
        from k3serve.transfer.receiver import ReceiverConfig

        rx = ReceiverConfig(AuthConfig(d.secret, peer=f"decode-{self.cluster_id}", tls=d.tls), host=d.internal_bind)
        if d.clusters.transfer == "mooncake":
            from k3serve.transfer.mooncake.hooks import MooncakeReceiverHooks, MooncakeSendHooks

            mc = d.clusters.mooncake.config()
            return MooncakeSendHooks(mc, d.internal_bind), MooncakeReceiverHooks(rx, mc)
        return GrpcSendHooks(), ReceiverHooks(rx)

    def _rank_env(self) -> dict[str, str]:
        """What rank processes start with beyond the job's environment: the bind() that keeps each Mooncake
        engine's listeners on its host (transfer/mooncake/listeners.py), unless the operator chose listen_any."""
        c = self.deploy.clusters
        if c.transfer != "mooncake" or c.mooncake.listen_any:
            return {}
        from k3serve.transfer.mooncake.listeners import build_shim, process_env

        return process_env(build_shim())

    def _channel(self, cfg):
        """The StateChannel between this cluster's groups (`clusters.transfer`)."""
        d, c = self.deploy, self.deploy.clusters
        if c.transfer == "object_store":
            from k3serve.transfer.inprocess import InProcessChannel

            return InProcessChannel()
        from k3serve.transfer.handoff_send import GrpcChannel
        from k3serve.transfer.mooncake.hooks import MooncakeChannel

        endpoints = tuple(ray.get([a.report.remote() for a in self.executors["decode"].actors]))
        return (MooncakeChannel if c.transfer == "mooncake" else GrpcChannel)(self.cluster_id, cfg, endpoints, d.secret, c.prefill_tp, c.decode_tp,
                           c.prefill_pools.page_size, tls=d.tls)

    def _teardown(self) -> None:
        """Stop the front and kill the rank actors and placement group (what a failed _build left, too)."""
        from ray.util.placement_group import remove_placement_group

        front, executors, pg = self.front, list(self.executors.values()), self._pg
        self.front, self.executors, self._pg = None, {}, None
        if front is not None:
            front.stop(0.5)
        for ex in executors:
            ex.close()
        if pg is not None:
            remove_placement_group(pg)

    def _rebuild(self) -> str | None:
        """Tear the broken cluster down and build it again, backing off between failed attempts.

        Returns the new endpoint, or None when the actor is stopping."""
        delay = self.deploy.clusters.rebuild_backoff_s
        while True:
            self._teardown()
            if self._stop.wait(delay):
                return None
            try:
                endpoint = self._build()
            except Exception as e:  # noqa: BLE001 - e.g. no resources yet: try again later
                log.warning("rebuilding cluster %s failed: %s", self.cluster_id, e)
                delay = min(2 * delay, 30.0)
                continue
            self.rebuilds += 1
            log.warning("cluster %s rebuilt (%d): %s", self.cluster_id, self.rebuilds, endpoint)
            return endpoint

    def _agent_loop(self, endpoint: str) -> None:
        """Register and heartbeat; when the front breaks, leave the membership, then rebuild (if configured)."""
        from k3serve.cluster.redis_server import connect
        from k3serve.router.membership import Membership
        from k3serve.router.prefix_map import PrefixMap

        ctl = self.deploy.control
        c = self.deploy.clusters
        client = connect(self.redis_url)
        members = Membership(client, ctl.namespace, self.deploy.secret)
        prefixes = PrefixMap(client, ctl.namespace)
        published = -1  # the cache version last published
        registered = False
        while not self._stop.wait(ctl.heartbeat_interval_s if registered else 0.0):
            front = self.front
            if front is not None and not front.broken:
                dead = [f"{role} rank {r}" for role, ex in self.executors.items() for r in ex.dead_ranks()]
                if dead:  # found while idle too: the next request must not be the one to find out
                    front.mark_broken(f"{', '.join(dead)} died")
            if front is None or front.broken:
                try:  # routers drop it at their next refresh instead of after the heartbeat TTL
                    members.deregister(self.cluster_id)
                except (RedisError, OSError) as e:  # Redis down: the heartbeat TTL removes it anyway
                    log.warning("deregistering broken cluster %s failed (TTL removes it): %s", self.cluster_id, e)
                if not c.rebuild:
                    return  # stays out of rotation until the deployment restarts
                endpoint = self._rebuild()
                if endpoint is None:
                    return
                registered = False
                continue
            load = {**front.load, "prefill_tp": c.prefill_tp, "decode_tp": c.decode_tp}
            try:
                if not registered or not members.heartbeat(self.cluster_id, load, ctl.heartbeat_ttl_s):
                    members.register(self.cluster_id, {"cluster": endpoint}, ttl_s=ctl.heartbeat_ttl_s * 20,
                                     heartbeat_ttl_s=ctl.heartbeat_ttl_s)
                    registered = True
                version, hashes = front.prefix_hashes
                if version != published or not prefixes.touch(self.cluster_id, ctl.heartbeat_ttl_s):
                    prefixes.publish(self.cluster_id, hashes, ctl.heartbeat_ttl_s)
                    published = version
            except (RedisError, OSError) as e:  # Redis down: keep serving, retry next beat
                log.warning("heartbeat of %s failed: %s", self.cluster_id, e)
                published = -1

    def watch(self) -> None:
        """Never returns: the call's ref resolves only when this actor dies (the deployment's supervisor)."""
        threading.Event().wait()

    def nodes(self) -> dict[str, object]:
        """Ray node ids this cluster runs on: {"front": id, "prefill": [per rank], "decode": [per rank]}."""
        out: dict[str, object] = {"front": ray.get_runtime_context().get_node_id()}
        for role, ex in self.executors.items():
            out[role] = ray.get([a.node_id.remote() for a in ex.actors], timeout=30)
        return out

    def rank_actors(self) -> dict[str, list]:
        return {role: list(ex.actors) for role, ex in self.executors.items()}

    def stats(self) -> dict:
        front = self.front
        return {"cluster_id": self.cluster_id, "broken": front.broken if front else "not running",
                "rebuilds": self.rebuilds, **(front.metrics if front else {})}

    def pids(self) -> dict[str, int]:
        """Process ids of this cluster: the actor itself and every rank (RSS checks of the soak test)."""
        import os

        out = {"cluster": os.getpid()}
        for role, ex in self.executors.items():
            out.update({f"{role}{r}": pid for r, pid in enumerate(ex.pids())})
        return out

    def load(self) -> dict[str, float]:
        """What the agent heartbeats: running requests, in-flight tokens, pool occupancy (``pool.*``)."""
        front = self.front
        return front.load if front is not None else {}

    def stop(self, grace_s: float = 2.0) -> None:
        self._stop.set()
        if self._agent is not None:
            self._agent.join(timeout=60)  # a rebuild in progress finishes (or gives up) first
        if self.front is not None:
            self.front.stop(grace_s)
        try:
            from k3serve.cluster.redis_server import connect
            from k3serve.router.membership import Membership

            Membership(connect(self.redis_url), self.deploy.control.namespace,
                       self.deploy.secret).deregister(self.cluster_id)
        except (RedisError, OSError) as e:  # best effort: the heartbeat TTL removes it anyway
            log.warning("deregistering cluster %s at stop failed (TTL removes it): %s", self.cluster_id, e)
        self._teardown()


def _staging(client) -> "PoolUsage":
    """Staging bytes held on this cluster's decode ranks (unreachable receivers count 0)."""
    from k3serve.contracts.status import PoolUsage

    return PoolUsage(sum(r.staged_bytes for r in client.status("")))


def _long_threshold(d: DeployConfig) -> int:
    """The engine's long class starts above the smallest class bound of the deploy file."""
    return min(c.max_uncached_tokens for c in d.request_classes) + 1
