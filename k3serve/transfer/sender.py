"""A prefill rank's sender: streams its share of a request's state to every decode rank, in parallel.

```
 TransferSender(rank p, endpoints of decode ranks 0..D-1)
   session = sender.begin(spec, kda [L_kda, H/P, block] fp32, mla [L_mla, n, D])   one thread + stream per dst
   session.layer_ready("kda", 0) ...        a layer's chunks leave as soon as that layer is final
   session.layer_ready("mla", 2)            (or session.all_ready())
   result = session.finish()                manifests sent, acks in; TransferFailed on a clean failure
```
Payloads are memoryview slices of the state tensors (``chunks.py`` gives the byte offsets), joined once into
the gRPC message. With ``SenderConfig.crc_ahead`` their CRC32Cs are computed ahead on the sender's CRC workers
(google_crc32c releases the GIL), so a stream thread frames chunk i while grpcio sends chunk i-1 and a worker
CRCs chunks i+1, i+2 (``CRC_LOOKAHEAD``); off (the default) the stream thread CRCs each chunk, then frames it.
Each stream attempt has a deadline; a failed attempt with a retryable code is replayed from
its first chunk after an exponential backoff (the receiver rewrites identical bytes; a verified transfer is
acknowledged as a duplicate). A stream that fails for good aborts the session's other streams and cancels the
transfer on every receiver, so no staging is left behind; the caller retries with a new transfer id.
The tensors must not change until finish() returns.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.auth import AuthConfig, sign
from k3serve.transfer.chunks import KDA, MLA, ChunkRef, all_layers, by_layer, stream_plan
from k3serve.transfer.client import ReceiverClient, open_channel
from k3serve.transfer.memory import tune_allocator
from k3serve.transfer.receiver import PUSH
from k3serve.transfer.spec import DTYPES, TransferSpec
from k3serve.transfer.staging import INSTALLED, VERIFIED
from k3serve.transfer.wire import STATE_NAMES, byte_view, chunk_header, crc32c, digest_crcs, encode, encode_chunk, \
    spec_to_pb

CRC_LOOKAHEAD = 2  # chunks whose CRC32C a stream's worker computes ahead of the one it frames (crc_ahead)
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS,
                       grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class SenderConfig:
    auth: AuthConfig
    max_attempts: int = 4
    backoff_s: float = 0.05  # first retry delay; doubles per attempt (with jitter) up to backoff_max_s
    backoff_max_s: float = 1.0
    stream_timeout_s: float = 60.0  # deadline of one Push attempt (from its open to its ack)
    rpc_timeout_s: float = 5.0  # deadline of Cancel / Status
    # CRC32C of the source on the sender's CRC workers, ahead of the streams; off: inline in the stream thread
    # (no gain where no core is idle: docs/transfer.md)
    crc_ahead: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.stream_timeout_s <= 0 or self.rpc_timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"invalid sender config: {self}")


class TransferFailed(RuntimeError):
    """A transfer that could not be completed; its staging was cancelled on every reachable receiver."""

    def __init__(self, transfer_id: str, code: str, message: str, dst_rank: int | None = None) -> None:
        super().__init__(f"transfer {transfer_id}: {code}: {message}")
        self.transfer_id, self.code, self.message, self.dst_rank = transfer_id, code, message, dst_rank


@dataclass(frozen=True)
class StreamResult:
    dst_rank: int
    state: str  # the receiver's view after this stream: "verified" (this stream completed it) or "receiving"
    duplicate: bool
    attempts: int
    chunks_applied: int


@dataclass(frozen=True)
class SendResult:
    transfer_id: str
    src_rank: int
    streams: tuple[StreamResult, ...]
    bytes_sent: int  # payload bytes of the successful attempts
    wall_s: float
    crc_s: float  # CPU seconds (thread time, all streams) computing CRC32C
    encode_s: float  # CPU seconds framing messages (the one copy of each payload)

    @property
    def verified_ranks(self) -> frozenset[int]:
        return frozenset(s.dst_rank for s in self.streams if s.state in (VERIFIED, INSTALLED))


class StreamTap(Protocol):
    """A hook on a sender's streams, for fault injection in tests and benches (benchmarks/transfer_faults.py).
    Off the hot path: a sender without one checks a single None per stream."""

    def active(self, attempt: int, dst: int) -> bool:
        """Whether this attempt's stream to decode rank `dst` is tapped."""

    def inject(self, index: int, chunk: ChunkRef, data: bytes, cancel_stream: Callable[[], None],
               pause: Callable[[float], object]) -> bytes | None:
        """Chunk `index` (encoded `data`) is about to go out: return what to send, or None to end the stream."""


