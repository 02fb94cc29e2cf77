"""A decode TP group whose rank processes also run transfer receivers, so staging sits next to the pools.

```
 driver: DecodeEngine ──ops (pipe)──▶ rank r process: ModelWorker (kda_store, page_store)
                                        └─ TransferReceiver (gRPC, endpoints[r]) ─▶ worker.staging
 prefill ranks ──Push──▶ endpoints[r]          InstallStaged(slot, table, tid) copies staging -> pools
```
The same Executor protocol as engine.executor.MultiprocExecutor (run / run_each / close) plus ``endpoints``
(decode-rank order) to hand to the senders. Ray rank actors take the same ReceiverHooks in their WorkerSpec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3serve.engine.executor import MultiprocExecutor, WorkerSpec
from k3serve.engine.worker import WorkerHooks
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.spec import StateGeometry


@dataclass(frozen=True)
class ReceiverHooks:
    """WorkerHooks factory for a decode rank: start this rank's receiver next to its pools (InstallStaged takes
    from its staging); the hooks report the receiver's endpoint and stop it with the worker."""

    rx: ReceiverConfig

    def __call__(self, cfg, rank: int, tp: int) -> WorkerHooks:
        geometry = StateGeometry.of_config(cfg, 0).without_tokens()
        receiver = TransferReceiver(self.rx.for_rank(rank, tp), expect_geometry=geometry)
        return WorkerHooks(staging=receiver.store, report=receiver.endpoint, close=lambda: receiver.stop(0))


class ReceivingExecutor(MultiprocExecutor):
    """TP=spec.tp decode worker processes, each serving a transfer receiver (ReceiverConfig, rank filled in)."""

    def __init__(self, spec: WorkerSpec, receiver: ReceiverConfig) -> None:
        super().__init__(replace(spec, hooks=ReceiverHooks(receiver)))
        self.endpoints: tuple[str, ...] = tuple(self.ready)
