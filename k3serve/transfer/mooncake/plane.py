"""The Mooncake Transfer Engine as k3serve's data plane: one engine per rank process, regions registered once.

```
 MooncakeConfig      protocol tcp | rdma, metadata P2PHANDSHAKE | redis://... | etcd://..., device, host, sizes
 DataPlane(config)   TransferEngine.initialize(host, metadata, protocol, device); segment = "host:rpc_port"
   .register(region) once per RegionBuffers (staging on decode ranks, the send region on prefill ranks)
   .write(segment, [(src_addr, dst_addr, length), ...])   one batch, synchronous; DataPlaneError on failure
   .close()          unregisters every region it registered (no registration outlives its process' plane)
```
The engine (the `mooncake-transfer-engine-non-cuda` wheel here, a CUDA build on GPU fleets; SGLang, vLLM and
Dynamo move KV with it) needs `libibverbs1 librdmacm1 libnuma1` even for TCP: `pip install k3serve[mooncake]`,
or `K3SERVE_MOONCAKE=1 bash scripts/setup.sh`, installs both.

Its TCP transport refuses writes outside the target's registered buffers, but it does not authenticate peers:
any process that reaches an engine's port can read and write its registered memory. And it binds every interface
whatever host it is given (the handshake socket 0.0.0.0, the data socket ::). So a plane keeps the engine's
listeners on its host (listeners.py: a preloaded bind() and a check of the process' own sockets) unless the
operator opts in to ``listen_any`` (`clusters.mooncake.listen_any: true`: the ports firewalled instead); the
registered regions hold only sealed state (chunk_seal.py), and the receiver decrypts each landed chunk into
private memory as it checks it (staging.py), so a write after landing never reaches what is installed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from k3serve.transfer.buffers import RegionBuffers
from k3serve.transfer.mooncake.listeners import ListenerError, confined

PROTOCOLS = ("tcp", "rdma")
INSTALL_HINT = "pip install 'k3serve[mooncake]' (and apt-get install libibverbs1 librdmacm1 libnuma1)"


class DataPlaneError(RuntimeError):
    """The data plane could not start, register memory or complete a write (the text says which)."""


@dataclass(frozen=True)
class MooncakeConfig:
    """How a rank joins the Mooncake data plane (`clusters.mooncake` in the deploy file)."""

    protocol: str = "tcp"  # "rdma" where NICs exist
    metadata: str = "P2PHANDSHAKE"  # peers exchange segment metadata directly; or the deployment's redis://...
    device: str = ""  # RDMA device filter ("" = auto)
    host: str = "127.0.0.1"  # the address peers reach this rank's engine at
    staging_bytes: int = 512 << 20  # a decode rank's registered staging region
    send_bytes: int = 256 << 20  # a prefill rank's registered send region (its exported state is copied in)
    quarantine_s: float = 120.0  # a cancelled transfer's range is reused only after this (late remote writes)
    batch_bytes: int = 4 << 20  # payload per engine batch: the receiver CRCs one batch while the next lands
    listen_any: bool = False  # the engine may listen on every interface (the operator firewalls it); else on host

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not self.metadata:
            raise ValueError("mooncake.metadata must be P2PHANDSHAKE or a metadata server URL")
        for name in ("staging_bytes", "send_bytes", "batch_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 4096:
                raise ValueError(f"mooncake.{name} must be an int >= 4096, got {getattr(self, name)!r}")
        if self.quarantine_s < 0:
            raise ValueError(f"mooncake.quarantine_s must be >= 0, got {self.quarantine_s}")


def mooncake_available() -> str:
    """'' when the engine imports here, else why not (for clear errors and test skips)."""
    # the engine logs every batch at INFO on stderr; WARNING unless the operator chose a level (read at import)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return f"the Mooncake Transfer Engine does not import ({e}); {INSTALL_HINT}"
    return ""


class DataPlane:
    """One TransferEngine for this process. Thread-safe: writes from several streams run concurrently."""

    def __init__(self, config: MooncakeConfig) -> None:
        why = mooncake_available()
        if why:
            raise DataPlaneError(why)
        from mooncake.engine import TransferEngine

        self.config = config
        self._engine = TransferEngine()
        try:
            with contextlib.nullcontext() if config.listen_any else confined(config.host):
                rc = self._engine.initialize(config.host, config.metadata, config.protocol, config.device)
        except ListenerError as e:
            raise DataPlaneError(str(e)) from None
        if rc != 0:
            raise DataPlaneError(f"TransferEngine.initialize({config.host!r}, {config.metadata!r}, "
                                 f"{config.protocol!r}) returned {rc}")
        self.segment = f"{config.host}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # addr -> length
        self.registrations = 0  # register calls made over this plane's life (one per region)

    def register(self, region: RegionBuffers) -> None:
        """Register a region's whole buffer once; later transfers use ranges of it with no further calls."""
        with self._lock:
            if region.base in self._registered:
                return
            rc = self._engine.register_memory(region.base, region.size)
            if rc != 0:
                raise DataPlaneError(f"register_memory of {region.size} bytes at {region.base:#x} returned {rc}")
            self._registered[region.base] = region.size
            self.registrations += 1

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(self._registered.values())

    def write(self, segment: str, ops: Sequence[tuple[int, int, int]]) -> None:
        """Write each (local src addr, remote dst addr, length) into `segment`; returns once all landed."""
        self.wait(self.submit(segment, ops))

    def submit(self, segment: str, ops: Sequence[tuple[int, int, int]]) -> tuple[int, str, int]:
        """Start the writes of `ops` (see write); wait(job) returns once they landed."""
        if not ops:
            return (0, segment, 0)
        srcs, dsts, lens = (list(x) for x in zip(*ops))
        batch = self._engine.batch_transfer_async_write(segment, srcs, dsts, lens)
        if not batch:
            raise DataPlaneError(f"could not start a write of {len(ops)} range(s), {sum(lens)} bytes, to {segment}")
        return (batch, segment, sum(lens))

    def wait(self, job: tuple[int, str, int]) -> None:
        batch, segment, nbytes = job
        if batch and self._engine.get_batch_transfer_status([batch]) != 0:
            raise DataPlaneError(f"write of {nbytes} bytes to {segment} failed (target gone, or outside its "
                                 "registered memory)")

    def close(self) -> None:
        """Unregister every region (the engine's own threads go with the process)."""
        with self._lock:
            for addr in list(self._registered):
                self._engine.unregister_memory(addr)
                del self._registered[addr]
