"""Sender and receiver processes driven over a pipe: loopback tests and the transfer bench.

```
 driver ──pipe──▶ SenderProc (one per prefill rank): load(key, kda, mla); send(SendJob) -> SendResult | failure
        │                                            socket_send / grpc_send(job): the same bytes, baselines
        └─pipe──▶ ReceiverProc (one per decode rank): a TransferReceiver; digest(tid) (verified state's CRCs,
                                                       then dropped), occupancy; baseline sinks (baselines.py)
 both: cpu() -> the process's CPU seconds so far (all threads), for the bench's time shares
```
Processes are spawned (fresh interpreters, one torch thread each). A command's reply is ("ok", value) or
("error", traceback); a dead process reads as EOF and raises ProcDied.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass

import torch

from benchmarks.transfer_baselines import GrpcSink, SocketSink, grpc_source, mooncake_source, socket_source
from k3serve.transfer.chunks import all_layers, stream_plan
from benchmarks.transfer_faults import NO_FAULTS, SenderFaults
from k3serve.transfer.handoff_send import SenderCache
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SenderConfig, TransferFailed, TransferSender
from k3serve.transfer.mooncake.plane import MooncakeConfig
from k3serve.transfer.spec import DTYPES, TransferSpec
from k3serve.transfer.wire import byte_view, crc32c

class ProcDied(RuntimeError):
    """The helper process exited (killed, crashed) before answering."""


@dataclass(frozen=True)
class SendJob:
    spec: TransferSpec
    rank: int
    endpoints: tuple[str, ...]
    config: SenderConfig
    key: str  # which loaded state to send
    faults: SenderFaults = NO_FAULTS
    layerwise: bool = False  # mark layers ready one by one (as a prefill would) instead of all at once
    timeout_s: float | None = None
    mooncake: MooncakeConfig | None = None  # send over the Mooncake plane (the receivers must have one too)


@dataclass(frozen=True)
class SendFailure:
    code: str
    message: str
    dst_rank: int | None


class _Proc:
    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.ready = self.wait(120.0)

    def post(self, *msg) -> None:
        self._conn.send(msg)

    def wait(self, timeout: float = 120.0):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"helper process {self.proc.pid} did not answer within {timeout} s")
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError):
            raise ProcDied(f"helper process {self.proc.pid} exited (code {self.proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"helper process {self.proc.pid} failed:\n{value}")
        return value

    def call(self, *msg, timeout: float = 120.0):
        self.post(*msg)
        return self.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()


def _serve(conn, handlers: dict) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, ConnectionResetError):
            return
        if msg[0] == "stop":
            return
        try:
            conn.send(("ok", handlers[msg[0]](*msg[1:])))
        except BaseException:  # noqa: BLE001 - reported to the driver
            conn.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------------------------------ sender
def _sender_main(conn) -> None:
    torch.set_num_threads(1)
    states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    planes: dict[MooncakeConfig, tuple] = {}  # this process' data plane and send region (made on first use)
    registered: dict[str, tuple[torch.Tensor, ...]] = {}  # states loaded into the send region
    # senders (their channels) kept across sends, as a prefill rank keeps them (handoff_send.SenderCache); the
    # bare gRPC baseline keeps its channels too, so neither side pays connection set-up per repetition
    grpc_senders, mooncake_senders = SenderCache(_grpc_factory), SenderCache(_mooncake_factory(lambda mc: plane(mc)))
    bare_channels: dict[str, object] = {}

    def load(key: str, kda: torch.Tensor, mla: torch.Tensor) -> None:
        states[key] = (kda.contiguous().clone(), mla.contiguous().clone())  # private memory, like a prefill rank

    def plane(mc: MooncakeConfig) -> tuple:
        if mc not in planes:
            from k3serve.transfer.buffers import RegionBuffers
            from k3serve.transfer.mooncake.plane import DataPlane

            planes[mc] = (DataPlane(mc), RegionBuffers(mc.send_bytes, quarantine_s=0.0))
        return planes[mc]

    def sender_for(job: SendJob) -> tuple[TransferSender, bool]:
        """(the sender for `job`, whether the caller closes it after this send: fault-tapped ones are per job)."""
        if not job.faults.any:
            cache = grpc_senders if job.mooncake is None else mooncake_senders
            return cache.get(job.rank, job.endpoints, (job.config, job.mooncake)), False
        if job.mooncake is None:
            return TransferSender(job.rank, job.endpoints, job.config, job.faults), True
        from k3serve.transfer.mooncake.sender import MooncakeSender

        dp, region = plane(job.mooncake)
        return MooncakeSender(job.rank, job.endpoints, job.config, dp, region, job.faults,
                              job.mooncake.batch_bytes), True

    def load_registered(key: str, kda: torch.Tensor, mla: torch.Tensor, mc: MooncakeConfig) -> None:
        """Like load, but into the registered send region (a prefill rank exporting into registered memory)."""
        _, region = plane(mc)
        for old in list(registered):  # one registered state at a time (the bench runs one pair at a time)
            for t in registered.pop(old):
                region.release(t, False)
            states.pop(old, None)
        states[key] = registered[key] = tuple(_into(region, t) for t in (kda, mla))

    def mooncake_send(job: SendJob, targets: list[tuple[str, int, int]]) -> None:
        """Raw Mooncake baseline: this rank's planned byte ranges straight to `targets[d]` (segment, kda, mla
        addresses), one thread per decode rank, batches of batch_bytes; no CRC, no control stream, no checks."""
        dp, _ = plane(job.mooncake)
        kda, mla = states[job.key]
        mooncake_source(dp, targets, [stream_plan(job.spec, job.rank, d) for d in range(job.spec.decode_tp)],
                        {"kda": kda.data_ptr(), "mla": mla.data_ptr()}, job.mooncake.batch_bytes)

    def send(job: SendJob):
        kda, mla = states[job.key]
        sender, own = sender_for(job)
        try:
            session = sender.begin(job.spec, kda, mla)
            if job.layerwise:
                for kind, layer in all_layers(job.spec):
                    session.layer_ready(kind, layer)
            else:
                session.all_ready()
            return session.finish(job.timeout_s)
        except TransferFailed as e:
            return SendFailure(e.code, e.message, e.dst_rank)
        finally:
            if own:
                sender.close()

    def pieces(job: SendJob) -> list[list]:
        """Per decode rank, the byte views send(job) would stream there (the baselines move the same bytes)."""
        views = {"kda": byte_view(states[job.key][0]), "mla": byte_view(states[job.key][1])}
        return [[views[c.kind][c.src_byte: c.src_byte + c.length] for c in stream_plan(job.spec, job.rank, d)]
                for d in range(job.spec.decode_tp)]

    conn.send(("ok", None))
    try:
        _serve(conn, {"load": load, "load_registered": load_registered, "send": send, "cpu": time.process_time,
                      "mooncake_send": mooncake_send,
                      "socket_send": lambda job, ports, host: socket_source(host, ports, pieces(job)),
                      "grpc_send": lambda job, ports, host: grpc_source(host, ports, pieces(job),
                                                                        channels=bare_channels)})
    finally:
        grpc_senders.close()
        mooncake_senders.close()
        for ch in bare_channels.values():
            ch.close()


def _mooncake_factory(plane):
    """SenderCache factory for Mooncake senders: config is (SenderConfig, MooncakeConfig); plane(mc) gives this
    process' (DataPlane, send region)."""
    def make(rank: int, endpoints: tuple[str, ...], config: tuple) -> TransferSender:
        from k3serve.transfer.mooncake.sender import MooncakeSender

        sender_cfg, mc = config
        dp, region = plane(mc)
        return MooncakeSender(rank, endpoints, sender_cfg, dp, region, None, mc.batch_bytes)

    return make


