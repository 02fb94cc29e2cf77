"""A decode rank's transfer receiver: the gRPC ``k3serve.transfer.v1.Transfer`` service over a StagingStore.

```
 prefill rank p ──Push(open, chunk.., manifest)──▶ TransferReceiver (decode rank r) ──▶ StagingStore
                                                     │ Cancel(tid) / Status(tid)
 data plane (Mooncake): Open(tid) -> staging addresses in the registered region; the sender writes the payload
   there itself, then Push(open{landed}, chunk headers, manifest): each header is checked over the landed bytes
 decode driver ── InstallStaged(slot, table, tid) ─▶ ModelWorker.staging.take(tid) ─▶ kda_store / page_store
```
Binds the configured interface (loopback by default) on the configured port (0 = any free port; read
``port``/``endpoint`` after start). Authentication happens in an interceptor (k3serve/auth.py) before any message
is read. Error codes: UNAUTHENTICATED (signature), INVALID_ARGUMENT (malformed/oversized/misplanned; the message
names the field), DATA_LOSS (CRC or manifest mismatch: the sender retries), FAILED_PRECONDITION (cancelled or
expired transfer), RESOURCE_EXHAUSTED (staging full), ABORTED (stream ended before its manifest).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from k3serve.netaddr import advertised_host
from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.auth import AuthConfig, AuthInterceptor, signed_subject
from k3serve.tls import add_port
from k3serve.transfer.buffers import RegionBuffers
from k3serve.transfer.memory import tune_allocator
from k3serve.transfer.placer import StreamPlacer
from k3serve.transfer.plan import PlanError
from k3serve.transfer.staging import INSTALLED, VERIFIED, StagingLimits, StagingStore, TransferRejected
from k3serve.transfer.wire import STATE_CODES, WireError, decode, spec_from_pb

SERVICE = pb.DESCRIPTOR.services_by_name["Transfer"].full_name
PUSH, CANCEL, STATUS, OPEN = (f"/{SERVICE}/{m}" for m in ("Push", "Cancel", "Status", "Open"))


@dataclass(frozen=True)
class ReceiverConfig:
    auth: AuthConfig
    host: str = "127.0.0.1"  # the interface to bind ("0.0.0.0" / "[::]" only on a private network)
    port: int = 0  # 0: any free port, reported by TransferReceiver.port
    rank: int = 0  # this decode rank
    tp: int = 1  # decode TP degree
    limits: StagingLimits = StagingLimits()
    max_workers: int = 16  # concurrent streams served
    # a stream's chunks copied + CRC'd on placement workers beside its handler thread at once (placer.py); 0:
    # inline in the handler thread (no gain where no core is idle: docs/transfer.md)
    place_depth: int = 0
    gc_interval_s: float = 1.0  # how often idle transfers are expired

    def for_rank(self, rank: int, tp: int) -> "ReceiverConfig":
        return dataclasses.replace(self, rank=rank, tp=tp)


class TransferReceiver:
    """Starts serving in the constructor; ``stop()`` (or use as a context manager) shuts it down."""

    def __init__(self, config: ReceiverConfig, expect_geometry: tuple | None = None,
                 region: RegionBuffers | None = None, segment: str = "") -> None:
        """region, segment: stage into this registered region, which the data plane session `segment` (a
        Mooncake "host:port") exposes to senders; without them Open is refused (gRPC payloads only)."""
        if not 0 <= config.rank < config.tp:
            raise ValueError(f"receiver rank {config.rank} not in [0, {config.tp})")
        if config.place_depth < 0:
            raise ValueError(f"ReceiverConfig.place_depth must be >= 0, got {config.place_depth}")
        if (region is None) != (not segment):
            raise ValueError("a receiver's data plane needs both its staging region and its segment name")
        tune_allocator()  # process-wide: message buffers reuse warm heap pages (memory.py)
        self.config, self.segment = config, segment
        self.store = StagingStore(config.rank, config.tp, config.limits, expect_geometry, region=region,
                                  mac_secret=config.auth.secret)
        max_msg = 2 * config.limits.max_chunk_bytes + (1 << 20)  # oversized-but-parseable -> INVALID_ARGUMENT
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix=f"transfer-rx{config.rank}"),
            interceptors=(AuthInterceptor(config.auth),),
            options=[("grpc.max_receive_message_length", max_msg), ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Push": grpc.stream_unary_rpc_method_handler(self._push, None, pb.PushAck.SerializeToString),
            "Cancel": grpc.unary_unary_rpc_method_handler(self._cancel, pb.CancelRequest.FromString,
                                                          pb.CancelAck.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(self._status, pb.StatusRequest.FromString,
                                                          pb.StatusReply.SerializeToString),
            "Open": grpc.unary_unary_rpc_method_handler(self._open, pb.StreamOpen.FromString,
                                                        pb.OpenReply.SerializeToString),
        }),))
        self.port = add_port(self._server, f"{config.host}:{config.port}", config.auth.tls)  # mutual TLS with auth.tls
        if self.port == 0:
            raise OSError(f"transfer receiver could not bind {config.host}:{config.port}")
        # placement workers (copy + CRC32C of received chunks, placer.py): as many as streams can be served
        self._place_pool = ThreadPoolExecutor(max_workers=config.max_workers,
                                              thread_name_prefix=f"transfer-place{config.rank}")
        self._server.start()
        self._stop = threading.Event()
        self._gc = threading.Thread(target=self._gc_loop, name=f"transfer-gc{config.rank}", daemon=True)
        self._gc.start()

    @property
    def endpoint(self) -> str:
        return f"{advertised_host(self.config.host)}:{self.port}"  # bound 0.0.0.0: a dialable address

    def stop(self, grace: float | None = 0.5) -> None:
        self._stop.set()
        self._server.stop(grace).wait()
        self._place_pool.shutdown(wait=True)
        self._gc.join(timeout=5)

    def __enter__(self) -> "TransferReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _gc_loop(self) -> None:
        while not self._stop.wait(self.config.gc_interval_s):
            self.store.expire()

    # ------------------------------------------------------------------------------------------- RPCs
    def _push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushAck:
        try:
            return self._serve_push(request_iterator, signed_subject(context))
        except TransferRejected as e:
            context.abort(getattr(grpc.StatusCode, e.code), e.message)
        except (WireError, PlanError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except grpc.RpcError:  # the sender went away mid-stream (cancelled, deadline, dead): nobody to answer
            return pb.PushAck()

    def _serve_push(self, messages, signed: str) -> pb.PushAck:
        it = iter(messages)
        first = next(it, None)
        if first is None:
            raise TransferRejected("INVALID_ARGUMENT", "stream: empty; the first message must be `open`")
        msg, _ = decode(first)
        if msg.WhichOneof("body") != "open":
            raise TransferRejected("INVALID_ARGUMENT", "stream: the first message must be `open`")
        try:
            spec = spec_from_pb(msg.open.spec)
        except PlanError as e:
            raise TransferRejected("INVALID_ARGUMENT", f"open.spec: {e}") from e
        if spec.transfer_id != signed:
            raise TransferRejected("UNAUTHENTICATED", "open.spec.transfer_id is not the transfer id this call "
                                   "was signed for")
        src, dst, landed = msg.open.src_rank, msg.open.dst_rank, msg.open.landed
        if landed and self.store.region is None:
            raise TransferRejected("FAILED_PRECONDITION", "open.landed: this receiver has no data plane")
        ack = pb.PushAck(transfer_id=spec.transfer_id, src_rank=src, dst_rank=dst)
        state = self.store.open(spec, src, dst)
        if state in (VERIFIED, INSTALLED):  # idempotent: acknowledge, apply nothing
            ack.state, ack.duplicate = STATE_CODES[state], True
            return ack
        placer = StreamPlacer(self._place_pool, self.config.place_depth)
        try:
            return self._serve_chunks(it, spec, src, landed, ack, placer)
        finally:
            placer.close()

    def _serve_chunks(self, it, spec, src: int, landed: bool, ack: pb.PushAck, placer: StreamPlacer) -> pb.PushAck:
        """The stream after its open: chunks (placed on workers, `placer`) until the manifest."""
        for raw in it:
            m, payload = decode(raw)
            body = m.WhichOneof("body")
            if landed and body in ("chunk", "landed"):
                if payload is not None:
                    raise TransferRejected("INVALID_ARGUMENT", "payload: a landed stream's chunks carry headers "
                                           "only (the data plane wrote the bytes)")
                for h in (m.chunk,) if body == "chunk" else m.landed.chunks:
                    placer.submit(lambda h=h: self.store.land(spec, src, h))
            elif body == "landed":
                raise TransferRejected("INVALID_ARGUMENT", "message.landed: only in a stream opened as landed")
            elif body == "chunk":
                placer.submit(lambda h=m.chunk, p=payload: self.store.write(spec, src, h, p))
            elif body == "manifest":
                ack.chunks_applied = placer.drain()
                ack.state = STATE_CODES[self.store.finish(spec, src, m.manifest)]
                return ack
            else:
                raise TransferRejected("INVALID_ARGUMENT", f"message.body: expected chunk or manifest, got {body}")
        placer.drain()  # a chunk's own error (DATA_LOSS, INVALID_ARGUMENT) before the stream's
        raise TransferRejected("ABORTED", f"stream from prefill rank {src} ended before its manifest")

    def _open(self, req: pb.StreamOpen, context: grpc.ServicerContext) -> pb.OpenReply:
        """Stage a transfer for a data-plane sender and say where its bytes land (idempotent)."""
        if self.store.region is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Open: this receiver has no data plane "
                          "(clusters.transfer is grpc); send payloads in Push")
        try:
            spec = spec_from_pb(req.spec)
        except PlanError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"open.spec: {e}")
        if spec.transfer_id != signed_subject(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "open.spec.transfer_id is not the transfer id this "
                          "call was signed for")
        try:
            state = self.store.open(spec, req.src_rank, req.dst_rank)
            reply = pb.OpenReply(transfer_id=spec.transfer_id, state=STATE_CODES[state], segment=self.segment)
            if state not in (VERIFIED, INSTALLED):
                reply.kda_addr, reply.mla_addr = self.store.addresses(spec.transfer_id)
        except TransferRejected as e:
            context.abort(getattr(grpc.StatusCode, e.code), e.message)
        return reply

    def _cancel(self, req: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelAck:
        if req.transfer_id != signed_subject(context) or not req.transfer_id:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "transfer_id is not the one this call was signed for")
        return pb.CancelAck(transfer_id=req.transfer_id, freed=self.store.cancel(req.transfer_id))

    def _status(self, req: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        if req.transfer_id != signed_subject(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "transfer_id is not the one this call was signed for")
        n, nbytes = self.store.occupancy()
        state = self.store.status(req.transfer_id) if req.transfer_id else "unknown"
        return pb.StatusReply(transfer_id=req.transfer_id, state=STATE_CODES[state], staged_transfers=n,
                              staged_bytes=nbytes, decode_rank=self.config.rank, decode_tp=self.config.tp)
