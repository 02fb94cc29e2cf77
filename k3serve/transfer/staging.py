"""A decode rank's staging area: per-transfer buffers that become installable only once verified.

```
 open(spec, src)   first stream of a transfer allocates  kda [L_kda, H/D, block] fp32 + mla [L_mla, n, D]
 write(chunk)      header == plan[src][seq]; payload copied at chunk.dst_byte, CRC32C of what landed ok
 finish(manifest)  every chunk of src present, manifest matches  ->  src done;  all P srcs done -> VERIFIED
 take(tid)         VERIFIED only: hands the buffers to InstallStaged and forgets them (tombstone INSTALLED)
 cancel / expire   drop the buffers (tombstone CANCELLED / EXPIRED: later streams of that id are refused)
 recycle(state)    after InstallStaged copied them: buffers go back to where they came from (buffers.py)
 land(chunk)       data planes (Mooncake): the payload was already written at chunk.dst_byte of the transfer's
                   landing range in the registered region (ciphertext); header == plan[src][seq]; decrypted
                   into the private buffers with CRC32C in one pass, tag + CRC ok -> chunk present; wiped
```
Buffers come from `buffers.py`: the heap with a bounded pool of warm buffers (a fresh buffer costs ~4x a
reused one to fill). Data planes also get landing ranges of one registered region (the sender writes there
directly, so the region is registered once); the Mooncake engine lets any peer read and write registered
memory, so it holds only ciphertext and what is installed is the private decrypted copy. A buffer is reused at
once only when no stream can still be writing into it; the pool is not "staged" state (occupancy counts live
transfers only). Idempotent by transfer id: a stream for a VERIFIED or INSTALLED transfer is acknowledged as
a duplicate and nothing is applied. Nothing here trusts the sender's description of a chunk: the receiver
derives the whole plan from the spec and each header must match its plan entry exactly.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.buffers import HeapBuffers, RegionBuffers
from k3serve.transfer.chunks import KDA, ChunkRef, stream_plan
from k3serve.transfer import chunk_seal
from k3serve.transfer.copy_crc import copy_crc32c
from k3serve.transfer.spec import DTYPES, TransferSpec
from k3serve.transfer.wire import PB_TO_KIND, digest_crcs

RECEIVING, VERIFIED, INSTALLED, CANCELLED, EXPIRED, UNKNOWN = (
    "receiving", "verified", "installed", "cancelled", "expired", "unknown")


class TransferRejected(Exception):
    """A stream or chunk the receiver refuses; `code` is a grpc.StatusCode name, the message names the field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class StagingLimits:
    max_chunk_bytes: int = 4 << 20
    max_staging_bytes: int = 8 << 30
    ttl_s: float = 120.0  # a transfer idle this long (unverified, or verified but never installed) is dropped
    tombstone_s: float = 600.0  # finished transfer ids are remembered this long (idempotency)
    max_tombstones: int = 100_000
    pool_bytes: int = 1 << 30  # free staging buffers kept for reuse (0: allocate every transfer afresh)

    def __post_init__(self) -> None:
        if self.max_chunk_bytes < 4096 or self.max_staging_bytes <= 0 or self.ttl_s <= 0 or self.tombstone_s <= 0:
            raise ValueError(f"invalid staging limits: {self}")


@dataclass(frozen=True)
class StagedState:
    """A verified transfer's state for one decode rank: what InstallStaged copies into the pools."""

    transfer_id: str
    request_id: str
    kda: torch.Tensor  # [L_kda, H/D, block] fp32
    mla: torch.Tensor  # [L_mla, num_tokens, D]
    recyclable: bool = False  # no stream was writing into the buffers when they were handed over


@dataclass
class StagingCounters:
    chunks: int = 0
    bytes: int = 0
    duplicates: int = 0
    crc_failures: int = 0
    mac_failures: int = 0  # landed chunks whose AEAD tag failed (chunk_seal.py)
    rejected: int = 0
    verified: int = 0
    installed: int = 0
    cancelled: int = 0
    expired: int = 0
    landed: int = 0  # chunks written by a data plane and checked in place
    crc_s: float = 0.0  # CPU seconds (thread time) decrypting landed chunks out and checking them (tag, CRC32C)
    place_s: float = 0.0  # CPU seconds copying payloads to their resharded offsets + their CRC32C (one pass)


