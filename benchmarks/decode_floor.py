"""The fastest a batch-1 decode step can be on this machine's BLAS: its matrix products and nothing else.

``bench decode`` reports a step's achieved bandwidth against the machine's copy bandwidth. A step at batch 1 is
one GEMV per weight matrix it reads (every non-embedding weight, and ``k`` routed experts per MoE layer) plus
everything between them (norms, the KDA recurrence, routing, attention over the context, dispatch). This times
those GEMVs alone, back to back, each matrix read cold (the model's weights are larger than the last-level
cache, as in a real step), with the library ``F.linear`` calls (MKL's fp32 GEMV on the CPU)::

    for each weight matrix W [n, K] a batch-1 step reads:   y = F.linear(x [1, K], W)

No step that computes these products with this library is faster, so ``fraction_of_copy`` (the step-byte model's
bytes over this time, over the copy bandwidth) bounds what ``achieved_fraction["1"]`` can reach here: where it is
below a target, the target needs a GEMV faster than the library's on these matrix sizes, not less overhead
(the "batch 1 >= 0.5 of copy bandwidth" target: docs/performance.md). Full-precision weights only (an MXFP4 checkpoint's routed experts are packed bytes: not counted).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from k3serve.model.config import ModelConfig


def step_matrices(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point weight matrices one batch-1 decode step multiplies by: every 2-D weight but the
    embedding table (a step reads one row of it), and of each MoE layer's routed experts ``k`` (all experts of
    a layer have one shape; the step-byte model counts ``k`` distinct experts at batch 1)."""
    out = []
    for name, w in weights.items():
        if w.dim() != 2 or not w.is_floating_point() or name.endswith("embed_tokens.weight"):
            continue
        if ".experts." in name and int(name.split(".experts.")[1].split(".")[0]) >= cfg.num_experts_per_token:
            continue
        out.append(w.contiguous())
    return out


def gemv_floor_s(matrices: list[torch.Tensor], repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` passes of one ``F.linear`` of a single row through every matrix
    (after one warm-up pass)."""
    if not matrices:
        raise ValueError("gemv_floor_s: no matrices")
    rows = {m.shape[1]: torch.randn(1, m.shape[1], dtype=m.dtype) for m in matrices}
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            for m in matrices:
                F.linear(rows[m.shape[1]], m)
            if i:
                best = min(best, time.perf_counter() - t0)
    return best


def gemv_floor(cfg: ModelConfig, weights: dict[str, torch.Tensor], step_bytes_1: int, copy_gbps: float,
               step_s_1: float, repeats: int = 5) -> dict:
    """The floor against this run's figures: ``step_bytes_1`` (the step-byte model at batch 1), ``copy_gbps``,
    ``step_s_1`` (the measured batch-1 step). Returns the floor's seconds, the GB/s of weights it reads, its
    fraction of the copy bandwidth under the step-byte model, and the measured step over it."""
    if copy_gbps <= 0 or step_s_1 <= 0:
        raise ValueError(f"copy_gbps and step_s_1 must be positive, got {copy_gbps} and {step_s_1}")
    matrices = step_matrices(cfg, weights)
    floor = gemv_floor_s(matrices, repeats)
    read = sum(m.numel() * m.element_size() for m in matrices)
    return {"matrices": len(matrices), "weight_bytes": read, "s": floor, "weights_gbps": read / floor / 1e9,
            "fraction_of_copy": step_bytes_1 / floor / 1e9 / copy_gbps, "step_over_floor": step_s_1 / floor}
