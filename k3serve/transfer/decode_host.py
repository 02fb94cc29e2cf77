"""A decode TP group whose rank processes also run transfer receivers, so staging sits next to the pools.

```
 driver: DecodeEngine ──ops (pipe)──▶ rank r process: ModelWorker (kda_store, page_store)
                                        └─ TransferReceiver (gRPC, endpoints[r]) ─▶ worker.staging
 prefill ranks ──Push──▶ endpoints[r]          InstallStaged(slot, table, tid) copies staging -> pools
```
The same Executor protocol as engine.executor.MultiprocExecutor (run / run_each / close) plus ``endpoints``
(decode-rank order) to hand to the senders. Ray actors do the same with ``receiver.attach(worker, ...)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from pathlib import Path

import torch

from k3serve.engine.executor import WorkerFailure, WorkerSpec, build_worker
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver, attach
from k3serve.transfer.spec import StateGeometry


def _rank_main(spec: WorkerSpec, rank: int, init_file: str, rx: ReceiverConfig, conn) -> None:
    torch.set_num_threads(spec.torch_threads)
    receiver = None
    try:
        worker = build_worker(spec, rank, init_file)
        geometry = StateGeometry.of_config(worker.model.cfg, 0).without_tokens()
        receiver = TransferReceiver(rx.for_rank(rank, spec.tp), expect_geometry=geometry)
        attach(worker, receiver)
        conn.send(("ready", receiver.endpoint))
    except BaseException:  # report to the driver instead of hanging it
        conn.send(("error", traceback.format_exc()))
        if receiver is not None:
            receiver.stop(0)
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
        receiver.stop(0)


class ReceivingExecutor:
    """TP=spec.tp decode worker processes, each serving a transfer receiver (ReceiverConfig, rank filled in)."""

    def __init__(self, spec: WorkerSpec, receiver: ReceiverConfig) -> None:
        self.tp = spec.tp
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="k3serve-rx-")
        init_file = str(Path(self._dir) / "rendezvous")
        self._conns, self._procs = [], []
        try:
            for rank in range(spec.tp):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(spec, rank, init_file, receiver, child), daemon=True)
                proc.start()
                child.close()  # a dead rank then reads as EOF, not a hang
                self._conns.append(parent)
                self._procs.append(proc)
            self.endpoints: tuple[str, ...] = tuple(self._collect("start"))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs)

    def _collect(self, what: str) -> list[object]:
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", f"rank {rank} exited"
            if status == "error":
                errors.append(f"rank {rank}: {value}")
            results.append(value)
        if errors:
            raise WorkerFailure(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def run(self, op: object) -> list[object]:
        return self.run_each([op] * self.tp)

    def run_each(self, ops: list[object]) -> list[object]:
        if len(ops) != self.tp:
            raise ValueError(f"{len(ops)} ops for {self.tp} ranks")
        for conn, op in zip(self._conns, ops):
            conn.send(op)
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
