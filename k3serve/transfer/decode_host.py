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

from dataclasses import dataclass

from k3serve.engine.executor import MultiprocExecutor, WorkerSpec
from k3serve.engine.worker import ModelWorker
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver, attach
from k3serve.transfer.spec import StateGeometry


@dataclass(frozen=True)
class ReceiverSetup:
    """Rank hook: start this rank's receiver next to its worker; reports the receiver's endpoint."""

    rx: ReceiverConfig

    def __call__(self, worker: ModelWorker, rank: int, tp: int):
        geometry = StateGeometry.of_config(worker.model.cfg, 0).without_tokens()
        receiver = TransferReceiver(self.rx.for_rank(rank, tp), expect_geometry=geometry)
        attach(worker, receiver)
        return receiver.endpoint, lambda: receiver.stop(0)


class ReceivingExecutor(MultiprocExecutor):
    """TP=spec.tp decode worker processes, each serving a transfer receiver (ReceiverConfig, rank filled in)."""

    def __init__(self, spec: WorkerSpec, receiver: ReceiverConfig) -> None:
        super().__init__(spec, setup=ReceiverSetup(receiver))
        self.endpoints: tuple[str, ...] = tuple(self.ready)
