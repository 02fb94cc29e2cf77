"""Full-precision routed experts of one rank as stacked weights, multiplied with one grouped GEMM per matrix.

A decode step of the bench preset at batch 32 activates nearly every expert with a few rows each; the per-expert
loop then issued 3 small GEMMs, a gate and a gather per active expert and MoE layer (~100 ops per layer), and
under 2 OpenMP threads every one of them paid a thread rendezvous (docs/performance.md). Here a
rank's experts are stacked once at load and the sorted rows run through ``F.grouped_mm``: 2 GEMM calls and one
gate per MoE layer, whatever the number of active experts. The CPU ``grouped_mm`` still runs one ``mm`` (one
OpenMP region) per group, so when many experts are active (``PADDED_MIN_ACTIVE``, a decode batch of ~8 and more)
the runs are zero-padded to the longest and multiplied with 3 ``bmm`` instead (:func:`padded_experts`)::

    rows sorted by expert      z_s = [rows of e0 | rows of e1 | ... ]        [n, e_in]
    offs[i]                    end of local expert i's run in z_s (int32, cumulative counts; empty runs allowed)
    [g | u] = z_s W13[e]^T     per run, one GEMM for the gate and the up   [n, 2 I]
    y = glu(g, u) W2[e]^T      per run                                      -> [n, e_in]

Each expert's gate and up weights are stacked as one `[2 I, e_in]` matrix (``W13[e]`` = [W1[e]; W3[e]]): one GEMM
where there were two, and a decode step's ``glu`` runs once over all its rows. A column of a CPU GEMM has the same
bits whatever the other columns of the call (MKL and oneDNN, pinned in tests/model/test_numerics_invariants.py,
tests/model/test_moe_grouped.py), so ``g`` and ``u`` are the separate GEMMs' values bit for bit.

On the CPU, ``grouped_mm`` runs each group as one ``mm`` of that group's rows, which is the GEMM the loop's
``F.linear(z[rows], W)`` ran: results are bit-identical to the loop (checked in tests/model/test_moe_grouped.py),
and idle experts' weights are never read. Not used when the weights require grad (training rebuilds the model
over leaf views every step: a stacked copy would cut the gradient) or are MXFP4 (their ``lin(x)`` objects keep the
loop), or off the CPU (``grouped_mm`` on CUDA takes bf16 on SM80+ only; a Triton grouped GEMM over the same
``offs`` is the CUDA analogue).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3serve.model.layers.expert_weights import DenseLinear
from k3serve.model.layers.norm import glu


# Active experts from which the padded bmm form is used: with most experts active (bench preset, batch 8 and up,
# 2 threads) padded ran 2-4x faster than grouped (one OpenMP region per group); with few active, or one thread,
# padded is slower (it reads idle experts of the span and multiplies padding rows).
PADDED_MIN_ACTIVE = 8
# Longest run the padded form takes: decode-sized runs are weight-bandwidth bound, so padding rows cost no time;
# prefill runs (hundreds of rows, compute bound) would pay for the padding, and keep the grouped form.
PADDED_MAX_ROWS = 64


@dataclass(frozen=True)
class StackedExperts:
    """One rank's experts in local order: w13 `[E_local, 2 I, e_in]` (expert e's rows: its w1, then its w3) and
    w2 `[E_local, e_in, I]`, contiguous; ``w1`` and ``w3`` are views of w13."""

    w13: torch.Tensor
    w2: torch.Tensor

    @classmethod
    def of(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> "StackedExperts":
        """From separate stacks w1, w3 `[E, I, e_in]` and w2 `[E, e_in, I]` (one copy into w13)."""
        return cls(torch.cat([w1, w3], dim=1), w2.contiguous())

    @property
    def inner(self) -> int:
        """The experts' intermediate width I."""
        return self.w2.shape[2]

    @property
    def w1(self) -> torch.Tensor:
        """The gates `[E_local, I, e_in]` (a view of w13)."""
        return self.w13[:, : self.inner]

    @property
    def w3(self) -> torch.Tensor:
        """The ups `[E_local, I, e_in]` (a view of w13)."""
        return self.w13[:, self.inner:]

    @functools.cached_property
    def per_expert(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
        """(w1 `[I, e_in]`, w3 `[I, e_in]`, w2 `[e_in, I]`) of each local expert: 2-D views made once (a decode step
        reaches a few experts per layer; slicing them out per call was ~200 ops of a bench-preset step)."""
        w1, w3 = self.w1, self.w3
        return tuple((w1[i], w3[i], self.w2[i]) for i in range(self.w13.shape[0]))

    @functools.cached_property
    def per_expert_fused(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(w13 `[2 I, e_in]`, w2 `[e_in, I]`) of each local expert, as 2-D views made once."""
        return tuple((self.w13[i], self.w2[i]) for i in range(self.w13.shape[0]))

    def span(self, first: int, last: int) -> "StackedExperts":
        """Local experts first .. last-1 (views)."""
        return StackedExperts(self.w13[first:last], self.w2[first:last])

    def select(self, experts: torch.Tensor) -> "StackedExperts":
        """The local experts at indices `experts` `[n]` int64, copied (an exact copy)."""
        return StackedExperts(self.w13.index_select(0, experts), self.w2.index_select(0, experts))

    def views(self) -> list[tuple[DenseLinear, DenseLinear, DenseLinear]]:
        """Per local expert, (w1, w3, w2) as DenseLinear views of the stacks (no second copy of the weights)."""
        return [(DenseLinear(w1), DenseLinear(w3), DenseLinear(w2)) for w1, w3, w2 in self.per_expert]


def stack_dense_experts(experts: list[tuple[object, object, object]]) -> StackedExperts | None:
    """`experts`: per local expert (w1, w3, w2) linear objects. The stacks, or None where the grouped form does
    not apply (an MXFP4 expert, weights that require grad, weights off the CPU; module docstring)."""
    if not experts or not all(isinstance(lin, DenseLinear) for e in experts for lin in e):
        return None
    first = experts[0][0].weight
    if first.device.type != "cpu" or any(lin.weight.requires_grad for e in experts for lin in e):
        return None
    inner, e_in = first.shape
    with torch.no_grad():  # written in place: no per-expert temporary of [w1; w3]
        w13 = first.new_empty(len(experts), 2 * inner, e_in)
        for i, (w1, w3, _) in enumerate(experts):
            w13[i, :inner].copy_(w1.weight)
            w13[i, inner:].copy_(w3.weight)
        w2 = torch.stack([e[2].weight for e in experts])
    return StackedExperts(w13, w2)


def padded_experts(z_rows: torch.Tensor, expert: torch.Tensor, pos: torch.Tensor, width: int,
                   stacked: StackedExperts, act: str, beta1: float, beta2: float) -> torch.Tensor:
    """The same products as :func:`grouped_experts` as two ``bmm`` over `stacked`'s experts, each expert's rows
    zero-padded to `width` (the largest run)::

        buf[expert[a], pos[a]] = z_rows[a]        buf `[E_span, width, e_in]`, padding rows 0
        y_pad = glu(buf W13^T) W2^T               two bmm (one OpenMP region each, not one per expert)
        y[a] = y_pad[expert[a], pos[a]]

    z_rows `[n, e_in]`; expert, pos `[n]` int64 (span-local expert, row inside its run) -> `[n, e_in]`.
    Padding rows are exact zeros through glu (act(0) * 0 = 0) and never read back. Rounding may differ from the
    per-run GEMMs in the last bit (a GEMM's summation may depend on its row count), like any change of batch.
    """
    buf = z_rows.new_zeros(stacked.w13.shape[0], width, z_rows.shape[1])
    buf[expert, pos] = z_rows
    gu = torch.bmm(buf, stacked.w13.transpose(1, 2))  # [E_span, width, 2 I]: gate | up
    h = glu(gu[..., : stacked.inner], gu[..., stacked.inner:], act, beta1, beta2)
    return torch.bmm(h, stacked.w2.transpose(1, 2))[expert, pos]


def grouped_experts(z_sorted: torch.Tensor, offs: torch.Tensor, stacked: StackedExperts, act: str,
                    beta1: float, beta2: float) -> torch.Tensor:
    """z_sorted `[n, e_in]` (rows grouped by local expert), offs `[E_local]` int32 (run ends) -> `[n, e_in]`."""
    gu = F.grouped_mm(z_sorted, stacked.w13.transpose(1, 2), offs=offs)  # [n, 2 I]: gate | up
    h = glu(gu[:, : stacked.inner], gu[:, stacked.inner:], act, beta1, beta2)
    return F.grouped_mm(h, stacked.w2.transpose(1, 2), offs=offs)


def looped_experts(z_sorted: torch.Tensor, counts: list[int], stacked: StackedExperts, active: list[int], act: str,
                   beta1: float, beta2: float, ops=None) -> torch.Tensor:
    """:func:`grouped_experts` for the non-empty runs only: z_sorted `[n, e_in]` (rows grouped by expert), counts[i]
    rows of local expert active[i] of `stacked` -> `[n, e_in]`.

    ops None: each run's gate | up is the ``mm`` grouped_mm issues for it (bit-identical), written into one
    `[n, 2 I]` buffer, then one ``glu`` over all the rows (elementwise: the same bits as per run) and each run's
    down ``mm``; used when most of a span's experts are idle, whose empty groups grouped_mm would still visit
    (~12% of the layer's expert time at batch 1 on the bench preset). ops
    (model/deterministic.DefaultOps on oneDNN, model/cpu_gemm.py): the gate and up as one
    ``ops.linear_pair``, the down ``ops.linear``, on the packed weights."""
    out, at = torch.empty_like(z_sorted), 0
    if ops is not None:
        for n, i in zip(counts, active):
            w1, w3, w2 = stacked.per_expert[i]
            zi = z_sorted[at: at + n]
            gate, up = ops.linear_pair(zi, w1, w3)
            out[at: at + n] = ops.linear(glu(gate, up, act, beta1, beta2), w2)
            at += n
        return out
    fused, inner = stacked.per_expert_fused, stacked.inner
    gu = z_sorted.new_empty(z_sorted.shape[0], 2 * inner)
    for n, i in zip(counts, active):
        torch.mm(z_sorted[at: at + n], fused[i][0].t(), out=gu[at: at + n])
        at += n
    h, at = glu(gu[:, :inner], gu[:, inner:], act, beta1, beta2), 0
    for n, i in zip(counts, active):
        torch.mm(h[at: at + n], fused[i][1].t(), out=out[at: at + n])
        at += n
    return out
