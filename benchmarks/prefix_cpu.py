"""CPU time of the ``bench prefix`` TTFT trio (``time.process_time()``), for A/B comparisons on a loaded machine.

The same requests as :func:`benchmarks.prefix.ttft_hit_vs_cold` (tiny preset, a cold ``prefix + increment``
prompt, a hit on the cached prefix, a cold prompt of the increment alone), each timed by the CPU time it
consumes, which other processes' contention barely moves (a hypervisor's steal does: it is charged to the
running process)::

    OMP_NUM_THREADS=1 PYTHONPATH=<tree> python -m benchmarks.prefix_cpu 1 3 [--profile cold|hit|short] [--deterministic]

Arguments: intra-op threads, repeats (a fresh engine each; best and median reported). ``--deterministic`` runs the
engine in numerics mode ``deterministic`` (its forwards then run ``numerics.threads`` threads). ``--profile R`` prints
the ``torch.profiler`` operator table (self CPU time) of request R in the first repeat (its timing then
includes the profiler's overhead).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.prefix import _engine
from k3serve.contracts.numerics import DEFAULT_NUMERICS, DETERMINISTIC, Numerics
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.model.checkpoint import load_config
from k3serve.model.presets import write_preset_checkpoint


def ttft_cpu(ckpt: str, prefix_len: int = 8192, increment: int = 128, profile: str | None = None,
             numerics: Numerics = DEFAULT_NUMERICS) -> dict[str, float]:
    """CPU seconds of the cold, hit and short prompts (the same prompts as ``ttft_hit_vs_cold``). profile:
    one of "cold", "hit", "short" to print that request's operator table."""
    cfg = load_config(ckpt)
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    params = SamplingParams(max_tokens=1)
    engine = _engine(ckpt, cfg, PrefixCachePolicy(), pages=4096, numerics=numerics)

    def timed(rid: str, prompt: list[int], prof: bool = False) -> float:
        c = time.process_time()
        engine.add_request(PrefillRequest(rid, tuple(prompt), params, session_id="ttft"))
        if prof:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                engine.run_to_completion()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        else:
            engine.run_to_completion()
        return time.process_time() - c

    out = {"cold": timed("cold", prefix + [rng.randrange(256) for _ in range(increment)], profile == "cold"),
           "hit": timed("hit", prefix + [rng.randrange(256) for _ in range(increment)], profile == "hit"),
           "short": timed("short", [256] + [rng.randrange(256) for _ in range(increment - 1)],
                          profile == "short")}
    engine.executor.close()
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(int(argv[0]))
    repeats = int(argv[1])
    profile = argv[argv.index("--profile") + 1] if "--profile" in argv else None
    numerics = DETERMINISTIC if "--deterministic" in argv else DEFAULT_NUMERICS
    with tempfile.TemporaryDirectory(prefix="k3serve-bench-") as d:
        ckpt = str(write_preset_checkpoint("tiny", d))
        runs = [ttft_cpu(ckpt, profile=profile if i == 0 else None, numerics=numerics) for i in range(repeats)]
    for key in ("cold", "hit", "short"):
        xs = [r[key] for r in runs]
        print(f"{key}: cpu best {min(xs) * 1e3:.1f} med {statistics.median(xs) * 1e3:.1f} ms")
    hit, short = min(r["hit"] for r in runs), min(r["short"] for r in runs)
    print(f"hit / short (best): {hit / short:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
