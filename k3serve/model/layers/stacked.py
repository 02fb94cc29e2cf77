"""Row-stacked input projections for decode steps (docs/performance.md).

Several projections of the same input ``x`` (a KDA layer's q, k, v, gates; an MLA layer's latent, query and gate
projections) run as one GEMV over their weights stacked by rows: one OpenMP region per layer instead of one per
projection. The separate weights become row views of the stack, so each is held once::

    w_in = [W_0; W_1; ...; W_{n-1}]      [sum out_i, d]       F.linear(x, w_in).split(sizes, -1) -> per projection

For one token per request (M = 1, the single-request reference) the stacked GEMV gives the separate GEMVs' bits;
for M > 1 the wider output may round the last bit differently, like any other change of batch. Weights that train
(requires_grad) keep the separate GEMMs.

Numerics mode ``deterministic`` uses the stack for every call (prefill, decode, verify), through
``ops.linear``'s fixed row tiles: from MIN_TILE rows on, an output column of a GEMM has the same bits whatever
the other columns of the call (pinned for the model's shapes, tests/model/test_numerics_invariants.py), so each
projection's columns do not depend on the stack, on the batch, nor on the TP degree (each rank stacks its own
column slices; the stack stays wider than the bmm floor on every TP). A projection whose units are narrower
than the bmm floor (KDA's 1-head ``b_proj`` units) keeps its own GEMMs there: a 1-column GEMM rounds
differently from a column of the stack.
"""

from __future__ import annotations

import torch


def stack_rows(parts: list[torch.Tensor], deterministic: bool
               ) -> tuple[torch.Tensor | None, tuple[int, ...], tuple[torch.Tensor, ...]]:
    """(w_in `[sum out_i, d]` or None, sizes, views of w_in replacing ``parts`` one for one).

    None (and ``parts`` unchanged) where the stack must not be used: trained weights. `deterministic` (the
    numerics mode) does not change the stack, only how the layers multiply with it (module docstring)."""
    del deterministic
    if any(t.requires_grad for t in parts):
        return None, (), tuple(parts)
    with torch.no_grad():
        w_in = torch.cat(parts)
    sizes = tuple(t.shape[0] for t in parts)
    return w_in, sizes, w_in.split(sizes)
