"""Who sends what to whom: the pure P -> D resharding plan for KDA heads and MLA pages (DESIGN.md §6).

```
 H heads, prefill TP = P, decode TP = D          e.g. H = 8, P = 2, D = 4
 prefill rank p holds heads [p*H/P, (p+1)*H/P)    p0: h0..h3        p1: h4..h7
 decode rank  r holds heads [r*H/D, (r+1)*H/D)    r0: h0 h1  r1: h2 h3  r2: h4 h5  r3: h6 h7
 head h: src (h // (H/P), h % (H/P)) -> dst (h // (H/D), h % (H/D))
```
Each (layer, head) block is contiguous at both ends, so it lands at its offset with no reorganisation.
MLA rows are identical on every prefill rank and needed by every decode rank: page ranges are assigned
round-robin to prefill ranks so P > 1 sends in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PlanError(ValueError):
    """A layout the transfer cannot serve (raised at configuration time)."""


@dataclass(frozen=True)
class HeadRoute:
    head: int
    src_rank: int
    src_local: int
    dst_rank: int
    dst_local: int


def check_layout(heads: int, p: int, d: int) -> None:
    if p <= 0 or d <= 0:
        raise PlanError(f"TP degrees must be positive (prefill {p}, decode {d})")
    for what, t in (("prefill", p), ("decode", d)):
        if heads % t:
            raise PlanError(f"{heads} KDA heads cannot be split over {what} TP={t}: heads must be divisible by TP")


def head_routes(heads: int, p: int, d: int) -> list[HeadRoute]:
    check_layout(heads, p, d)
    hp, hd = heads // p, heads // d
    return [HeadRoute(h, h // hp, h % hp, h // hd, h % hd) for h in range(heads)]


def page_senders(num_pages: int, p: int) -> list[list[int]]:
    """Page indices each prefill rank sends (round-robin), e.g. 5 pages over P=2 -> [[0, 2, 4], [1, 3]]."""
    return [list(range(r, num_pages, p)) for r in range(p)]


def reshard_kda(parts: list[torch.Tensor], d: int) -> list[torch.Tensor]:
    """Prefill ranks' KDA state -> decode ranks' KDA state, head block by head block.

    parts: P tensors `[L_kda, H/P, block]`; returns D tensors `[L_kda, H/D, block]` (new memory).
    """
    p = len(parts)
    layers, hp, block = parts[0].shape
    heads = hp * p
    routes = head_routes(heads, p, d)
    out = [torch.empty(layers, heads // d, block, dtype=parts[0].dtype) for _ in range(d)]
    for r in routes:
        out[r.dst_rank][:, r.dst_local] = parts[r.src_rank][:, r.src_local]
    return out
