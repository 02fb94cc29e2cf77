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

from k3serve.bench.transfer_baselines import GrpcSink, SocketSink, grpc_source, socket_source
from k3serve.transfer.chunks import all_layers, stream_plan
from k3serve.bench.transfer_faults import NO_FAULTS, SenderFaults
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SenderConfig, TransferFailed, TransferSender
from k3serve.transfer.spec import TransferSpec
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

    def load(key: str, kda: torch.Tensor, mla: torch.Tensor) -> None:
        states[key] = (kda.contiguous().clone(), mla.contiguous().clone())  # private memory, like a prefill rank

    def send(job: SendJob):
        kda, mla = states[job.key]
        with TransferSender(job.rank, job.endpoints, job.config, job.faults if job.faults.any else None) as sender:
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

    def pieces(job: SendJob) -> list[list]:
        """Per decode rank, the byte views send(job) would stream there (the baselines move the same bytes)."""
        views = {"kda": byte_view(states[job.key][0]), "mla": byte_view(states[job.key][1])}
        return [[views[c.kind][c.src_byte: c.src_byte + c.length] for c in stream_plan(job.spec, job.rank, d)]
                for d in range(job.spec.decode_tp)]

    conn.send(("ok", None))
    _serve(conn, {"load": load, "send": send, "cpu": time.process_time,
                  "socket_send": lambda job, ports, host: socket_source(host, ports, pieces(job)),
                  "grpc_send": lambda job, ports, host: grpc_source(host, ports, pieces(job))})


class SenderProc(_Proc):
    def __init__(self) -> None:
        super().__init__(_sender_main)


# ---------------------------------------------------------------------------------------------- receiver
def _receiver_main(conn, config: ReceiverConfig) -> None:
    torch.set_num_threads(1)
    rx = TransferReceiver(config)
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

    def grpc_listen() -> int:
        if "grpc" not in sinks:
            sinks["grpc"] = GrpcSink(config.host)
        sinks["grpc"].reset()
        return sinks["grpc"].port

    conn.send(("ok", rx.endpoint))
    try:
        _serve(conn, {"digest": digest, "occupancy": rx.store.occupancy, "status": rx.store.status,
                      "counters": lambda: rx.store.counters, "cpu": time.process_time,
                      "socket_listen": socket_listen, "socket_wait": lambda t: sinks["socket"].wait(t),
                      "grpc_listen": grpc_listen, "grpc_received": lambda: sinks["grpc"].received})
    finally:
        if "grpc" in sinks:
            sinks["grpc"].close()
        rx.stop(0)


class ReceiverProc(_Proc):
    def __init__(self, config: ReceiverConfig) -> None:
        super().__init__(_receiver_main, config)
        self.endpoint: str = self.ready
