"""`clusters.transfer: mooncake`: the worker hooks that join ranks to the Mooncake plane, and its StateChannel.

```
 prefill rank: MooncakeSendHooks      DataPlane + send region (registered once) + SenderCache(MooncakeSender)
                                      SendState -> send_state(job) as on the gRPC plane, payload by the engine
 decode rank:  MooncakeReceiverHooks  DataPlane + staging region (registered once) + TransferReceiver(region)
                                      InstallStaged takes verified staging, as on the gRPC plane
 driver:       MooncakeChannel        the gRPC channel's export / install / discard (control is gRPC)
```
The planes are built in each rank's own process (hooks are pickled to it) and closed with the worker, which
unregisters their regions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3serve.engine.worker import WorkerHooks
from k3serve.netaddr import WILDCARDS, advertised_host
from k3serve.transfer.buffers import RegionBuffers
from k3serve.transfer.handoff_send import GrpcChannel, SenderCache, send_state
from k3serve.transfer.mooncake.plane import DataPlane, MooncakeConfig
from k3serve.transfer.mooncake.sender import MooncakeSender
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.spec import StateGeometry

def engine_host(config: MooncakeConfig, bind_host: str) -> MooncakeConfig:
    """The address peers reach this process' engine at: the config's, else the bind host, else this host's."""
    if config.host not in WILDCARDS:
        return config
    return replace(config, host=advertised_host(bind_host))


def _close_all(*steps) -> None:
    errors = []
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - every step runs; the first error is raised after
            errors.append(e)
    if errors:
        raise errors[0]


@dataclass(frozen=True)
class MooncakeSendHooks:
    """WorkerHooks factory for a prefill rank that sends over the Mooncake plane."""

    config: MooncakeConfig
    bind_host: str = "127.0.0.1"  # the deployment's bind host (the engine's address when config.host is unset)

    def __call__(self, cfg, rank: int, tp: int) -> WorkerHooks:
        plane = DataPlane(engine_host(self.config, self.bind_host))  # resolved in the rank's own process/node
        region = RegionBuffers(self.config.send_bytes, quarantine_s=0.0)  # read only by our own writes
        plane.register(region)
        cache = SenderCache(lambda r, eps, c: MooncakeSender(r, eps, c, plane, region,
                                                             batch_bytes=self.config.batch_bytes))
        return WorkerHooks(send_state=lambda job, r, kda, mla: send_state(job, r, kda, mla, cache),
                           close=lambda: _close_all(cache.close, plane.close))


@dataclass(frozen=True)
class MooncakeReceiverHooks:
    """WorkerHooks factory for a decode rank: a receiver whose staging is a registered region."""

    rx: ReceiverConfig
    config: MooncakeConfig

    def __call__(self, cfg, rank: int, tp: int) -> WorkerHooks:
        geometry = StateGeometry.of_config(cfg, 0).without_tokens()
        plane = DataPlane(engine_host(self.config, self.rx.host))  # resolved in the rank's own process/node
        region = RegionBuffers(self.config.staging_bytes, quarantine_s=self.config.quarantine_s)
        plane.register(region)
        receiver = TransferReceiver(self.rx.for_rank(rank, tp), expect_geometry=geometry, region=region,
                                    segment=plane.segment)
        return WorkerHooks(staging=receiver.store, report=receiver.endpoint,
                           close=lambda: _close_all(lambda: receiver.stop(0), plane.close))


class MooncakeChannel(GrpcChannel):
    """The StateChannel of a Mooncake cluster: the same control as GrpcChannel (the prefill ranks' hooks move
    the payload with the engine instead of in the gRPC messages)."""

    name = "mooncake"
    layerwise = False  # its senders stage the state in the registered send region: no PrefillStreamed yet
