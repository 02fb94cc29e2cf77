"""CPU micro-benchmark of the KDA torch paths (chunked vs token-recurrent).

``run_kernel_bench`` returns a JSON-able dict; the CLI (``k3serve bench kernels --json``) is
wired elsewhere. Timings are the best of ``repeats`` runs after one warm-up, so other load on
the machine inflates them less; the thread count is reported with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.kernels.flops import CHUNK, best_time, chunk_flops, matmul_gflops  # noqa: F401 (re-exported)
from k3serve.kernels.gate import kda_gate
from k3serve.kernels.kda import chunk_kda, recurrent_kda


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
    t_chunk = best_time(lambda: chunk_kda(q, k, v, g, beta, **kw), repeats)
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
    t_chunk = best_time(lambda: chunk_kda(q, k, v, g, beta, **kw), repeats)
    t_rec = best_time(lambda: recurrent_kda(q, k, v, g, beta, **kw), repeats)
    g_kl = _inputs(B, T, H, K, lower_bound=None)[3]
    t_chunk_kl = best_time(lambda: chunk_kda(q, k, v, g_kl, beta, **kw), repeats)

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
