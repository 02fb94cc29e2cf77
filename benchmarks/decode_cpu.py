"""CPU time per decode step (``time.process_time()``), for A/B comparisons on a shared, loaded machine.

Wall-clock benches swing several-fold when other jobs share the cores; the CPU time a step consumes barely
moves, so two trees can be compared back to back (docs/performance.md)::

    OMP_NUM_THREADS=1 PYTHONPATH=<tree> python -m benchmarks.decode_cpu 1 1,8,32

Arguments: intra-op threads, comma-separated batch sizes. Bench preset, context 256, best and median of 12 steps
after 2 warm-up steps.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from benchmarks.decode import decoding_engine
from k3serve.model.checkpoint import load_config
from k3serve.model.presets import write_preset_checkpoint


def step_cpu_times(ckpt: str, batch: int, context: int = 256, steps: int = 12) -> tuple[list[float], list[float]]:
    """(CPU seconds, wall seconds) of each of `steps` decode steps over `batch` requests of `context` tokens."""
    decode = decoding_engine(ckpt, load_config(ckpt), batch, context, steps + 10)
    decode.step()
    decode.step()
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.process_time(), time.perf_counter()
        decode.step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return cpu, wall


def main(argv: list[str]) -> None:
    torch.set_num_threads(int(argv[0]))
    with tempfile.TemporaryDirectory(prefix="k3serve-bench-") as d:
        ckpt = str(write_preset_checkpoint("bench", d))
        for batch in (int(b) for b in argv[1].split(",")):
            cpu, wall = step_cpu_times(ckpt, batch)
            print(f"batch {batch}: cpu/step best {min(cpu) * 1e3:.1f} med {statistics.median(cpu) * 1e3:.1f} ms; "
                  f"wall best {min(wall) * 1e3:.1f} med {statistics.median(wall) * 1e3:.1f} ms; "
                  f"tokens/s by CPU time {batch / min(cpu):.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
