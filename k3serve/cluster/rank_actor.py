"""Ray hosting of engine workers: one actor per TP rank, and an executor that fans ops out to them.

A TP group's actors are created first (cheap), then ``setup`` on every rank joins one torch.distributed group
(gloo on CPU, nccl on CUDA) at a rendezvous rank 0 picked (a file when the whole group runs on one node, else a
TCP address on rank 0's node), and loads that rank's slice of the checkpoint. Actors reserve a sliver of CPU so
placement groups can pack them; the real threads are capped by ``torch_threads``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid
from datetime import timedelta
from dataclasses import replace

import ray
import torch

from k3serve.cluster.placement import ACTOR_CPU
from k3serve.contracts.numerics import DEFAULT_NUMERICS, Numerics
from k3serve.engine.executor import WorkerDied, WorkerSpec, group_failure
from k3serve.engine.worker import ModelWorker


# ops run one at a time in the default group; `watch` parks in its own group so it never blocks them
@ray.remote(num_cpus=ACTOR_CPU, max_restarts=0, concurrency_groups={"watch": 1})
class RankActor:
    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.worker: ModelWorker | None = None
        torch.set_num_threads(spec.torch_threads)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def free_address(self, same_node: bool) -> str:
        """A rendezvous for this actor's TP group (rank 0 only): a file on this node when every rank runs here
        (torch's TCP store listens on every interface), else a TCP address on this node."""
        if same_node:
            return f"file://{os.path.join(tempfile.gettempdir(), f'k3s-rdzv-{uuid.uuid4().hex}')}"
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def setup(self, init_method: str | None) -> bool:
        import torch.distributed as dist

        from k3serve.model.loader import load_model
        from k3serve.model.tp import SINGLE, TPGroup

        if self.spec.tp == 1:
            tp = SINGLE
        else:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            # a bounded collective timeout: a rank whose peer died must not hang for gloo's default 30 minutes
            dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.spec.tp,
                                     timeout=timedelta(seconds=60))
            tp = TPGroup(self.rank, self.spec.tp)
        model = load_model(self.spec.checkpoint, tp, self.spec.device, self.spec.numerics)
        hooks = self.spec.hooks(model.cfg, self.rank, self.spec.tp) if self.spec.hooks is not None else None
        self.worker = ModelWorker(model, self.spec.pools, hooks)
        return True

    def report(self) -> object:
        """What this rank's hooks report (a decode rank's transfer receiver endpoint)."""
        if self.worker is None:
            raise RuntimeError("rank not set up")
        return self.worker.hooks.report

    def execute(self, op: object) -> object:
        if self.worker is None:
            raise RuntimeError("rank not set up")
        return self.worker.execute(op)

    def pid(self) -> int:
        import os

        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Never returns: the call's ObjectRef becomes ready (with RayActorError) only when this actor dies."""
        threading.Event().wait()


class RayExecutor:
    """The Executor interface over a group of RankActors (see engine/executor.py)."""

    def __init__(self, spec: WorkerSpec, placement_group=None, bundle_offset: int = 0,
                 env_vars: dict[str, str] | None = None) -> None:
        """env_vars: set in each rank's process before it starts (merged over the job's runtime_env)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.tp = spec.tp
        opts = {"runtime_env": {"env_vars": dict(env_vars)}} if env_vars else {}
        self.actors = []
        for rank in range(spec.tp):
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, bundle_offset + rank)
            self.actors.append(RankActor.options(**opts).remote(spec, rank))
        init = None
        if spec.tp > 1:
            same_node = len(set(ray.get([a.node_id.remote() for a in self.actors]))) == 1
            init = ray.get(self.actors[0].free_address.remote(same_node))
        try:
            ray.get([a.setup.remote(init) for a in self.actors])
        except Exception as e:
            self.close()
            raise WorkerDied(f"TP group failed to start: {e}") from e
        self._watches = [a.watch.remote() for a in self.actors]

    def dead_ranks(self) -> list[int]:
        """Ranks whose actor has died, found without a call to any actor (their `watch` refs resolved)."""
        ready, _ = ray.wait(self._watches, num_returns=len(self._watches), timeout=0)
        return [i for i, ref in enumerate(self._watches) if ref in ready]

    def run(self, op: object) -> list[object]:
        return self.run_each([op] * self.tp)

    def run_each(self, ops: list[object]) -> list[object]:
        refs = [a.execute.remote(op) for a, op in zip(self.actors, ops)]
        what = type(ops[0]).__name__
        rank_of = {ref: r for r, ref in enumerate(refs)}
        raised: list[str] = []
        pending = refs
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except ray.exceptions.RayActorError as e:
                # surface a dead rank at once: the survivors may be stuck in a collective with it
                raise group_failure(what, raised, [f"rank {rank_of[ready[0]]}: {e}"]) from e
            except ray.exceptions.RayTaskError as e:
                # the op raised but the actor lives: wait for the other ranks (a rank stuck in a collective
                # with this one raises at gloo's timeout), so the group is back in step before we go on
                raised.append(f"rank {rank_of[ready[0]]}: {e}")
        if raised:
            raise group_failure(what, raised, [])
        return ray.get(refs)

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


def ray_worker_spec(checkpoint: str, tp: int, pools, torch_threads: int, hooks=None,
                    numerics: Numerics = DEFAULT_NUMERICS) -> WorkerSpec:
    """hooks: a HooksFactory joining each rank to the cluster's transfer plane (None: in-process/object store);
    numerics: the deployment's numerics mode."""
    return replace(WorkerSpec(checkpoint, tp, pools), torch_threads=torch_threads, hooks=hooks, numerics=numerics)
