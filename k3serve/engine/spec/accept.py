"""Lossless acceptance of drafted tokens (Leviathan et al. / Chen et al.), keyed like plain sampling.

Verify row i (0 <= i <= m, m drafts) holds the target's logits for absolute position p + i + 1, where p is the
position of x_0. Every random draw for position P comes from ``position_generator(seed, P)``, the generator
plain sampling uses for P, so the output is a function of (prompt, sampling, drafter) and a resumed request
continues exactly.

Drafts are taken as given (q one-hot on each draft: n-gram and greedy EAGLE-3 drafters): row i draws the target's
own token t_i = sample_token(row i, params, p+i+1), exactly the token plain decoding would draw; the draft is
accepted iff t_i == x_{i+1}; the first mismatch emits t_i (the correction); all m accepted emits t_m (the bonus).
Greedy is the special case t_i = argmax. This is the standard rule for one-hot q: accept with probability
min(1, p(x)/q(x)) = p(x); on rejection t_i ~ p restricted to tokens != x, renormalised, which is the residual
max(0, p - q) / Z. With this coupling the tokens equal plain decoding's token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.model.sampling import sample_token


@dataclass(frozen=True)
class Acceptance:
    """accepted: drafts accepted (0..m); tokens: the emitted tokens, accepted drafts then the correction/bonus."""

    accepted: int
    tokens: tuple[int, ...]


def accept_drafts(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
                  position: int) -> Acceptance:
    """Apply the acceptance rule to one request's verify rows.

    Args:
        logits: `[m + 1, vocab]` target logits of the verify rows (row i predicts position + i + 1).
        drafts: the m drafted tokens x_1 .. x_m.
        params: the request's sampling parameters.
        position: absolute position of x_0 (the last committed token).
    """
    m = len(drafts)
    if logits.shape[0] != m + 1:
        raise ValueError(f"accept_drafts: logits must have m + 1 = {m + 1} rows, got {logits.shape[0]}")
    out: list[int] = []
    for i in range(m + 1):
        pos = position + i + 1
        if i == m:  # every draft accepted: the bonus token, drawn as plain sampling draws it
            out.append(sample_token(logits[i], params, pos))
            return Acceptance(m, tuple(out))
        x = int(drafts[i])
        t = sample_token(logits[i], params, pos)
        if t != x:
            out.append(t)
            return Acceptance(i, tuple(out))
        out.append(x)
    raise AssertionError("unreachable")  # the loop returns at i == m
