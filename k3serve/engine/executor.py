"""Executors run worker ops on every rank of a TP group and return the per-rank results.

* :class:`LocalExecutor`: TP=1 in the calling process (tests, the CLI, a Ray actor hosting a TP=1 group).
* :class:`MultiprocExecutor`: TP=T worker processes joined by one torch.distributed group (gloo on CPU, nccl on
  CUDA) that rendezvous through a temporary file, so no port is picked or leaked.

Ray actors (cluster/) host the same :class:`~k3serve.engine.worker.ModelWorker`; the driver logic above this
interface does not change.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from k3serve.contracts.numerics import DEFAULT_NUMERICS, Numerics
from k3serve.engine.ops import PoolConfig
from k3serve.engine.worker import HooksFactory, ModelWorker


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build its worker."""

    checkpoint: str
    tp: int
    pools: PoolConfig
    device: str = "cpu"
    torch_threads: int = 1  # several ranks share few cores: oversubscription makes every rank crawl
    hooks: HooksFactory | None = None  # joins each rank to a transfer plane (engine/worker.py WorkerHooks)
    numerics: Numerics = DEFAULT_NUMERICS  # the numerics mode (contracts/numerics.py)


class Executor(Protocol):
    tp: int

    def run(self, op: object) -> list[object]:
        """Execute `op` on every rank; results in rank order."""

    def run_each(self, ops: list[object]) -> list[object]:
        """Execute ops[r] on rank r (ops that carry rank-specific data, e.g. a KDA head slice)."""

    def close(self) -> None: ...


def build_worker(spec: WorkerSpec, rank: int, init_file: str | None) -> ModelWorker:
    from k3serve.model.loader import load_model
    from k3serve.model.tp import SINGLE, init_tp_group

    tp = SINGLE if spec.tp == 1 else init_tp_group(rank, spec.tp, init_file)
    model = load_model(spec.checkpoint, tp, spec.device, spec.numerics)
    hooks = spec.hooks(model.cfg, rank, spec.tp) if spec.hooks is not None else None
    return ModelWorker(model, spec.pools, hooks)


class LocalExecutor:
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.tp != 1:
            raise ValueError("LocalExecutor runs TP=1 only; use MultiprocExecutor")
        self.tp = 1
        self.worker = build_worker(spec, 0, None)
        self.ready: tuple[object, ...] = (self.worker.hooks.report,)

    def run(self, op: object) -> list[object]:
        return self.run_each([op])

    def run_each(self, ops: list[object]) -> list[object]:
        if len(ops) != 1:
            raise ValueError("LocalExecutor has one rank")
        try:
            return [self.worker.execute(ops[0])]
        except Exception as e:  # the same contract as a TP group: an op that raised is OpFailed, with context
            raise OpFailed(f"{type(ops[0]).__name__} raised on rank 0: {type(e).__name__}: {e}\n"
                           f"{traceback.format_exc()}") from e

    def close(self) -> None:
        self.worker.hooks.close()


def _rank_main(spec: WorkerSpec, rank: int, init_file: str, conn) -> None:
    torch.set_num_threads(spec.torch_threads)
    try:
        worker = build_worker(spec, rank, init_file)
        cleanup = worker.hooks.close
        conn.send(("ready", worker.hooks.report))
    except BaseException:  # report the failure to the driver instead of hanging it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                op = conn.recv()
            except EOFError:
                return
            if op is None:
                return
            try:
                conn.send(("ok", worker.execute(op)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        cleanup()


class WorkerFailure(RuntimeError):
    """A TP group could not run an op: either :class:`OpFailed` or :class:`WorkerDied` (catch those)."""


class OpFailed(WorkerFailure):
    """An op raised on one or more ranks, and every rank answered: the group is intact and in step.

    Fails the request(s) the op was for (``ErrorCode.INTERNAL`` unless the caller knows better), not the
    group. The message carries the ranks' tracebacks."""


class WorkerDied(WorkerFailure):
    """A rank died (its process exited, its actor is gone) or never came back: the group is broken.

    Fails every request of the group with UNAVAILABLE (routers fail over) and triggers the rebuild."""


def group_failure(what: str, raised: list[str], died: list[str]) -> WorkerFailure:
    """The one exception for an op's outcome: any dead rank makes it WorkerDied, else OpFailed."""
    # first line: what happened, with the first rank's exception (the message a client sees); then the details
    if died:
        return WorkerDied(f"{what}: {len(died)} rank(s) died ({_last_line(died[0])})\n" + "\n".join(died + raised))
    return OpFailed(f"{what} raised on {len(raised)} rank(s): {_last_line(raised[0])}\n" + "\n".join(raised))


def _last_line(text: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


class MultiprocExecutor:
    """TP worker processes; what each rank's hooks report (WorkerHooks.report) comes back in :attr:`ready`
    (rank order)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.tp = spec.tp
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="k3serve-tp-")
        init_file = str(Path(self._dir) / "rendezvous")
        self._conns, self._procs = [], []
        try:
            for rank in range(spec.tp):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(spec, rank, init_file, child), daemon=True)
                proc.start()
                child.close()  # only the rank holds its end: a dead rank then reads as EOF here, not a hang
                self._conns.append(parent)
                self._procs.append(proc)
            self.ready: tuple[object, ...] = tuple(self._collect("start"))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs)

    def _collect(self, what: str) -> list[object]:
        results, raised, died = [], [], []
        for rank, conn in enumerate(self._conns):
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                died.append(f"rank {rank} exited")
                results.append(None)
                continue
            if status == "error":
                raised.append(f"rank {rank}: {value}")
            results.append(value)
        if what == "start" and raised:  # a group that never formed is broken, whatever the reason
            died, raised = died + raised, []
        if raised or died:
            raise group_failure(what, raised, died)
        return results

    def run(self, op: object) -> list[object]:
        return self.run_each([op] * self.tp)

    def run_each(self, ops: list[object]) -> list[object]:
        if len(ops) != self.tp:
            raise ValueError(f"{len(ops)} ops for {self.tp} ranks")
        for rank, (conn, op) in enumerate(zip(self._conns, ops)):
            try:
                conn.send(op)
            except (BrokenPipeError, OSError) as e:
                raise WorkerDied(f"{type(op).__name__}: rank {rank} is gone ({e})") from e
        return self._collect(type(ops[0]).__name__)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for f in Path(self._dir).glob("*"):
            f.unlink(missing_ok=True)
        os.rmdir(self._dir)


def make_executor(spec: WorkerSpec) -> Executor:
    return LocalExecutor(spec) if spec.tp == 1 else MultiprocExecutor(spec)
