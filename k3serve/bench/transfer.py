"""Transfer bench: our gRPC path against a raw loopback TCP socket moving the same bytes, in the same run.

For each (P, D): P sender processes (one per prefill rank, each holding its own copy of its state) and D
receiver processes (one TransferReceiver each) on loopback. One repetition of each path:

```
 grpc:   every sender streams its plan to every receiver (CRC32C, manifest, staging at resharded offsets,
         verification); timed from the first send to the last ack; the staged bytes are then checked
         against reshard_kda / the MLA rows (CRC of the whole staging) and dropped
 socket: every sender sends exactly the same byte ranges over one plain TCP connection per receiver, which
         recv_into()s one preallocated buffer; timed from the first send to the last byte
```
The two alternate within each repetition (so background load hits both alike); we report medians.
Time shares are fractions of all helper processes' CPU time during the gRPC repetitions (process_time
covers gRPC's own threads): CRC32C (senders + receivers), resharding (the receivers' placement copies at the
head/token offsets; slicing on the sender side is zero-copy views), and message framing (the senders' one
copy of each payload into its message).
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from dataclasses import dataclass

import torch

from k3serve.model.presets import preset
from k3serve.transfer.auth import AuthConfig
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.procs import ReceiverProc, SenderProc, SendJob
from k3serve.transfer.receiver import ReceiverConfig
from k3serve.transfer.sender import SenderConfig, SendResult
from k3serve.transfer.spec import DTYPES, StateGeometry, TransferSpec
from k3serve.transfer.staging import StagingLimits
from k3serve.transfer.wire import byte_view, crc32c

DEFAULT_PAIRS = ((1, 1), (2, 2), (1, 2), (2, 1), (4, 2))


@dataclass(frozen=True)
class TransferBenchConfig:
    pairs: tuple[tuple[int, int], ...] = DEFAULT_PAIRS
    tokens: int = 32768
    preset: str = "bench"
    chunk_bytes: int = 1 << 20
    page_tokens: int = 64
    reps: int = 3
    layerwise: bool = False
    host: str = "127.0.0.1"


def _random_state(g: StateGeometry, p: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kda = torch.randn(g.kda_layers, g.kda_heads, g.kda_block_floats, generator=gen)
    mla = torch.rand(g.mla_shape(), generator=gen).to(DTYPES[g.mla_dtype])
    return [c.contiguous() for c in kda.chunk(p, dim=1)], mla


def _run_pair(p: int, d: int, senders: list[SenderProc], receivers: list[ReceiverProc], g: StateGeometry,
              cfg: TransferBenchConfig, sender_cfg: SenderConfig) -> dict:
    parts, mla = _random_state(g, p, seed=p * 10 + d)
    key = f"p{p}d{d}"
    for r in range(p):
        senders[r].call("load", key, parts[r], mla, timeout=600)
    want = [(crc32c(byte_view(k)), crc32c(byte_view(mla))) for k in reshard_kda(parts, d)]
    eps = tuple(rx.endpoint for rx in receivers)
    procs = senders[:p] + receivers
    grpc_s, sock_s, crc_s, place_s, enc_s, cpu_s, attempts = [], [], [], [], [], [], 0
    for rep in range(cfg.reps):
        spec = TransferSpec(f"bench-{key}-{rep}", f"req-{key}-{rep}", g, p, d, cfg.page_tokens, cfg.chunk_bytes)
        nbytes = sum(c.length for s in range(p) for r in range(d) for c in stream_plan(spec, s, r))
        # ---- gRPC path
        cpu0 = [x.call("cpu") for x in procs]
        rx0 = [x.call("counters") for x in receivers]
        t0 = time.perf_counter()
        for r in range(p):
            senders[r].post("send", SendJob(spec, r, eps, sender_cfg, key, layerwise=cfg.layerwise))
        results = [senders[r].wait(600) for r in range(p)]
        grpc_s.append(time.perf_counter() - t0)
        cpu_s.append(sum(x.call("cpu") - c for x, c in zip(procs, cpu0)))
        rx1 = [x.call("counters") for x in receivers]
        if not all(isinstance(res, SendResult) for res in results):
            raise RuntimeError(f"P={p} D={d}: transfer failed: {results}")
        attempts += sum(s.attempts - 1 for res in results for s in res.streams)
        got = [x.call("digest", spec.transfer_id, timeout=600) for x in receivers]
        if got != want:
            raise RuntimeError(f"P={p} D={d}: received state differs from reshard_kda of the same state")
        crc_s.append(sum(res.crc_s for res in results) + sum(b.crc_s - a.crc_s for a, b in zip(rx0, rx1)))
        place_s.append(sum(b.place_s - a.place_s for a, b in zip(rx0, rx1)))
        enc_s.append(sum(res.encode_s for res in results))
        # ---- raw socket, same bytes, same processes
        per_rank = [sum(c.length for s in range(p) for c in stream_plan(spec, s, r)) for r in range(d)]
        ports = tuple(rx.call("socket_listen", p, n, timeout=600) for rx, n in zip(receivers, per_rank))
        t0 = time.perf_counter()
        for r in range(p):
            senders[r].post("socket_send", SendJob(spec, r, eps, sender_cfg, key), ports, cfg.host)
        for r in range(p):
            senders[r].wait(600)
        received = [rx.call("socket_wait", 600.0, timeout=620) for rx in receivers]
        sock_s.append(time.perf_counter() - t0)
        if received != per_rank:
            raise RuntimeError(f"P={p} D={d}: socket baseline moved {received} bytes, expected {per_rank}")
    gs, ss, cpu = statistics.median(grpc_s), statistics.median(sock_s), statistics.median(cpu_s)
    return {
        "p": p, "d": d, "bytes": nbytes, "grpc_gbps": round(nbytes / gs / 1e9, 3),
        "socket_gbps": round(nbytes / ss / 1e9, 3), "ratio": round(ss / gs, 3),
        "grpc_s": round(gs, 4), "socket_s": round(ss, 4), "cpu_s": round(cpu, 4),
        "crc_share": round(statistics.median(crc_s) / cpu, 3),
        "reshard_share": round(statistics.median(place_s) / cpu, 3),
        "framing_share": round(statistics.median(enc_s) / cpu, 3),
        "retried_streams": attempts, "verified": True,
    }


def run_transfer_bench(cfg: TransferBenchConfig = TransferBenchConfig()) -> dict:
    mc = preset(cfg.preset)
    g = StateGeometry.of_config(mc, cfg.tokens)
    for p, d in cfg.pairs:  # configuration errors before any process starts
        TransferSpec("check", "check", g, p, d, cfg.page_tokens, cfg.chunk_bytes)
    auth = AuthConfig(secrets.token_hex(16), peer="bench")
    sender_cfg = SenderConfig(auth, stream_timeout_s=600.0)
    limits = StagingLimits(max_chunk_bytes=max(4 << 20, 2 * cfg.chunk_bytes),
                           max_staging_bytes=4 * g.rank_bytes(1) + (1 << 30), ttl_s=600.0)
    senders = [SenderProc() for _ in range(max(p for p, _ in cfg.pairs))]
    runs = []
    try:
        for d in sorted({d for _, d in cfg.pairs}):
            receivers = [ReceiverProc(ReceiverConfig(auth, host=cfg.host, limits=limits).for_rank(r, d))
                         for r in range(d)]
            try:
                runs += [_run_pair(p, d, senders, receivers, g, cfg, sender_cfg) for p, dd in cfg.pairs if dd == d]
            finally:
                for rx in receivers:
                    rx.close()
    finally:
        for s in senders:
            s.close()
    order = {pair: i for i, pair in enumerate(cfg.pairs)}
    runs.sort(key=lambda r: order[(r["p"], r["d"])])
    return {
        "preset": cfg.preset, "tokens": cfg.tokens, "chunk_bytes": cfg.chunk_bytes, "reps": cfg.reps,
        "layerwise": cfg.layerwise, "cpus": os.cpu_count(),
        "kda_bytes": g.kda_layers * g.kda_heads * g.kda_row_bytes,
        "mla_bytes_per_decode_rank": g.mla_layers * g.num_tokens * g.mla_row_bytes,
        "runs": runs,
    }
