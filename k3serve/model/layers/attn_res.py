"""Block Attention Residuals (K3, MODEL.md §4): softmax mixing over depth, per token, in fp32.

Sources are the embedding, the sum of each completed block's sublayer outputs, and the running partial sum of
the current block. A mix scores each source with a learned pseudo-query against its RMS-normalised value.
No state survives between decode steps.
"""

from __future__ import annotations

import torch

from k3serve.model.scalars import as_dtype, fp32


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, softmax0=None, row_dot=None) -> torch.Tensor:
    """sources: n tensors `[..., d]`; query `[1, d]`; norm_weight `[d]` -> `[..., d]` in the sources' dtype.

    softmax0: the softmax over the sources (dim 0 of `[n, ...]`); None is ``Tensor.softmax(0)``.
    row_dot: `(x [..., d], v [d]) -> [...]`, each row's dot product with v; None is the elementwise product and
    row sum. The model passes its numerics mode's operators (model/deterministic.py): the default mode's GEMV,
    the deterministic mode's forms whose bits do not depend on the token count.

    out = sum_i softmax_i(<query, RMSNorm(v_i)>) * v_i

    Sources are scored and summed one by one (then a running weighted sum, in place when autograd is off):
    no `[n, ..., d]` stack and no full-size temporaries of it; this mix runs twice per layer on every token.
    With the deterministic mode's operators the bits of a token's output depend only on its own row (row
    reductions, elementwise products), so its batch invariance holds (tests/engine/test_deterministic_paths.py).
    """
    q = query.float().view(-1)
    d = q.numel()
    # <q, RMSNorm(v) w> = rsqrt(mean(v^2) + eps) * <v, w q>: one product and two row reductions per source (the
    # norm's own reduction fused), instead of a normalised copy scaled twice
    wq = norm_weight.float() * q  # [d]
    vals = [s.float() for s in sources]
    dot = row_dot if row_dot is not None else (lambda x, v: (x * v).sum(-1))
    d_t, eps_t = fp32(d), fp32(eps)  # 0-dim fp32 operands: no per-call scalar conversion (scalars.py)
    logits = torch.stack([dot(v, wq) * torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / d_t + eps_t)
                          for v in vals])  # [n, ...]
    weights = (logits.softmax(0) if softmax0 is None else softmax0(logits)).unsqueeze(-1)  # [n, ..., 1]
    out = vals[0] * weights[0]
    grad = torch.is_grad_enabled()
    for v, w in zip(vals[1:], weights[1:]):
        # the same kernel either way (the same bits with and without autograd); in place when serving
        out = torch.addcmul(out, v, w) if grad else out.addcmul_(v, w)
    return as_dtype(out, sources[0].dtype)
