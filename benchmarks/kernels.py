"""CPU micro-benchmark of the KDA kernels (chunked vs token-recurrent).

``run_kernel_bench`` returns a JSON-able dict; the CLI (``k3serve bench kernels --json``) is
wired elsewhere. Timings are the best of ``repeats`` runs after one warm-up, so other load on
the machine inflates them less; the thread count is reported with them.

The ``chunk_*`` keys time what CPU callers get (``chunk_kda``'s default dispatch, named in
``chunk_backend``: the fused numba kernel where numba imports); the ``torch_chunk_*`` keys time the
vectorised torch path (``backend="torch"``) on the same inputs in the same run, side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.kernels.cpu import kda_cpu
from k3serve.kernels.flops import CHUNK, best_time, chunk_flops, matmul_gflops  # noqa: F401 (re-exported)
from k3serve.kernels.gate import kda_gate
from k3serve.kernels.kda import chunk_backend, chunk_kda, recurrent_kda


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


def _time_chunk(q, k, v, g, beta, backend: str | None, repeats: int) -> float:
    kw = dict(scale=1.0, output_final_state=True, backend=backend)
    return best_time(lambda: chunk_kda(q, k, v, g, beta, **kw), repeats)


def _chunk_size(backend: str) -> int:
    """The chunk size the named chunk_kda backend runs (its FLOPs are counted with it)."""
    return kda_cpu.CHUNK if backend == "cpu" else CHUNK


def _chunk_keys(prefix: str, T: int, t: float, flops: float, mm: float) -> dict:
    return {f"{prefix}chunk_tokens_per_s": T / t, f"{prefix}chunk_seconds": t, f"{prefix}chunk_flops": flops,
            f"{prefix}chunk_gflops": flops / t / 1e9, f"{prefix}chunk_achieved_fraction": flops / t / 1e9 / mm}


def _chunk_only(T: int, H: int, K: int, repeats: int, mm: float) -> dict:
    """Chunked KDA alone at head size K (V = K), default dispatch and torch path: tokens/s and the fraction of
    the matmul ceiling `mm`."""
    q, k, v, g, beta = _inputs(1, T, H, K, lower_bound=-5.0)
    which = chunk_backend()
    return {"K": K, "chunk_backend": which,
            **_chunk_keys("", T, _time_chunk(q, k, v, g, beta, None, repeats),
                          chunk_flops(1, T, H, K, K, _chunk_size(which)), mm),
            **_chunk_keys("torch_", T, _time_chunk(q, k, v, g, beta, "torch", repeats),
                          chunk_flops(1, T, H, K, K, CHUNK), mm)}


def run_kernel_bench(T: int = 4096, H: int = 4, K: int = 64, repeats: int = 3) -> dict:
    """Time chunk_kda vs recurrent_kda (CPU, fp32, B = 1, V = K), the chunked form both as dispatched by default
    (``chunk_*``, ``chunk_backend`` names it) and on the torch path (``torch_chunk_*``).

    Gates use the K3 form (lower bound -5), the path the model serves; the chunk path is
    also timed with the unbounded Kimi-Linear gate, which may take the slower exact
    fallback for the within-sub-chunk decays.

    Returns a dict with chunk/recurrent tokens per second, their ratio (``speedup``), the
    machine's torch.mm GFLOP/s, each chunk implementation's FLOP estimate (``chunk_flops`` at its own
    chunk size: 16 for the fused CPU kernel, 32 for the torch path) and achieved fraction of the
    ceiling, the sizes used, and ``head_dim_128``: the chunked form alone at K = V = 128 (the real
    per-head size) against the same ceiling.
    """
    B, V = 1, K
    q, k, v, g, beta = _inputs(B, T, H, K, lower_bound=-5.0)
    t_chunk = _time_chunk(q, k, v, g, beta, None, repeats)
    t_torch = _time_chunk(q, k, v, g, beta, "torch", repeats)
    t_rec = best_time(lambda: recurrent_kda(q, k, v, g, beta, scale=1.0, output_final_state=True), repeats)
    g_kl = _inputs(B, T, H, K, lower_bound=None)[3]
    t_chunk_kl = _time_chunk(q, k, v, g_kl, beta, None, repeats)
    t_torch_kl = _time_chunk(q, k, v, g_kl, beta, "torch", repeats)

    mm = matmul_gflops()
    which = chunk_backend()
    return {
        "chunk_backend": which,
        **_chunk_keys("", B * T, t_chunk, chunk_flops(B, T, H, K, V, _chunk_size(which)), mm),
        "chunk_tokens_per_s_unbounded_gate": B * T / t_chunk_kl,
        **_chunk_keys("torch_", B * T, t_torch, chunk_flops(B, T, H, K, V, CHUNK), mm),
        "torch_chunk_tokens_per_s_unbounded_gate": B * T / t_torch_kl,
        "chunk_speedup_over_torch": t_torch / t_chunk,
        "recurrent_tokens_per_s": B * T / t_rec,
        "recurrent_seconds": t_rec,
        "speedup": t_rec / t_chunk,
        "matmul_gflops": mm,
        "head_dim_128": _chunk_only(T, H, 128, repeats, mm) if K != 128 else None,
        "sizes": {"B": B, "T": T, "H": H, "K": K, "V": V, "chunk": _chunk_size(which), "torch_chunk": CHUNK,
                  "dtype": "float32"},
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
    }


if __name__ == "__main__":   # python -m benchmarks.kernels
    import json

    print(json.dumps(run_kernel_bench(), indent=2))