class TransferSender:
    """One prefill rank's channels to a decode group (endpoints in decode-rank order)."""

    def __init__(self, rank: int, endpoints: Sequence[str], config: SenderConfig,
                 faults: StreamTap | None = None) -> None:
        if not endpoints:
            raise ValueError("a sender needs the decode group's receiver endpoints")
        tune_allocator()  # process-wide: message buffers reuse warm heap pages (memory.py)
        self.rank, self.endpoints, self.config, self.faults = rank, tuple(endpoints), config, faults
        self._channels = [open_channel(e, config.auth) for e in self.endpoints]
        self._push = [c.stream_unary(PUSH, None, pb.PushAck.FromString) for c in self._channels]
        self._client = ReceiverClient(self.endpoints, config.auth, config.rpc_timeout_s)
        # CRC32C of the source chunks, ahead of the stream threads (one worker per decode rank's stream)
        self._crc_pool = ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix=f"transfer-crc{rank}")

    def begin(self, spec: TransferSpec, kda: torch.Tensor, mla: torch.Tensor) -> "SendSession":
        return SendSession(self, spec, kda, mla)

    def send(self, spec: TransferSpec, kda: torch.Tensor, mla: torch.Tensor,
             timeout: float | None = None) -> SendResult:
        """The whole state at once (every layer already final)."""
        session = self.begin(spec, kda, mla)
        session.all_ready()
        return session.finish(timeout)

    def cancel(self, transfer_id: str) -> list[bool | None]:
        return self._client.cancel(transfer_id)

    def close(self) -> None:
        self._client.close()
        for c in self._channels:
            c.close()
        self._crc_pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "TransferSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SendSession:
    def __init__(self, sender: TransferSender, spec: TransferSpec, kda: torch.Tensor, mla: torch.Tensor) -> None:
        g, rank = spec.geometry, sender.rank
        if len(sender.endpoints) != spec.decode_tp or not 0 <= rank < spec.prefill_tp:
            raise ValueError(f"sender rank {rank} with {len(sender.endpoints)} endpoints cannot serve "
                             f"P={spec.prefill_tp} -> D={spec.decode_tp}")
        for name, t, shape, dtype in (("kda", kda, g.kda_shape(spec.prefill_tp), torch.float32),
                                      ("mla", mla, g.mla_shape(), DTYPES[g.mla_dtype])):
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {shape} {dtype} tensor, got {tuple(t.shape)} "
                                 f"{t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")
        self.sender, self.spec, self._t0 = sender, spec, time.perf_counter()
        self._views = {KDA: byte_view(kda), MLA: byte_view(mla)}
        self._spec_pb = spec_to_pb(spec)
        self._plans = {d: stream_plan(spec, rank, d) for d in range(spec.decode_tp)}
        self._groups = {d: by_layer(p) for d, p in self._plans.items()}
        self._ready: dict[int, list[ChunkRef]] = {d: [] for d in self._plans}
        self._marked: set[tuple[str, int]] = set()
        self._all_marked = False
        self._cond = threading.Condition()
        self._aborted = threading.Event()
        # (kind, src_byte, length) -> the chunk's CRC32C job, shared by streams (MLA rows go to every decode rank)
        self._crcs: dict[tuple[str, int, int], Future] = {}
        self._crc_lock = threading.Lock()
        # chunks CRC'd ahead of the one being framed: a few, so a chunk's bytes are still in the last-level cache
        # when the frame copies them (a CRC pass over the whole state first would read it from memory twice)
        self._lookahead = CRC_LOOKAHEAD if sender.config.crc_ahead else 0
        self._calls: dict[int, grpc.Future] = {}
        self._stats = {d: [0.0, 0.0, 0] for d in self._plans}  # crc_s, encode_s, bytes (per stream thread)
        self._results: dict[int, StreamResult] = {}
        self._failure: TransferFailed | None = None
        self._rng = random.Random()  # backoff jitter
        self._threads = [threading.Thread(target=self._run_stream, args=(d,), daemon=True,
                                          name=f"transfer-tx{rank}->{d}") for d in self._plans]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------------- public API
    def layer_ready(self, kind: str, layer: int) -> None:
        """Layer `layer` of `kind` ("kda" | "mla") is final: its chunks may leave now."""
        key = (kind, layer)
        if key not in all_layers(self.spec):
            raise ValueError(f"no {kind} layer {layer} in this transfer")
        with self._cond:
            if key in self._marked:
                raise ValueError(f"{kind} layer {layer} was already marked ready")
            self._marked.add(key)
            for d, groups in self._groups.items():
                self._ready[d].extend(groups.get(key, ()))
            self._all_marked = len(self._marked) == len(all_layers(self.spec))
            self._cond.notify_all()

    def all_ready(self) -> None:
        for kind, layer in all_layers(self.spec):
            if (kind, layer) not in self._marked:
                self.layer_ready(kind, layer)

    def finish(self, timeout: float | None = None) -> SendResult:
        """Wait for every stream's ack. Raises TransferFailed (staging cancelled everywhere) on failure."""
        if not self._all_marked:
            raise ValueError("finish() before every layer was marked ready")
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads) and self._failure is None:
            self._fail(TransferFailed(self.spec.transfer_id, "DEADLINE_EXCEEDED", f"not done within {timeout} s"))
        if self._failure is not None:
            for t in self._threads:
                t.join(self.sender.config.stream_timeout_s)
            self._stop_crcs()
            self.sender.cancel(self.spec.transfer_id)
            raise self._failure
        crc_s, enc_s, nbytes = (sum(s[i] for s in self._stats.values()) for i in range(3))
        return SendResult(self.spec.transfer_id, self.sender.rank, tuple(self._results[d] for d in self._plans),
                          int(nbytes), time.perf_counter() - self._t0, crc_s, enc_s)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Stop every stream and cancel the transfer on the receivers."""
        self._fail(TransferFailed(self.spec.transfer_id, "CANCELLED", reason))
        for t in self._threads:
            t.join(self.sender.config.stream_timeout_s)
        self._stop_crcs()
        self.sender.cancel(self.spec.transfer_id)

    # -------------------------------------------------------------------------------------- internals
    def _fail(self, failure: TransferFailed) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = failure
            self._aborted.set()
            self._cond.notify_all()
            calls = list(self._calls.values())
        for c in calls:
            c.cancel()

    def _run_stream(self, dst: int) -> None:
        cfg, tid = self.sender.config, self.spec.transfer_id
        for attempt in range(1, cfg.max_attempts + 1):
            if self._aborted.is_set():
                return
            try:
                ack = self._attempt(dst, attempt)
                self._results[dst] = StreamResult(dst, STATE_NAMES.get(ack.state, "unknown"), ack.duplicate, attempt,
                                                  ack.chunks_applied)
                return
            except grpc.FutureCancelledError:
                code, details = grpc.StatusCode.CANCELLED, "stream cut"
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
            except Exception as e:  # noqa: BLE001 - a bug here must fail the transfer, not hang finish()
                self._fail(TransferFailed(tid, "INTERNAL", f"stream {self.sender.rank}->{dst}: {e!r}", dst))
                return
            if self._aborted.is_set():
                return
            if code not in RETRYABLE or attempt == cfg.max_attempts:
                self._fail(TransferFailed(tid, code.name, f"stream {self.sender.rank}->{dst} "
                                          f"({self.sender.endpoints[dst]}) failed after {attempt} attempt(s): "
                                          f"{details}", dst))
                return
            delay = min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1)) * (0.5 + self._rng.random())
            if self._aborted.wait(delay):
                return

    def _attempt(self, dst: int, attempt: int) -> pb.PushAck:
        started = threading.Event()
        holder: dict[str, grpc.Future] = {}
        messages = self._messages(dst, attempt, holder, started)
        call = self.sender._push[dst].future(messages, timeout=self.sender.config.stream_timeout_s,
                                             metadata=sign(self.sender.config.auth, PUSH, self.spec.transfer_id))
        holder["call"] = call
        with self._cond:
            self._calls[dst] = call
            if self._aborted.is_set():
                call.cancel()
        started.set()
        return call.result()

    def _crc_job(self, c: ChunkRef, dst: int) -> Future:
        """The CRC32C of chunk `c`'s source bytes, computed once per session on a CRC worker."""
        key, ahead = (c.kind, c.src_byte, c.length), self.sender.config.crc_ahead
        view = self._views[c.kind][c.src_byte: c.src_byte + c.length]
        with self._crc_lock:
            job, mine = self._crcs.get(key), False
            if job is None:
                job = self._crcs[key] = self.sender._crc_pool.submit(self._timed_crc, view, dst) if ahead else Future()
                mine = True
        if mine and not ahead:  # inline, in this stream's thread (another stream of the chunk waits for it)
            job.set_result(self._timed_crc(view, dst))
        return job

    def _timed_crc(self, view, dst: int) -> int:
        t0 = time.thread_time()
        crc = crc32c(view)
        dt = time.thread_time() - t0
        with self._crc_lock:
            self._stats[dst][0] += dt
        return crc

    def _manifest_crcs(self, dst: int) -> list[int]:
        return [self._crcs[(c.kind, c.src_byte, c.length)].result() for c in self._plans[dst]]

    def _stop_crcs(self) -> None:
        """A failed or aborted session: no CRC job may read the tensors once the caller gets control back."""
        with self._crc_lock:
            jobs = list(self._crcs.values())
        for j in jobs:
            j.cancel()
        wait(jobs)

    def _next_ready(self, dst: int, i: int):
        """Wait until stream `dst` has chunks past its first `i` (or every chunk is marked): (the new chunks,
        whether they end the stream); None when the session was aborted. Shared by every plane's stream."""
        with self._cond:
            while len(self._ready[dst]) == i and not self._all_marked and not self._aborted.is_set():
                self._cond.wait()
            if self._aborted.is_set():
                return None
            batch = self._ready[dst][i:]
            return batch, self._all_marked and i + len(batch) == len(self._ready[dst])

    def _messages(self, dst: int, attempt: int, holder: dict, started: threading.Event):
        """Open, then every ready chunk in the order layers became ready, then the manifest."""
        spec, faults, stats = self.spec, self.sender.faults, self._stats[dst]
        faulty = faults is not None and faults.active(attempt, dst)
        yield encode(pb.PushMessage(open=pb.StreamOpen(spec=self._spec_pb, src_rank=self.sender.rank, dst_rank=dst,
                                                       attempt=attempt)))
        sent, i, nbytes = [], 0, 0
        while True:
            ready = self._next_ready(dst, i)
            if ready is None:
                return
            batch, last = ready
            jobs: dict[int, Future] = {}
            for j, c in enumerate(batch):
                for k in range(j, min(j + 1 + self._lookahead, len(batch))):
                    if k not in jobs:
                        jobs[k] = self._crc_job(batch[k], dst)
                crc = jobs.pop(j).result()
                t0 = time.thread_time()
                data = encode_chunk(chunk_header(spec, c, crc), self._views[c.kind][c.src_byte: c.src_byte + c.length])
                stats[1] += time.thread_time() - t0
                if faulty:
                    data = faults.inject(i, c, data, lambda: started.wait(5.0) and holder["call"].cancel(),
                                         self._aborted.wait)
                    if data is None:
                        return
                sent.append(c)
                i += 1
                nbytes += c.length
                yield data
            if last:
                break
        crcs = self._manifest_crcs(dst)
        stats[2] = nbytes
        yield encode(pb.PushMessage(manifest=pb.Manifest(
            transfer_id=spec.transfer_id, src_rank=self.sender.rank, dst_rank=dst, num_chunks=len(sent),
            num_bytes=nbytes, crc32c=digest_crcs(crcs))))
