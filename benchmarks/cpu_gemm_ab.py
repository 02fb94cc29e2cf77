"""Decode step time per CPU GEMM library, side by side in one process (docs/performance.md)::

    python -m benchmarks.cpu_gemm_ab CHECKPOINT [--libraries mkl,auto] [--rounds 5] [--threads 2]

One ModelWorker per ``numerics.default_gemm`` value on the same checkpoint, stepped alternately (a shared machine's
bandwidth drifts between runs; interleaving keeps the pair comparable). Prints one JSON object: min and median
ms per decode step by batch (context 256) for each library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3serve.contracts.numerics import Numerics
from k3serve.engine.ops import DecodeBatch, PoolConfig, PrefillChunk
from k3serve.engine.worker import ModelWorker
from k3serve.model.loader import load_model

PAGE, PAGES, CONTEXT, BATCHES = 64, 8, 256, (1, 8, 32)


def measure(ckpt: str, libraries: list[str], rounds: int) -> dict:
    big = max(BATCHES)
    tables = [tuple(range(b * PAGES, (b + 1) * PAGES)) for b in range(big)]
    workers = {}
    for lib in libraries:
        w = ModelWorker(load_model(ckpt, numerics=Numerics(default_gemm=lib)),
                        PoolConfig(kda_slots=big + 1, mla_pages=big * PAGES, page_size=PAGE))
        for b in range(big):
            w.execute(PrefillChunk(b, tuple((i * 7 + b) % 256 for i in range(CONTEXT)), 0, tables[b], want_logits=False))
        workers[lib] = [w, CONTEXT]
    times: dict[str, dict[int, list[float]]] = {lib: {b: [] for b in BATCHES} for lib in libraries}
    for _ in range(rounds):
        for lib, entry in workers.items():
            for b in BATCHES:
                for _ in range(3):
                    t0 = time.perf_counter()
                    entry[0].execute(DecodeBatch(tuple(range(b)), (7,) * b, (entry[1],) * b, tuple(tables[:b])))
                    times[lib][b].append(1e3 * (time.perf_counter() - t0))
                    entry[1] += 1
    return {lib: {str(b): {"min_ms": min(v), "median_ms": statistics.median(v)} for b, v in per.items()}
            for lib, per in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--libraries", default="mkl,auto")
    ap.add_argument("--rounds", type=int, default=5)  # x 3 steps per batch; context grows by 9 per round
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.rounds * 3 * len(BATCHES) + CONTEXT >= PAGE * PAGES:
        ap.error(f"--rounds must stay below {(PAGE * PAGES - CONTEXT) // (3 * len(BATCHES))}")
    torch.set_num_threads(a.threads)
    print(json.dumps(measure(a.checkpoint, a.libraries.split(","), a.rounds)))


if __name__ == "__main__":
    main()
