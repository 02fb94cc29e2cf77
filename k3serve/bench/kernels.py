"""CPU micro-benchmark of the KDA torch paths (chunked vs token-recurrent).

``run_kernel_bench`` returns a JSON-able dict; the CLI (``k3serve bench kernels --json``) is
wired elsewhere. Timings are the best of ``repeats`` runs after one warm-up, so other load on
the machine inflates them less; the thread count is reported with them.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from k3serve.kernels.gate import kda_gate
from k3serve.kernels.kda import chunk_kda, recurrent_kda

CHUNK = 32   # chunk_kda_torch's default chunk size (chosen by measurement, docs/profile.md), used in the FLOP model


def _best_time(fn, repeats: int) -> float:
    fn()                                    # warm-up (allocator, first-call overheads)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Achieved fp32 GFLOP/s of one n x n x n torch.mm on this machine (best of repeats)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2.0 * n**3 / _best_time(lambda: torch.mm(a, b), repeats) / 1e9


def chunk_flops(B: int, T: int, H: int, K: int, V: int, C: int = CHUNK) -> float:
    """Matmul-equivalent FLOPs of chunk_kda_torch (elementwise work ignored).

    Per chunk and head: scores [2C, K] x [K, C] over the sub-chunks (4 C^2 K), the unit
    triangular inverse (~C^3), (I+L)^-1 [K | V] (2 C^2 (K+V)), and the state pass:
    [W; Q e^G] S (4 C K V), K_d^T V_n (2 C K V), Aqk V_n (2 C^2 V).
    """
    chunks = B * H * -(-T // C)
    per = 4 * C * C * K + C**3 + 2 * C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    return float(chunks * per)


def _inputs(B, T, H, K, lower_bound, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    z = torch.randn(B, T, H * K, generator=gen)
    A_log = torch.log(torch.linspace(1.0, 16.0, H))
    g = kda_gate(z, A_log, torch.zeros(H * K), lower_bound, backend="torch")
    return q, k, v, g, beta


def _chunk_only(T: int, H: int, K: int, repeats: int, mm: float) -> dict:
    """Chunked KDA alone at head size K (V = K): tokens/s and the fraction of the matmul ceiling `mm`."""
    q, k, v, g, beta = _inputs(1, T, H, K, lower_bound=-5.0)
    kw = dict(scale=1.0, output_final_state=True, backend="torch")
    t_chunk = _best_time(lambda: chunk_kda(q, k, v, g, beta, **kw), repeats)
    flops = chunk_flops(1, T, H, K, K)
    return {"K": K, "chunk_tokens_per_s": T / t_chunk, "chunk_seconds": t_chunk, "chunk_flops": flops,
            "chunk_gflops": flops / t_chunk / 1e9, "chunk_achieved_fraction": flops / t_chunk / 1e9 / mm}


def run_kernel_bench(T: int = 4096, H: int = 4, K: int = 64, repeats: int = 3) -> dict:
    """Time chunk_kda vs recurrent_kda (torch backend, CPU, fp32, B = 1, V = K).

    Gates use the K3 form (lower bound -5), the path the model serves; the chunk path is
    also timed with the unbounded Kimi-Linear gate, which may take the slower exact
    fallback for the within-sub-chunk decays.

    Returns a dict with chunk/recurrent tokens per second, their ratio (``speedup``), the
    machine's torch.mm GFLOP/s, the chunk path's FLOP estimate and achieved fraction of it,
    the sizes used, and ``head_dim_128``: the chunk path alone at K = V = 128 (the real
    per-head size) against the same ceiling.
    """
    B, V = 1, K
    q, k, v, g, beta = _inputs(B, T, H, K, lower_bound=-5.0)
    kw = dict(scale=1.0, output_final_state=True, backend="torch")
    t_chunk = _best_time(lambda: chunk_kda(q, k, v, g, beta, **kw), repeats)
    t_rec = _best_time(lambda: recurrent_kda(q, k, v, g, beta, **kw), repeats)
    g_kl = _inputs(B, T, H, K, lower_bound=None)[3]
    t_chunk_kl = _best_time(lambda: chunk_kda(q, k, v, g_kl, beta, **kw), repeats)

    mm = matmul_gflops()
    flops = chunk_flops(B, T, H, K, V)
    chunk_gflops = flops / t_chunk / 1e9
    return {
        "chunk_tokens_per_s": B * T / t_chunk,
        "recurrent_tokens_per_s": B * T / t_rec,
        "speedup": t_rec / t_chunk,
        "chunk_tokens_per_s_unbounded_gate": B * T / t_chunk_kl,
        "chunk_seconds": t_chunk,
        "recurrent_seconds": t_rec,
        "matmul_gflops": mm,
        "chunk_flops": flops,
        "chunk_gflops": chunk_gflops,
        "chunk_achieved_fraction": chunk_gflops / mm,
        "head_dim_128": _chunk_only(T, H, 128, repeats, mm) if K != 128 else None,
        "sizes": {"B": B, "T": T, "H": H, "K": K, "V": V, "chunk": CHUNK, "dtype": "float32"},
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
    }


if __name__ == "__main__":   # python -m k3serve.bench.kernels
    import json

    print(json.dumps(run_kernel_bench(), indent=2))
