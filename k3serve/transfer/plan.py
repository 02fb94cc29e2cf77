"""Who sends what to whom: the pure P -> D resharding plan for KDA heads and MLA pages (docs/architecture.md §14).

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


@dataclass(frozen=True)
class HeadSpan:
    """Heads [start, start + count) go from prefill rank src to decode rank dst: contiguous at both ends."""

    src_rank: int
    dst_rank: int
    start: int
    count: int


def head_spans(heads: int, p: int, d: int) -> list[HeadSpan]:
    """head_routes merged into maximal runs per (src, dst): one span per overlapping pair of rank ranges.

    e.g. H = 8, P = 2, D = 4 -> (0->0 h0-1) (0->1 h2-3) (1->2 h4-5) (1->3 h6-7); P = 4, D = 2 -> each prefill
    rank's two heads are one span into the decode rank that holds them.
    """
    spans: list[HeadSpan] = []
    for r in head_routes(heads, p, d):
        last = spans[-1] if spans else None
        if last and (last.src_rank, last.dst_rank) == (r.src_rank, r.dst_rank) and last.start + last.count == r.head:
            spans[-1] = HeadSpan(last.src_rank, last.dst_rank, last.start, last.count + 1)
        else:
            spans.append(HeadSpan(r.src_rank, r.dst_rank, r.head, 1))
    return spans


def page_ranges(num_pages: int, p: int, pages_per_range: int) -> list[list[tuple[int, int]]]:
    """(first page, page count) ranges each prefill rank sends, assigned round-robin.

    e.g. 5 pages, P = 2, 2 pages per range -> [[(0, 2), (4, 1)], [(2, 2)]]; with 1 page per range this is
    page_senders() in range form.
    """
    if p <= 0 or pages_per_range <= 0 or num_pages < 0:
        raise PlanError(f"page_ranges needs p > 0, pages_per_range > 0, num_pages >= 0 (got {p}, "
                        f"{pages_per_range}, {num_pages})")
    out: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    for i, first in enumerate(range(0, num_pages, pages_per_range)):
        out[i % p].append((first, min(pages_per_range, num_pages - first)))
    return out
