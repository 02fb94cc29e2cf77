"""Baselines for the transfer bench: the same byte ranges over a raw TCP socket, and over bare gRPC.

```
 socket:    one TCP connection per (prefill rank, decode rank): 8-byte length, then the chunks' bytes
            (sendall of memoryviews, no copy); the sink recv_into()s one preallocated, pre-touched buffer
 bare gRPC: one client stream per (prefill rank, decode rank) of raw bytes messages, one per chunk
            (bytes(view): the one copy gRPC's Python API needs); the sink only counts bytes. No CRC, no
            plan checks, no staging: the cost of the gRPC stack itself
 bare gRPC, kept: the same, but the sink keeps every message until the repetition ends, as any receiver
            that stages what it got must (the bare sink drops each message, so gRPC refills one warm
            block; keeping them means a GB lands in memory that stays): the floor of a staging receiver
 raw Mooncake: the planned byte ranges written by the engine from registered memory straight to the same
            offsets of a registered sink on the receiver, one thread per decode rank, the same batches as our
            Mooncake sender, two in flight at a time (at least the overlap of our sender, which starts the next
            write while a landed batch's headers go out): no CRC, no control stream, no staging state (the
            engine's own cost)
```
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

_HDR = struct.Struct("<Q")
_RAW_METHOD = "/k3serve.transfer.bench.Raw/Push"


def _parallel(fn, items) -> None:
    threads = [threading.Thread(target=fn, args=(i,)) for i in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class SocketSink:
    """Accepts `conns` connections on (host, any port) and receives their bytes into one buffer."""

    def __init__(self, host: str, conns: int, nbytes: int) -> None:
        self._buf = np.zeros(max(1, nbytes), dtype=np.uint8)  # np.zeros + fill: pages touched before timing
        self._buf.fill(1)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock, self._next, self.received = threading.Lock(), 0, 0
        self._done = threading.Event()
        threading.Thread(target=self._serve, args=(conns,), daemon=True).start()

    def _serve(self, conns: int) -> None:
        accepted = [self._listener.accept()[0] for _ in range(conns)]
        _parallel(self._one, accepted)
        self._done.set()

    def _one(self, c: socket.socket) -> None:
        with c:
            n = _HDR.unpack(c.recv(_HDR.size, socket.MSG_WAITALL))[0]
            with self._lock:
                off, self._next = self._next, self._next + n
            view, end = memoryview(self._buf)[off: off + n], 0
            while end < n:
                k = c.recv_into(view[end:])
                if not k:
                    break
                end += k
            with self._lock:
                self.received += end
            c.sendall(b"k")

    def wait(self, timeout: float) -> int:
        self._done.wait(timeout)
        self._listener.close()
        return self.received


def socket_source(host: str, ports: Sequence[int], pieces: Sequence[Sequence[np.ndarray]]) -> None:
    """pieces[d]: the uint8 views to send to decode rank d, in order (one connection each, in parallel)."""
    def one(d: int) -> None:
        with socket.create_connection((host, ports[d])) as s:
            s.sendall(_HDR.pack(sum(p.nbytes for p in pieces[d])))
            for p in pieces[d]:
                s.sendall(memoryview(p))
            s.recv(1)  # the sink's "all received"

    _parallel(one, range(len(ports)))


class GrpcSink:
    """A bare gRPC server (no auth, no checks) whose one client-streaming method counts received bytes."""

    def __init__(self, host: str, max_message: int = 64 << 20, keep: bool = False) -> None:
        """keep: hold every received message until reset() (a staging receiver's memory traffic)."""
        self._lock, self.received, self.keep, self._kept = threading.Lock(), 0, keep, []
        self._server = grpc.server(ThreadPoolExecutor(max_workers=16),
                                   options=[("grpc.max_receive_message_length", max_message)])
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            _RAW_METHOD.split("/")[1], {"Push": grpc.stream_unary_rpc_method_handler(self._push)}),))
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()

    def _push(self, messages, context) -> bytes:
        kept = list(messages) if self.keep else ()
        n = sum(len(m) for m in kept) if self.keep else sum(len(m) for m in messages)
        with self._lock:
            self.received += n
            self._kept.append(kept)
        return b""

    def reset(self) -> None:
        with self._lock:
            self.received, self._kept = 0, []

    def close(self) -> None:
        self._server.stop(0).wait()


def grpc_source(host: str, ports: Sequence[int], pieces: Sequence[Sequence[np.ndarray]],
                max_message: int = 64 << 20, channels: dict[str, grpc.Channel] | None = None) -> None:
    """One bare gRPC stream per decode rank (in parallel), one bytes message per piece.

    channels: where to keep the channels between calls (the caller closes them); None: one per call."""
    def one(d: int) -> None:
        target = f"{host}:{ports[d]}"
        ch = channels.get(target) if channels is not None else None
        if ch is None:
            ch = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", max_message)])
            if channels is not None:
                channels[target] = ch
        try:
            ch.stream_unary(_RAW_METHOD)((p.tobytes() for p in pieces[d]), timeout=600)
        finally:
            if channels is None:
                ch.close()

    _parallel(one, range(len(ports)))


def mooncake_source(plane, targets: Sequence[tuple[str, int, int]], plans: Sequence[Sequence],
                    src_bases: dict[str, int], batch_bytes: int) -> None:
    """plans[d]: this rank's ChunkRefs to decode rank d; targets[d]: (segment, kda addr, mla addr) there."""
    def one(d: int) -> None:
        segment, kda, mla = targets[d]
        dst_bases = {"kda": kda, "mla": mla}
        batches, ops, size = [], [], 0
        for c in plans[d]:  # batches cut like LandingSession._batches
            if ops and size + c.length > batch_bytes:
                batches.append(ops)
                ops, size = [], 0
            ops.append((src_bases[c.kind] + c.src_byte, dst_bases[c.kind] + c.dst_byte, c.length))
            size += c.length
        batches.append(ops)
        # two batches in flight (the next submitted before the previous is waited for): at least the overlap
        # our sender gets, whose next write starts while a landed batch's headers go out
        job = plane.submit(segment, batches[0])
        for nxt in batches[1:]:
            following = plane.submit(segment, nxt)
            plane.wait(job)
            job = following
        plane.wait(job)

    _parallel(one, range(len(targets)))