@dataclass
class _Transfer:
    spec: TransferSpec
    kda: torch.Tensor
    mla: torch.Tensor
    plans: dict[int, tuple[ChunkRef, ...]]
    crcs: dict[int, list[int | None]]
    touched: float
    done: set[int] = field(default_factory=set)
    verified: bool = False
    writers: int = 0  # streams copying into the buffers right now
    # a data plane's landing ranges in the registered region (kda, mla); the state is copied out of them into
    # kda/mla (private memory, no engine reaches it) as each chunk is checked
    landing: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return self.kda.numel() * 4 + self.mla.numel() * self.mla.element_size()


class StagingStore:
    """Thread-safe: several senders' streams write one transfer concurrently (disjoint byte ranges)."""

    def __init__(self, rank: int, tp: int, limits: StagingLimits = StagingLimits(),
                 expect_geometry: tuple | None = None, clock: Callable[[], float] = time.monotonic,
                 region: RegionBuffers | None = None, mac_secret: str = "") -> None:
        """region: a data plane lands chunks in this registered region; each is copied out into private staging
        as it is checked (any peer of the engine can write the region, so only the copy is installed), and the
        chunk is decrypted out under `mac_secret`, the deployment secret (chunk_seal.py)."""
        if region is not None and not mac_secret:
            raise ValueError("a data plane's staging region needs the deployment secret (mac_secret) to check "
                             "what lands in it")
        self.rank, self.tp, self.limits = rank, tp, limits
        self.region, self._mac_secret = region, mac_secret
        self._buffers = HeapBuffers(limits.pool_bytes)
        self.expect_geometry = expect_geometry  # StateGeometry.without_tokens() of the decode model, if known
        self.counters = StagingCounters()
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, _Transfer] = {}
        self._tombs: OrderedDict[str, tuple[str, float]] = OrderedDict()

    # ------------------------------------------------------------------------------------------ streams
    def open(self, spec: TransferSpec, src: int, dst: int) -> str:
        """Register a stream; returns the transfer's state (VERIFIED/INSTALLED: a duplicate, apply nothing)."""
        if dst != self.rank or spec.decode_tp != self.tp:
            raise self._reject("INVALID_ARGUMENT", f"open.dst_rank: stream for decode rank {dst} of "
                               f"{spec.decode_tp} reached rank {self.rank} of {self.tp}")
        if not 0 <= src < spec.prefill_tp:
            raise self._reject("INVALID_ARGUMENT", f"open.src_rank {src} not in [0, {spec.prefill_tp})")
        if spec.chunk_bytes > self.limits.max_chunk_bytes:
            raise self._reject("INVALID_ARGUMENT", f"open.spec.chunk_bytes {spec.chunk_bytes} exceeds this "
                               f"receiver's max_chunk_bytes {self.limits.max_chunk_bytes}")
        if self.expect_geometry is not None and spec.geometry.without_tokens() != self.expect_geometry:
            raise self._reject("INVALID_ARGUMENT", f"open.spec: state geometry {spec.geometry} does not match "
                               f"this decode model {self.expect_geometry}")
        self.expire()
        with self._lock:
            tomb = self._tombs.get(spec.transfer_id)
            if tomb is not None:
                if tomb[0] == INSTALLED:
                    self.counters.duplicates += 1
                    return INSTALLED
                raise self._reject("FAILED_PRECONDITION", f"transfer {spec.transfer_id} was {tomb[0]}")
            t = self._live.get(spec.transfer_id)
            if t is not None:
                if t.spec != spec:
                    raise self._reject("INVALID_ARGUMENT", "open.spec differs from the spec this transfer was "
                                       f"opened with ({spec} != {t.spec})")
                t.touched = self._clock()
                if t.verified:
                    self.counters.duplicates += 1
                return VERIFIED if t.verified else RECEIVING
            need = spec.geometry.rank_bytes(self.tp)
            held = sum(x.nbytes for x in self._live.values())
            if need > self.limits.max_staging_bytes:
                raise self._reject("INVALID_ARGUMENT", f"open.spec: the transfer needs {need} staging bytes; "
                                   f"the limit is {self.limits.max_staging_bytes}")
            if held + need > self.limits.max_staging_bytes:
                raise self._reject("RESOURCE_EXHAUSTED", f"staging full: {held} + {need} bytes > "
                                   f"{self.limits.max_staging_bytes}")
            g = spec.geometry
            landing = None
            if self.region is not None:
                lk = self.region.alloc(g.kda_shape(self.tp), torch.float32)
                lm = self.region.alloc(g.mla_shape(), DTYPES[g.mla_dtype]) if lk is not None else None
                if lm is None:
                    if lk is not None:
                        self.region.release(lk, False)
                    raise self._reject("RESOURCE_EXHAUSTED", f"staging region full: no free range for {need} bytes")
                landing = (lk, lm)
            kda = self._buffers.alloc(g.kda_shape(self.tp), torch.float32)
            mla = self._buffers.alloc(g.mla_shape(), DTYPES[g.mla_dtype])
            plans = {s: stream_plan(spec, s, self.rank) for s in range(spec.prefill_tp)}
            self._live[spec.transfer_id] = _Transfer(spec, kda, mla, plans,
                                                     {s: [None] * len(p) for s, p in plans.items()}, self._clock(),
                                                     landing=landing)
            return RECEIVING

    def write(self, spec: TransferSpec, src: int, h: pb.ChunkHeader, payload: memoryview | None) -> bool:
        """Check one chunk against the plan and copy it into staging; False if the transfer is already verified."""
        n = 0 if payload is None else payload.nbytes
        lim = self.limits.max_chunk_bytes
        if h.length > lim or n > lim:
            raise self._reject("INVALID_ARGUMENT", f"chunk.length: {max(n, h.length)} bytes exceeds "
                               f"max_chunk_bytes {lim}")
        if n != h.length:
            raise self._reject("INVALID_ARGUMENT", f"payload: {n} bytes but chunk.length says {h.length}")
        found = self._chunk_plan(spec, src, h)
        if found is None:
            return False
        t, c = found
        with self._lock:
            if self._live.get(spec.transfer_id) is not t:
                raise self._reject("FAILED_PRECONDITION", f"transfer {spec.transfer_id} was dropped mid-stream")
            t.writers += 1
        t0 = time.thread_time()
        try:  # copy, then CRC32C over the bytes that landed, in one pass (copy_crc.py)
            dst = t.kda if c.kind == KDA else t.mla
            got = copy_crc32c(dst.reshape(-1).view(torch.uint8).numpy()[c.dst_byte: c.dst_byte + c.length], payload)
        finally:
            with self._lock:
                t.writers -= 1
        t1 = time.thread_time()
        with self._lock:
            k = self.counters
            k.place_s += t1 - t0
            if got != h.crc32c:  # the chunk stays missing: a retry rewrites it, nothing installs before
                k.crc_failures += 1
                raise TransferRejected("DATA_LOSS", f"chunk.crc32c mismatch for seq {h.seq} from prefill rank "
                                       f"{src}: header {h.crc32c:#010x}, landed {got:#010x}")
            if self._live.get(spec.transfer_id) is not t:
                raise self._reject("FAILED_PRECONDITION", f"transfer {spec.transfer_id} was dropped mid-stream")
            t.crcs[src][h.seq] = got
            t.touched = self._clock()
            k.chunks, k.bytes = k.chunks + 1, k.bytes + n
        return True

    def _chunk_plan(self, spec: TransferSpec, src: int, h: pb.ChunkHeader):
        """(the live transfer, the planned chunk `h` names) after checking the header against the plan; None when
        the transfer is already verified (a duplicate, counted). Shared by `write` and `land`."""
        with self._lock:
            t = self._live_transfer(spec.transfer_id)
            if t.verified:
                self.counters.duplicates += 1
                return None
            plan = t.plans[src]
        self._check_header(spec, plan, h)
        return t, plan[h.seq]

    def land(self, spec: TransferSpec, src: int, h: pb.ChunkHeader) -> bool:
        """A chunk a data plane already wrote at its planned offset: check its header against the plan, decrypt the
        landed ciphertext out of the registered region into private staging (chunk_seal.py: tag and CRC32C
        over it) then wipe the landing range; False if the transfer is already verified. Any engine peer can read
        and write the region: it reads only ciphertext, a write before the decrypt fails the tag, a write after it
        never reaches what is installed."""
        if h.length > self.limits.max_chunk_bytes:
            raise self._reject("INVALID_ARGUMENT", f"chunk.length: {h.length} bytes exceeds max_chunk_bytes "
                               f"{self.limits.max_chunk_bytes}")
        found = self._chunk_plan(spec, src, h)
        if found is None:
            return False
        t, c = found
        if t.landing is None:
            raise self._reject("FAILED_PRECONDITION", "a landed chunk needs a data plane's staging region")
        t0 = time.thread_time()
        k = 0 if c.kind == KDA else 1
        src_np = t.landing[k].reshape(-1).view(torch.uint8).numpy()[c.dst_byte: c.dst_byte + c.length]
        dst_np = (t.kda, t.mla)[k].reshape(-1).view(torch.uint8).numpy()[c.dst_byte: c.dst_byte + c.length]
        # the decrypt is the copy; CRC32C stays as the manifest's per-chunk summary shared with the gRPC plane
        # (there the corruption check), taken from L2 in the same pass
        sealed, got = chunk_seal.open_crc32c(self._mac_secret, spec.transfer_id, src, c.kind, c.src_byte, dst_np,
                                             src_np, h.mac)
        src_np[...] = 0  # ciphertext only, wiped all the same
        t1 = time.thread_time()
        with self._lock:
            self.counters.crc_s += t1 - t0
            if got != h.crc32c:
                self.counters.crc_failures += 1
                raise TransferRejected("DATA_LOSS", f"chunk.crc32c mismatch over the landed bytes of seq {h.seq} "
                                       f"from prefill rank {src}: header {h.crc32c:#010x}, landed {got:#010x}")
            if not sealed:  # the CRC held: a deliberate rewrite in the region before the copy (or no seal sent)
                self.counters.mac_failures += 1
                raise TransferRejected("DATA_LOSS", f"chunk.mac: the AEAD tag fails over the landed bytes of seq "
                                       f"{h.seq} from prefill rank {src}: rewritten in the registered region")
            if self._live.get(spec.transfer_id) is not t:
                raise self._reject("FAILED_PRECONDITION", f"transfer {spec.transfer_id} was dropped mid-stream")
            t.crcs[src][h.seq] = got
            t.touched = self._clock()
            k = self.counters
            k.chunks, k.landed, k.bytes = k.chunks + 1, k.landed + 1, k.bytes + c.length
        return True

    def addresses(self, transfer_id: str) -> tuple[int, int]:
        """(kda, mla) landing addresses of a live transfer in the registered region (data planes write there)."""
        with self._lock:
            t = self._live_transfer(transfer_id)
            if t.landing is None:
                raise self._reject("FAILED_PRECONDITION", "this receiver has no data plane region")
            return t.landing[0].data_ptr(), t.landing[1].data_ptr()

    def finish(self, spec: TransferSpec, src: int, m: pb.Manifest) -> str:
        """A sender's manifest: its stream is done if every chunk is present and the summary matches."""
        with self._lock:
            t = self._live_transfer(spec.transfer_id)
            if t.verified:
                return VERIFIED
            plan, crcs = t.plans[src], t.crcs[src]
            for name, got, want in (("transfer_id", m.transfer_id, spec.transfer_id), ("src_rank", m.src_rank, src),
                                    ("dst_rank", m.dst_rank, self.rank), ("num_chunks", m.num_chunks, len(plan)),
                                    ("num_bytes", m.num_bytes, sum(c.length for c in plan))):
                if got != want:
                    raise self._reject("INVALID_ARGUMENT", f"manifest.{name} is {got!r}, expected {want!r}")
            missing = sum(c is None for c in crcs)
            if missing:
                raise self._reject("DATA_LOSS", f"manifest: {missing} of {len(plan)} chunks from prefill rank "
                                   f"{src} never arrived")
            if digest_crcs(crcs) != m.crc32c:
                raise self._reject("DATA_LOSS", f"manifest.crc32c does not match the chunks received from "
                                   f"prefill rank {src}")
            t.done.add(src)
            t.touched = self._clock()
            if len(t.done) == spec.prefill_tp:
                t.verified = True
                self.counters.verified += 1
            return VERIFIED if t.verified else RECEIVING

    # ------------------------------------------------------------------------------------ driver side
    def status(self, transfer_id: str) -> str:
        with self._lock:
            t = self._live.get(transfer_id)
            if t is not None:
                return VERIFIED if t.verified else RECEIVING
            tomb = self._tombs.get(transfer_id)
            return tomb[0] if tomb else UNKNOWN

    def take(self, transfer_id: str) -> StagedState:
        """Hand over a VERIFIED transfer's buffers and forget them; anything else raises TransferRejected."""
        with self._lock:
            t = self._live.get(transfer_id)
            if t is None or not t.verified:
                state = RECEIVING if t is not None else self._tombs.get(transfer_id, (UNKNOWN, 0.0))[0]
                raise TransferRejected("FAILED_PRECONDITION", f"transfer {transfer_id} is {state}, not verified: "
                                       "nothing installed")
            del self._live[transfer_id]
            self._tomb(transfer_id, INSTALLED)
            self.counters.installed += 1
            self._release_landing(t, quarantine=False)  # verified: its senders write nothing more
        return StagedState(transfer_id, t.spec.request_id, t.kda, t.mla, recyclable=t.writers == 0)

    def recycle(self, state: StagedState) -> None:
        """Return a taken transfer's buffers once they were copied out (never touch `state` afterwards)."""
        with self._lock:
            self._buffers.release(state.kda, not state.recyclable)
            self._buffers.release(state.mla, not state.recyclable)

    def cancel(self, transfer_id: str) -> bool:
        """Drop a transfer's staging (if any); later streams of this id are refused. True if something was freed."""
        with self._lock:
            t = self._live.pop(transfer_id, None)
            if transfer_id not in self._tombs:
                self._tomb(transfer_id, CANCELLED)
            if t is not None:
                self.counters.cancelled += 1
                self._drop(t)
            return t is not None

    def expire(self, now: float | None = None) -> list[str]:
        """Drop transfers idle for longer than ttl_s; returns their ids."""
        now = self._clock() if now is None else now
        with self._lock:
            old = [tid for tid, t in self._live.items() if now - t.touched > self.limits.ttl_s]
            for tid in old:
                self._drop(self._live.pop(tid))
                self._tomb(tid, EXPIRED)
                self.counters.expired += 1
            while self._tombs and now - next(iter(self._tombs.values()))[1] > self.limits.tombstone_s:
                self._tombs.popitem(last=False)
        return old

    def occupancy(self) -> tuple[int, int]:
        """(staged transfers, staged bytes): live transfers only, not the free pool."""
        with self._lock:
            return len(self._live), sum(t.nbytes for t in self._live.values())

    @property
    def pooled_bytes(self) -> int:
        return self._buffers.pooled

    # ------------------------------------------------------------------------------------------ helpers
    def _drop(self, t: _Transfer) -> None:
        """A cancelled or expired transfer left the live set. Its buffers may still be written: by a stream
        copying right now, or (region) by a remote sender that has not heard of the cancel yet."""
        self._buffers.release(t.kda, t.writers > 0)
        self._buffers.release(t.mla, t.writers > 0)
        self._release_landing(t)

    def _release_landing(self, t: _Transfer, quarantine: bool = True) -> None:
        """Give a transfer's landing ranges back to the region; quarantined when a sender may still write."""
        if t.landing is not None and self.region is not None:
            for x in t.landing:
                self.region.release(x, quarantine)
            t.landing = None

    def _live_transfer(self, transfer_id: str) -> _Transfer:
        t = self._live.get(transfer_id)
        if t is None:
            tomb = self._tombs.get(transfer_id)
            raise self._reject("FAILED_PRECONDITION", f"transfer {transfer_id} is {tomb[0] if tomb else UNKNOWN}")
        return t

    def _tomb(self, transfer_id: str, state: str) -> None:
        self._tombs[transfer_id] = (state, self._clock())
        self._tombs.move_to_end(transfer_id)
        while len(self._tombs) > self.limits.max_tombstones:
            self._tombs.popitem(last=False)

    def _reject(self, code: str, message: str) -> TransferRejected:
        self.counters.rejected += 1
        return TransferRejected(code, message)

    def _check_header(self, spec: TransferSpec, plan: tuple[ChunkRef, ...], h: pb.ChunkHeader) -> None:
        if h.transfer_id != spec.transfer_id:
            raise self._reject("INVALID_ARGUMENT", f"chunk.transfer_id {h.transfer_id!r} is not this stream's "
                               f"{spec.transfer_id!r}")
        if h.request_id != spec.request_id:
            raise self._reject("INVALID_ARGUMENT", f"chunk.request_id {h.request_id!r} != {spec.request_id!r}")
        if h.seq >= len(plan):
            raise self._reject("INVALID_ARGUMENT", f"chunk.seq {h.seq} beyond this stream's {len(plan)} chunks")
        c = plan[h.seq]
        kind = PB_TO_KIND.get(h.kind)
        if kind != c.kind:
            raise self._reject("INVALID_ARGUMENT", f"chunk.kind {h.kind} != planned {c.kind} (seq {h.seq})")
        rng = "heads" if kind == KDA else "tokens"
        got_range = (getattr(h, rng).start, getattr(h, rng).count) if h.WhichOneof("range") == rng else None
        for name, got, want in (("layer", h.layer, c.layer), (rng, got_range, (c.start, c.count)),
                                ("dtype", h.dtype, c.dtype), ("shape", tuple(h.shape), c.shape),
                                ("offset", h.offset, c.offset), ("length", h.length, c.length)):
            if got != want:
                raise self._reject("INVALID_ARGUMENT", f"chunk.{name} is {got!r}, the plan says {want!r} "
                                   f"(seq {h.seq})")
