"""A prefill rank's sender over the Mooncake data plane: gRPC keeps control, the engine moves the payload.

```
 per (prefill rank p, decode rank d) stream, per attempt:
   Open(spec, p, d)  ──gRPC──▶ receiver: staging ranges in its registered region -> (segment, kda_addr, mla_addr)
   for each ready batch of chunks (~batch_bytes):
       each range AES-GCM-encrypted once from private memory into send_region + chunk.src_byte (chunk_seal.py)
       engine write  src = send_region + chunk.src_byte  ──▶  dst = kda_addr|mla_addr + chunk.dst_byte
       CRC32C of the private source bytes (while the write flies)
       (the next batch's engine write was started before this one is waited for: two in flight)
       Push stream ◀── the batch's chunk headers (nonce + tag, no payload): the receiver decrypts what landed
   Push: manifest  ──▶  verified when every prefill rank's manifest matched (as on the gRPC plane)
```
A foreign engine peer can read and write the send and landing regions: both hold only ciphertext, encrypted from
the private source (the tensors as given; layer-wise, the worker's host buffers) and decrypted into the
receiver's private copy, so no read sees the state and no rewrite in either region passes. The resharding is
the address arithmetic of chunks.py (dst_byte at the decode rank's local head offset). Retries, backoff,
deadlines, abort and cancel are the gRPC sender's (sender.py): a failed engine write is UNAVAILABLE (retried), a duplicate Open (VERIFIED / INSTALLED) writes nothing.
The state is encrypted once into ranges of this process' registered send region (registered once, like the
staging region); the plaintext never enters it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc
import torch

from k3serve.auth import sign
from k3serve.transfer import chunk_seal
from k3serve.transfer.buffers import RegionBuffers
from k3serve.transfer.chunks import KDA, MLA, ChunkRef
from k3serve.transfer.mooncake.plane import DataPlane, DataPlaneError
from k3serve.transfer.receiver import OPEN, PUSH
from k3serve.transfer.sender import SenderConfig, SendSession, TransferFailed, TransferSender
from k3serve.transfer.staging import INSTALLED, VERIFIED
from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.wire import STATE_CODES, byte_view, chunk_header, digest_crcs, encode

_DUPLICATE = frozenset({STATE_CODES[VERIFIED], STATE_CODES[INSTALLED]})


class LandingTap(Protocol):
    """Fault injection on a data-plane stream (benchmarks/transfer_faults.py SenderFaults)."""

    def active(self, attempt: int, dst: int) -> bool: ...

    def landed(self, index: int, chunk: ChunkRef, corrupt: Callable[[], None], cancel_stream: Callable[[], None],
               pause: Callable[[float], object]) -> bool:
        """Chunk `index` landed, its header is next: corrupt() flips its first landed byte; False ends the
        stream (after cancel_stream())."""


class PlaneFailure(grpc.RpcError):
    """An engine write that failed: UNAVAILABLE to the retry logic (the receiver may have gone)."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class MooncakeSender(TransferSender):
    """One prefill rank's control channels to a decode group plus this process' data plane and send region."""

    def __init__(self, rank: int, endpoints: Sequence[str], config: SenderConfig, plane: DataPlane,
                 region: RegionBuffers, faults: LandingTap | None = None, batch_bytes: int = 4 << 20) -> None:
        super().__init__(rank, endpoints, config, faults)
        plane.register(region)  # once per region: a no-op for every sender after the first
        self.plane, self.region, self.batch_bytes = plane, region, batch_bytes
        self._open = [c.unary_unary(OPEN, pb.StreamOpen.SerializeToString, pb.OpenReply.FromString)
                      for c in self._channels]
        self._scratch = region.alloc((4096,), torch.uint8)  # fault injection: one flipped byte per stream
        if self._scratch is None:
            raise DataPlaneError("the send region has no room for a 4 KiB scratch range")

    def begin(self, spec, kda: torch.Tensor, mla: torch.Tensor,
              sealed_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> "LandingSession":
        """sealed_from: the private (kda, mla) to encrypt into `kda` / `mla`, ranges of the send region the caller
        owns (a layer-wise send's host buffers); default: `kda` / `mla` are private and encrypted into new ranges."""
        return LandingSession(self, spec, kda, mla, sealed_from)

    def close(self) -> None:
        if self._scratch is not None:
            self.region.release(self._scratch.zero_(), False)
            self._scratch = None
        super().close()


class LandingSession(SendSession):
    def __init__(self, sender: MooncakeSender, spec, kda: torch.Tensor, mla: torch.Tensor,
                 sealed_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._owned: list[torch.Tensor] = []
        self.sender = sender
        self._seal_lock = threading.Lock()
        self._seals: dict[tuple[str, int, int], bytes] = {}  # (kind, src_byte, length) -> seal: encrypted once
        try:
            if sealed_from is None:  # private tensors as given: ciphertext goes to ranges of our own
                kda, mla = kda.contiguous(), mla.contiguous()
                sealed_from = (kda, mla)
                out = (self._alloc(spec, kda), self._alloc(spec, mla))
            else:
                out = (kda, mla)
            self._cipher = {KDA: byte_view(out[0]), MLA: byte_view(out[1])}  # in the send region
            self._src = {KDA: out[0].data_ptr(), MLA: out[1].data_ptr()}
            # the base session's views (CRC32C) are the private source; the region is never plaintext
            super().__init__(sender, spec, sealed_from[0], sealed_from[1])  # validates shapes, starts the streams
        except BaseException:
            self._release()
            raise

    def _alloc(self, spec, t: torch.Tensor) -> torch.Tensor:
        region = self.sender.region
        out = region.alloc(tuple(t.shape), t.dtype)
        if out is None:
            raise TransferFailed(spec.transfer_id, "RESOURCE_EXHAUSTED", f"send region full: no room for "
                                 f"{t.numel() * t.element_size()} bytes (mooncake.send_bytes {region.size})")
        self._owned.append(out)
        return out

    def _release(self) -> None:
        for t in self._owned:  # ciphertext, wiped all the same
            t.zero_()
            self.sender.region.release(t, False)  # our own memory: the engine reads it only inside write()
        self._owned = []

    def finish(self, timeout: float | None = None):
        try:
            return super().finish(timeout)
        finally:
            self._release()

    def abort(self, reason: str = "aborted by the caller") -> None:
        try:
            super().abort(reason)
        finally:
            self._release()

    # ------------------------------------------------------------------------------------- one attempt
    def _attempt(self, dst: int, attempt: int) -> pb.PushAck:
        sender, tid = self.sender, self.spec.transfer_id
        msg = pb.StreamOpen(spec=self._spec_pb, src_rank=sender.rank, dst_rank=dst, attempt=attempt, landed=True)
        reply = sender._open[dst](msg, timeout=sender.config.rpc_timeout_s,
                                  metadata=sign(sender.config.auth, OPEN, tid, msg))
        if reply.state in _DUPLICATE:  # verified or installed already: write nothing
            return pb.PushAck(transfer_id=tid, src_rank=sender.rank, dst_rank=dst, state=reply.state,
                              duplicate=True)
        started = threading.Event()
        holder: dict[str, object] = {"open": reply}
        call = sender._push[dst].future(self._messages(dst, attempt, holder, started),
                                        timeout=sender.config.stream_timeout_s,
                                        metadata=sign(sender.config.auth, PUSH, tid))
        holder["call"] = call
        with self._cond:
            self._calls[dst] = call
            if self._aborted.is_set():
                call.cancel()
        started.set()
        try:
            return call.result()
        except (grpc.RpcError, grpc.FutureCancelledError):
            if "error" in holder:
                raise PlaneFailure(str(holder["error"])) from None
            raise

    def _batches(self, chunks: list[ChunkRef], one_by_one: bool) -> list[list[ChunkRef]]:
        out, cur, size = [], [], 0
        for c in chunks:
            if cur and (one_by_one or size + c.length > self.sender.batch_bytes):
                out.append(cur)
                cur, size = [], 0
            cur.append(c)
            size += c.length
        return out + [cur] if cur else out

    def _messages(self, dst: int, attempt: int, holder: dict, started: threading.Event):
        """open{landed}; per batch: engine write (CRC of the source meanwhile), then its headers; manifest."""
        spec, faults, stats, plane = self.spec, self.sender.faults, self._stats[dst], self.sender.plane
        reply: pb.OpenReply = holder["open"]
        dst_base = {KDA: reply.kda_addr, MLA: reply.mla_addr}
        faulty = faults is not None and faults.active(attempt, dst)
        cancel = lambda: started.wait(5.0) and holder["call"].cancel()  # noqa: E731
        yield encode(pb.PushMessage(open=pb.StreamOpen(spec=self._spec_pb, src_rank=self.sender.rank, dst_rank=dst,
                                                       attempt=attempt, landed=True)))
        i, nbytes = 0, 0
        while True:
            ready = self._next_ready(dst, i)
            if ready is None:
                return
            batch, last = ready
            groups = self._batches(batch, faulty)
            ops = lambda g: [(self._src[c.kind] + c.src_byte, dst_base[c.kind] + c.dst_byte, c.length)  # noqa: E731
                             for c in g]
            start = lambda g: ([self._seal(c) for c in g], plane.submit(reply.segment, ops(g)))  # noqa: E731
            nxt = None  # the next batch's seals and engine write, started before this batch's headers go out
            try:
                for k, group in enumerate(groups):
                    try:
                        (macs, job), nxt = nxt or start(group), None
                        if not faulty and k + 1 < len(groups):  # two writes in flight (faults: one at a time)
                            nxt = start(groups[k + 1])
                        crcs = [j.result() for j in [self._crc_job(c, dst) for c in group]]  # while the write flies
                        plane.wait(job)
                    except DataPlaneError as e:
                        holder["error"] = e
                        cancel()
                        return
                    for c in group:
                        if faulty and not faults.landed(i, c, lambda c=c: self._corrupt(reply, dst, c), cancel,
                                                        self._aborted.wait):
                            return
                        i += 1
                        nbytes += c.length
                    t1 = time.thread_time()  # the batch's headers in one control message
                    head = encode(pb.PushMessage(landed=pb.LandedChunks(
                        chunks=[chunk_header(spec, c, crc, mac) for c, crc, mac in zip(group, crcs, macs)])))
                    stats[1] += time.thread_time() - t1
                    yield head
            finally:  # a stream cut mid-batch: the write in flight must end before the send region is released
                if nxt is not None:
                    self._settle(nxt[1], holder)
            if last:
                break
        crcs = self._manifest_crcs(dst)
        stats[2] = nbytes
        yield encode(pb.PushMessage(manifest=pb.Manifest(
            transfer_id=spec.transfer_id, src_rank=self.sender.rank, dst_rank=dst, num_chunks=i,
            num_bytes=nbytes, crc32c=digest_crcs(crcs))))

    def _seal(self, c: ChunkRef) -> bytes:
        """Chunk `c`'s range encrypted from the private source into the send region, once per session (another
        stream or a retry of the same range reuses it: it is never rewritten while a write may read it)."""
        key = (c.kind, c.src_byte, c.length)
        with self._seal_lock:
            if key not in self._seals:
                r = slice(c.src_byte, c.src_byte + c.length)
                self._seals[key] = chunk_seal.seal_into(self.sender.config.auth.secret, self.spec.transfer_id,
                                                        self.sender.rank, c.kind, c.src_byte,
                                                        self._cipher[c.kind][r], self._views[c.kind][r])
            return self._seals[key]

    def _settle(self, job, holder: dict) -> None:
        """Wait for an engine write this stream no longer needs (it is ending); a failure is recorded for the
        attempt's error (PlaneFailure), not raised over the error that ended the stream."""
        try:
            self.sender.plane.wait(job)
        except DataPlaneError as e:
            holder.setdefault("error", e)

    def _corrupt(self, reply: pb.OpenReply, dst: int, c: ChunkRef) -> None:
        """Fault injection: the first landed byte of `c` is overwritten with its complement (a bad wire)."""
        scratch = self.sender._scratch
        scratch[dst] = int(self._cipher[c.kind][c.src_byte]) ^ 0xFF
        base = reply.kda_addr if c.kind == KDA else reply.mla_addr
        self.sender.plane.write(reply.segment, [(scratch.data_ptr() + dst, base + c.dst_byte, 1)])
