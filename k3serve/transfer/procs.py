"""Sender and receiver processes driven over a pipe: loopback tests and the transfer bench.

```
 driver ──pipe──▶ SenderProc (one per prefill rank): load(key, kda, mla); send(SendJob) -> SendResult | failure
        │                                            socket_send(job): the same bytes over a raw TCP socket
        └─pipe──▶ ReceiverProc (one per decode rank): a TransferReceiver; digest(tid) (verified state's CRCs,
                                                       then dropped), occupancy; socket sink for the baseline
 both: cpu() -> the process's CPU seconds so far (all threads), for the bench's time shares
```
Processes are spawned (fresh interpreters, one torch thread each). A command's reply is ("ok", value) or
("error", traceback); a dead process reads as EOF and raises ProcDied.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from k3serve.transfer.chunks import all_layers, stream_plan
from k3serve.transfer.faults import NO_FAULTS, SenderFaults
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SenderConfig, TransferFailed, TransferSender
from k3serve.transfer.spec import TransferSpec
from k3serve.transfer.wire import byte_view, crc32c

_HDR = struct.Struct("<Q")


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
        with TransferSender(job.rank, job.endpoints, job.config, job.faults) as sender:
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

    def socket_send(job: SendJob, ports: tuple[int, ...], host: str) -> float:
        """The same bytes as send(job), raw: one TCP connection per decode rank, in parallel threads."""
        kda, mla = states[job.key]
        views = {"kda": byte_view(kda), "mla": byte_view(mla)}

        def one(dst: int) -> None:
            plan = stream_plan(job.spec, job.rank, dst)
            with socket.create_connection((host, ports[dst])) as s:
                s.sendall(_HDR.pack(sum(c.length for c in plan)))
                for c in plan:
                    s.sendall(memoryview(views[c.kind][c.src_byte: c.src_byte + c.length]))
                s.recv(1)  # the sink's "all received"

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(d,)) for d in range(job.spec.decode_tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    conn.send(("ok", None))
    _serve(conn, {"load": load, "send": send, "socket_send": socket_send, "cpu": time.process_time})


class SenderProc(_Proc):
    def __init__(self) -> None:
        super().__init__(_sender_main)


# ---------------------------------------------------------------------------------------------- receiver
def _receiver_main(conn, config: ReceiverConfig) -> None:
    torch.set_num_threads(1)
    rx = TransferReceiver(config)
    sink: dict[str, object] = {}

    def digest(tid: str) -> tuple[int, int]:
        """CRC32C of the verified state's KDA and MLA bytes; the staging is dropped (as an install would)."""
        st = rx.store.take(tid)
        out = crc32c(byte_view(st.kda)), crc32c(byte_view(st.mla))
        rx.store.recycle(st)
        return out

    def socket_listen(conns: int, nbytes: int) -> int:
        """A raw TCP sink for `conns` connections of length-prefixed bytes, received into one buffer."""
        buf = torch.empty(max(1, nbytes), dtype=torch.uint8).numpy()
        buf[:] = 0  # touch the pages now, not while timing
        ls = socket.create_server((config.host, 0))
        sink.update(listener=ls, done=threading.Event(), got=[0])
        offsets = [0]
        lock = threading.Lock()

        def serve() -> None:
            def one(c: socket.socket) -> None:
                with c:
                    n = _HDR.unpack(c.recv(_HDR.size, socket.MSG_WAITALL))[0]
                    with lock:
                        off = offsets[0]
                        offsets[0] += n
                    view, end = memoryview(buf)[off: off + n], 0
                    while end < n:
                        k = c.recv_into(view[end:])
                        if not k:
                            break
                        end += k
                    with lock:
                        sink["got"][0] += end
                    c.sendall(b"k")

            threads = []
            for _ in range(conns):
                c, _ = ls.accept()
                threads.append(threading.Thread(target=one, args=(c,)))
                threads[-1].start()
            for t in threads:
                t.join()
            sink["done"].set()

        threading.Thread(target=serve, daemon=True).start()
        return ls.getsockname()[1]

    def socket_wait(timeout: float) -> int:
        sink["done"].wait(timeout)
        sink["listener"].close()
        return sink["got"][0]

    conn.send(("ok", rx.endpoint))
    try:
        _serve(conn, {"digest": digest, "occupancy": rx.store.occupancy, "status": rx.store.status,
                      "counters": lambda: rx.store.counters, "socket_listen": socket_listen,
                      "socket_wait": socket_wait, "cpu": time.process_time})
    finally:
        rx.stop(0)


class ReceiverProc(_Proc):
    def __init__(self, config: ReceiverConfig) -> None:
        super().__init__(_receiver_main, config)
        self.endpoint: str = self.ready
