"""Overlap bench: our gRPC path with its CRC and placement beside grpcio's threads, and inline, and bare gRPC.

```
 per (P, D), one run, the three paths interleaved (their order rotates every repetition):
   overlap: senders CRC ahead on CRC workers (SenderConfig.crc_ahead), receivers copy + CRC on placement
            workers (ReceiverConfig.place_depth 2)                         -> D receiver processes "overlap"
   inline:  both off (the defaults): CRC, frame, send in the stream thread; copy + CRC in the handler
                                                                           -> D receiver processes "inline"
   bare:    bare gRPC-Python on the same bytes (transfer_baselines.py), into the "overlap" receivers' sink
```
Both of our variants keep every check (CRC32C over source and landed bytes, manifest, verify); each
repetition's staged state is compared with reshard_kda of the same state. Reported per pair: medians of the
per-repetition ratios (a repetition's three paths ran back to back under the same load), the best GB/s of
each path and CPU seconds per GB (every helper process, median). More repetitions than the main bench
because the ratio of one repetition swings with a shared machine's load.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import statistics
from dataclasses import dataclass

from k3serve.auth import AuthConfig
from benchmarks.transfer import _on_all, _random_state
from benchmarks.transfer_procs import ReceiverProc, SenderProc, SendJob
from k3serve.model.presets import preset
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.receiver import ReceiverConfig
from k3serve.transfer.sender import SenderConfig, SendResult
from k3serve.transfer.spec import DEFAULT_CHUNK_BYTES, StateGeometry, TransferSpec
from k3serve.transfer.staging import StagingLimits
from k3serve.transfer.wire import byte_view, crc32c

PATHS = ("overlap", "inline", "bare")


@dataclass(frozen=True)
class OverlapBenchConfig:
    pairs: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (4, 2))
    tokens: int = 8192
    preset: str = "bench"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    page_tokens: int = 64
    reps: int = 8
    host: str = "127.0.0.1"


def _pair(p: int, d: int, senders, rx: dict, g: StateGeometry, cfg: OverlapBenchConfig, scfg: dict) -> dict:
    parts, mla = _random_state(g, p, seed=p * 10 + d)
    key, senders = f"ov-p{p}d{d}", senders[:p]
    for r, s in enumerate(senders):
        s.call("load", key, parts[r], mla, timeout=600)
    want = [(crc32c(byte_view(k)), crc32c(byte_view(mla))) for k in reshard_kda(parts, d)]
    secs = {k: [] for k in PATHS}
    cpu = {k: [] for k in PATHS}
    procs = senders + rx["overlap"] + rx["inline"]
    nbytes = 0
    for rep in range(cfg.reps):
        order = PATHS[rep % 3:] + PATHS[: rep % 3]
        for path in order:
            spec = TransferSpec(f"ov-{key}-{path}-{rep}", f"req-{key}-{rep}", g, p, d, cfg.page_tokens,
                                cfg.chunk_bytes)
            nbytes = sum(c.length for s in range(p) for r in range(d) for c in stream_plan(spec, s, r))
            group = rx["inline" if path == "inline" else "overlap"]
            eps = tuple(x.endpoint for x in group)
            jobs = [SendJob(spec, r, eps, scfg["inline" if path == "inline" else "overlap"], key) for r in range(p)]
            cpu0 = [x.call("cpu") for x in procs]
            if path == "bare":
                ports = tuple(x.call("grpc_listen") for x in group)
                dt, _ = _on_all(senders, "grpc_send", jobs, ports, cfg.host)
                got = sum(x.call("grpc_received") for x in group)
                if got != nbytes:
                    raise RuntimeError(f"P={p} D={d}: bare gRPC moved {got} bytes, expected {nbytes}")
            else:
                dt, results = _on_all(senders, "send", jobs)
            cpu[path].append(sum(x.call("cpu") - c for x, c in zip(procs, cpu0)))  # before the check's own CRC
            secs[path].append(dt)
            if path != "bare":
                if not all(isinstance(res, SendResult) for res in results):
                    raise RuntimeError(f"P={p} D={d} {path}: transfer failed: {results}")
                if [x.call("digest", spec.transfer_id, timeout=600) for x in group] != want:
                    raise RuntimeError(f"P={p} D={d} {path}: received state differs from reshard_kda")
    ratio = lambda a, b: round(statistics.median(y / x for x, y in zip(secs[a], secs[b])), 3)  # noqa: E731
    return {
        "p": p, "d": d, "bytes": nbytes,
        "gbps_best": {k: round(nbytes / min(v) / 1e9, 3) for k, v in secs.items()},
        "gbps_median": {k: round(nbytes / statistics.median(v) / 1e9, 3) for k, v in secs.items()},
        "overlap_over_bare_median": ratio("overlap", "bare"), "inline_over_bare_median": ratio("inline", "bare"),
        "overlap_over_inline_median": ratio("overlap", "inline"),
        "overlap_over_bare_best": round(min(secs["bare"]) / min(secs["overlap"]), 3),
        "inline_over_bare_best": round(min(secs["bare"]) / min(secs["inline"]), 3),
        "cpu_s_per_gb": {k: round(statistics.median(v) / nbytes * 1e9, 3) for k, v in cpu.items()},
        "s_per_rep": {k: [round(x, 4) for x in v] for k, v in secs.items()},
    }


def run_overlap_bench(cfg: OverlapBenchConfig = OverlapBenchConfig()) -> dict:
    g = StateGeometry.of_config(preset(cfg.preset), cfg.tokens)
    for p, d in cfg.pairs:  # configuration errors before any process starts
        TransferSpec("check", "check", g, p, d, cfg.page_tokens, cfg.chunk_bytes)
    auth = AuthConfig(secrets.token_hex(16), peer="bench")
    inline = SenderConfig(auth, stream_timeout_s=600.0, crc_ahead=False)
    scfg = {"overlap": dataclasses.replace(inline, crc_ahead=True), "inline": inline}
    limits = StagingLimits(max_chunk_bytes=max(4 << 20, 2 * cfg.chunk_bytes),
                           max_staging_bytes=4 * g.rank_bytes(1) + (1 << 30), ttl_s=600.0)
    load0 = os.getloadavg()[0]
    senders = [SenderProc() for _ in range(max(p for p, _ in cfg.pairs))]
    runs = []
    try:
        for d in sorted({d for _, d in cfg.pairs}):
            base = ReceiverConfig(auth, host=cfg.host, limits=limits)
            rx = {name: [ReceiverProc(dataclasses.replace(base, place_depth=depth).for_rank(r, d)) for r in range(d)]
                  for name, depth in (("overlap", 2), ("inline", 0))}
            try:
                runs += [_pair(p, d, senders, rx, g, cfg, scfg) for p, dd in cfg.pairs if dd == d]
            finally:
                for x in rx["overlap"] + rx["inline"]:
                    x.close()
    finally:
        for s in senders:
            s.close()
    order = {pair: i for i, pair in enumerate(cfg.pairs)}
    runs.sort(key=lambda r: order[(r["p"], r["d"])])
    return {"preset": cfg.preset, "tokens": cfg.tokens, "chunk_bytes": cfg.chunk_bytes, "reps": cfg.reps,
            "cpus": os.cpu_count(), "load_avg_1m_start": round(load0, 2),
            "load_avg_1m_end": round(os.getloadavg()[0], 2), "runs": runs}
