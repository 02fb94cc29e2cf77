"""Small random states and specs shared by the transfer tests."""

from __future__ import annotations

import threading

import torch

from k3serve.transfer.spec import StateGeometry, TransferSpec


def random_state(p: int, *, layers: int = 3, heads: int = 8, block: int = 1312, mla_layers: int = 2,
                 tokens: int = 700, dim: int = 80, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """P prefill ranks' KDA parts `[L, H/P, block]` and MLA rows `[L_mla, tokens, dim]`."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(layers, heads, block, generator=g)
    return [c.contiguous() for c in full.chunk(p, dim=1)], torch.randn(mla_layers, tokens, dim, generator=g)


def make_spec(tid: str, parts, mla, d: int, chunk_bytes: int = 16384) -> TransferSpec:
    return TransferSpec(tid, "req-" + tid, StateGeometry.of_state(parts, mla), len(parts), d, page_tokens=64,
                        chunk_bytes=chunk_bytes)


def send_all(open_sender, spec, parts, mla) -> list[object]:
    """Every prefill rank's sender (``open_sender(rank)``, a context manager) in its own thread; the results
    (SendResult or TransferFailed) in rank order."""
    from k3serve.transfer.sender import TransferFailed

    out: list[object] = [None] * len(parts)

    def one(r: int) -> None:
        with open_sender(r) as s:
            try:
                out[r] = s.send(spec, parts[r], mla)
            except TransferFailed as e:
                out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
