"""CPU time of one decode step and one prefill, default vs deterministic numerics, side by side (docs/numerics.md).

``bench decode --deterministic`` reports wall-clock rates, which a shared machine's load moves by 2x from run
to run; this measures the CPU time (``time.process_time``, one intra-op thread in both modes) of the same
worker ops, alternating the modes round by round and keeping the minimum (load only adds time), so the
ratio is what one thread of each mode costs::

    python -m benchmarks.numerics_cpu [--checkpoint DIR] [--context 256] [--batches 1,8,32] [--rounds 3]

Prints one JSON object: prefill ms per request (``context`` tokens), decode ms per step by batch, and the
deterministic / default ratios (target <= 1.5).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from benchmarks.numerics_compare import numerics_side_by_side
from k3serve.contracts.numerics import DEFAULT_NUMERICS, DETERMINISTIC
from k3serve.engine.ops import DecodeBatch, PoolConfig, PrefillChunk
from k3serve.engine.worker import ModelWorker
from k3serve.model.loader import load_model

PAGE = 64


def measure(ckpt: str, context: int = 256, batches: tuple[int, ...] = (1, 8, 32), rounds: int = 3,
            steps: int = 3) -> dict:
    """Min CPU ms per prefill (of `context` tokens) and per decode step at each batch, both modes."""
    torch.set_num_threads(1)
    big = max(batches)
    pages = -(-(context + rounds * len(batches) * steps + 1) // PAGE)
    workers, prefill = {}, {}
    for name, num in (("default", DEFAULT_NUMERICS), ("deterministic", DETERMINISTIC)):
        w = ModelWorker(load_model(ckpt, numerics=num), PoolConfig(kda_slots=big + 1, mla_pages=big * pages,
                                                                   page_size=PAGE))
        tables = [tuple(range(b * pages, (b + 1) * pages)) for b in range(big)]
        g = torch.Generator().manual_seed(0)
        times = []
        for b in range(big):
            ids = tuple(torch.randint(0, 256, (context,), generator=g).tolist())
            t0 = time.process_time()
            w.execute(PrefillChunk(b, ids, 0, tables[b], want_logits=False))
            times.append(time.process_time() - t0)
        prefill[name] = 1e3 * min(times)
        workers[name] = (w, tables, [context])
    step: dict[str, dict[str, float]] = {"default": {}, "deterministic": {}}
    for _ in range(rounds):
        for b in batches:
            for name, (w, tables, pos) in workers.items():
                for _ in range(steps):
                    t0 = time.process_time()
                    w.execute(DecodeBatch(tuple(range(b)), (7,) * b, (pos[0],) * b, tuple(tables[:b])))
                    dt = 1e3 * (time.process_time() - t0)
                    pos[0] += 1
                    step[name][str(b)] = min(step[name].get(str(b), dt), dt)
    return {"context": context, "threads": 1,
            "prefill_ms": numerics_side_by_side({"prefill": prefill["default"]},
                                                {"prefill": prefill["deterministic"]}, lower_is_better=True),
            "decode_step_ms": numerics_side_by_side(step["default"], step["deterministic"], lower_is_better=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="", help="checkpoint dir (default: a fresh tiny one)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ckpt = a.checkpoint
    if not ckpt:
        from k3serve.model.checkpoint import make_checkpoint
        from k3serve.model.presets import preset

        ckpt = str(make_checkpoint(preset("tiny"), tempfile.mkdtemp(prefix="k3-numerics-"), seed=0))
    print(json.dumps(measure(ckpt, a.context, tuple(int(x) for x in a.batches.split(",")), a.rounds)))


if __name__ == "__main__":
    main()