def _grpc_factory(rank: int, endpoints: tuple[str, ...], config: tuple) -> TransferSender:
    return TransferSender(rank, endpoints, config[0])


def _into(region, t: torch.Tensor) -> torch.Tensor:
    out = region.alloc(tuple(t.shape), t.dtype)
    if out is None:
        raise MemoryError(f"send region of {region.size} bytes is full")
    return out.copy_(t)


class SenderProc(_Proc):
    def __init__(self) -> None:
        super().__init__(_sender_main)


# ---------------------------------------------------------------------------------------------- receiver
def _receiver_main(conn, config: ReceiverConfig, mooncake: MooncakeConfig | None) -> None:
    torch.set_num_threads(1)
    plane = None
    if mooncake is None:
        rx = TransferReceiver(config)
    else:  # staging in a registered region, Open answered with its addresses
        from k3serve.transfer.buffers import RegionBuffers
        from k3serve.transfer.mooncake.plane import DataPlane

        plane, region = DataPlane(mooncake), RegionBuffers(mooncake.staging_bytes, quarantine_s=mooncake.quarantine_s)
        plane.register(region)
        rx = TransferReceiver(config, region=region, segment=plane.segment)
    sinks: dict[str, object] = {}  # baseline sinks (bench)

    def digest(tid: str) -> tuple[int, int]:
        """CRC32C of the verified state's KDA and MLA bytes; the staging is dropped (as an install would)."""
        st = rx.store.take(tid)
        out = crc32c(byte_view(st.kda)), crc32c(byte_view(st.mla))
        rx.store.recycle(st)
        return out

    def socket_listen(conns: int, nbytes: int) -> int:
        sinks["socket"] = SocketSink(config.host, conns, nbytes)
        return sinks["socket"].port

    def grpc_listen(keep: bool = False) -> int:
        """A bare gRPC sink's port (keep: one that holds what it received until the next listen)."""
        key = "grpc_keep" if keep else "grpc"
        if key not in sinks:
            sinks[key] = GrpcSink(config.host, keep=keep)
        sinks[key].reset()
        sinks["grpc_last"] = sinks[key]
        return sinks[key].port

    def mooncake_listen(spec: TransferSpec) -> tuple[str, int, int]:
        """Raw Mooncake baseline: staging-shaped kda + mla buffers in a second registered region (no transfer
        state, no CRC, no control stream); the same addresses layout as staging."""
        from k3serve.transfer.buffers import RegionBuffers

        g = spec.geometry
        shapes = ((g.kda_shape(config.tp), torch.float32), (g.mla_shape(), DTYPES[g.mla_dtype]))
        need = sum(-(-(torch.Size(sh).numel() * torch.empty((), dtype=dt).element_size()) // 4096) * 4096
                   for sh, dt in shapes)
        sink = sinks.get("mooncake_region")
        if sink is None or sink.size < need:
            sink = sinks["mooncake_region"] = RegionBuffers(need, quarantine_s=0.0)
            plane.register(sink)
        sink.close()  # forget the previous run's ranges
        sinks["mooncake"] = tuple(sink.alloc(sh, dt) for sh, dt in shapes)
        return plane.segment, sinks["mooncake"][0].data_ptr(), sinks["mooncake"][1].data_ptr()

    def mooncake_digest() -> tuple[int, int]:
        kda, mla = sinks["mooncake"]
        return crc32c(byte_view(kda)), crc32c(byte_view(mla))

    conn.send(("ok", rx.endpoint))
    try:
        _serve(conn, {"digest": digest, "occupancy": rx.store.occupancy, "status": rx.store.status,
                      "counters": lambda: rx.store.counters, "cpu": time.process_time,
                      "mooncake_listen": mooncake_listen, "mooncake_digest": mooncake_digest,
                      "region_used": lambda: rx.store.region.used_bytes if rx.store.region else 0,
                      "registrations": lambda: plane.registrations if plane else 0,
                      "socket_listen": socket_listen, "socket_wait": lambda t: sinks["socket"].wait(t),
                      "grpc_listen": grpc_listen, "grpc_received": lambda: sinks["grpc_last"].received})
    finally:
        for key in ("grpc", "grpc_keep"):
            if key in sinks:
                sinks[key].close()
        rx.stop(0)
        if plane is not None:
            plane.close()


class ReceiverProc(_Proc):
    def __init__(self, config: ReceiverConfig, mooncake: MooncakeConfig | None = None) -> None:
        super().__init__(_receiver_main, config, mooncake)
        self.endpoint: str = self.ready
