"""The least a prefix-cache hit can cost over a cold prompt of its increment alone, on this machine.

``bench prefix`` times three prompts on one warm engine: a cold ``prefix + increment``, a hit on that prefix
(``increment`` new tokens), and a cold prompt of the increment alone ("short"). The hit and the short prompt run
the same layers over the same number of new tokens; what the hit does on top is attend to the cached prefix in
each MLA layer (KDA layers restore a fixed-size state from a checkpoint: a copy of a few KB per head, nothing
that grows with the prefix). Counted in the cheaper of MLA's two forms (the decompressed one; the absorbed form
scores in the latent space and needs more)::

    per MLA layer, T new tokens over L cached rows, H heads:
      decompress the cached latents   2 * L * rank * H * (d_nope + d_v)     (k_nope and v of every cached row)
      scores                          2 * H * T * L * (d_nope + d_rope)
      weighted values                 2 * H * T * L * d_v

At the machine's own fp32 matmul rate (measured in the same run) that work takes ``extra_flops / peak`` seconds
even if every FLOP ran at the GEMM's peak and the softmax were free, so no fp32 implementation's hit is faster
than ``short + extra_flops / peak``: ``hit_over_cold_short_floor`` is that over ``short``. A target ratio below
it cannot be met on this machine by any implementation that keeps the model's fp32 numerics (the "hit within
1.5x of a cold short prompt" target: docs/performance.md).
"""

from __future__ import annotations

from k3serve.kernels.flops import matmul_gflops
from k3serve.model.config import ModelConfig

PEAK_N = 2048  # the square GEMM that measures the peak: the largest this machine's caches reward (2-thread fp32)


def hit_extra_flops(cfg: ModelConfig, cached: int, new: int, tp: int = 1) -> float:
    """FLOPs a hit of ``new`` tokens over ``cached`` cached tokens does beyond a cold prompt of ``new`` tokens
    (module doc), summed over the MLA layers, for one rank of a ``tp``-way group (heads split over ranks)."""
    heads = cfg.num_attention_heads // tp
    d_nope, d_rope, d_v, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    per_layer = (2.0 * cached * rank * heads * (d_nope + d_v)
                 + 2.0 * heads * new * cached * (d_nope + d_rope)
                 + 2.0 * heads * new * cached * d_v)
    return per_layer * cfg.num_mla_layers


def peak_gflops(n: int = PEAK_N) -> float:
    """fp32 GFLOP/s of an ``n x n x n`` torch.mm at the current thread count (``matmul_gflops``, the kernel
    bench's ceiling, at the size that reads highest here)."""
    return matmul_gflops(n)


def hit_floor(cfg: ModelConfig, cached: int, new: int, short_s: float, hit_s: float, peak: float) -> dict:
    """The hit's floor against the measured short prompt (``short_s`` seconds) at ``peak`` GFLOP/s: the extra
    GFLOP, the seconds they take at the peak, ``hit_over_cold_short_floor``, and the fraction of the peak the
    measured hit (``hit_s``) ran its extra work at (``hit_extra_achieved_fraction``: the extra work at the peak
    over the hit's time beyond the short prompt's; 1 would be the floor)."""
    if short_s <= 0 or hit_s <= 0 or peak <= 0:
        raise ValueError(f"short_s, hit_s and peak must be positive, got {short_s}, {hit_s} and {peak}")
    extra = hit_extra_flops(cfg, cached, new)
    at_peak = extra / (peak * 1e9)
    return {"hit_extra_gflop": extra / 1e9, "matmul_peak_gflops": peak, "hit_extra_at_peak_s": at_peak,
            "hit_over_cold_short_floor": (short_s + at_peak) / short_s,
            "hit_extra_achieved_fraction": at_peak / max(hit_s - short_s, at_peak)}
