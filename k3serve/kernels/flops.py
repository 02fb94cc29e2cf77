"""FLOP counts and the machine's matmul ceiling, shared by `k3serve bench kernels` and training's MFU figures
(core code: training must not import a bench harness, and benches may import training)."""

from __future__ import annotations

import time

import torch

CHUNK = 32   # chunk_kda_torch's default chunk size (the fastest of 32, 64, 128); kda_cpu.CHUNK is 16


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` after one warm-up call (allocator, first-call
    overheads), so other load on the machine inflates it less."""
    fn()
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Achieved fp32 GFLOP/s of one n x n x n torch.mm on this machine (best of repeats)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2.0 * n**3 / best_time(lambda: torch.mm(a, b), repeats) / 1e9


def chunk_flops(B: int, T: int, H: int, K: int, V: int, C: int = CHUNK) -> float:
    """Matmul-equivalent FLOPs of the chunked algorithm at chunk size C (elementwise work ignored): count each
    kernel with its own C (chunk_kda_torch 32, the fused chunk_kda_cpu 16, training's kda_autograd 16); the
    count shrinks with C (its C^2 and C^3 terms), so a smaller chunk is never credited with more work.

    Per chunk and head: scores [2C, K] x [K, C] over the sub-chunks (4 C^2 K), the unit
    triangular inverse (~C^3), (I+L)^-1 [K | V] (2 C^2 (K+V)), and the state pass:
    [W; Q e^G] S (4 C K V), K_d^T V_n (2 C K V), Aqk V_n (2 C^2 V). Dense products: the fused kernel skips
    blocks it knows are zero (upper triangles), so at C = 16 it executes ~96% of this (K = V = 64).
    """
    chunks = B * H * -(-T // C)
    per = 4 * C * C * K + C**3 + 2 * C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    return float(chunks * per)
