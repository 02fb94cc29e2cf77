"""The chunk plan of one (prefill rank, decode rank) stream: which bytes leave where and land where.

Pure and deterministic: sender and receiver both derive it from the TransferSpec, so the receiver knows every
chunk it must see (and checks each header against it) without trusting the sender's description.

Byte offsets (row = one head block for KDA, one token's latent row for MLA):

```
 KDA layer l, heads [s, s+c) from prefill rank p to decode rank r      (hp = H/P, hd = H/D, B = block bytes)

   sender  Handoff.kda[p]  [L, hp, B]:  src_byte = ((l*hp + s - p*hp) * B) + offset
           | l=0: h(p*hp) .. h(p*hp+hp-1) | l=1: ... |          heads s..s+c-1 are adjacent in both tensors,
   staging rank r          [L, hd, B]:  dst_byte = ((l*hd + s - r*hd) * B) + offset
           | l=0: h(r*hd) .. h(r*hd+hd-1) | l=1: ... |          so one span is one memcpy-able range

 MLA layer l, tokens [t, t+c) (a page range of this prefill rank)      (n = num_tokens, R = row bytes)

   sender Handoff.mla [L_mla, n, D] and staging [L_mla, n, D]:  src_byte = dst_byte = ((l*n + t) * R) + offset
```
A run of rows is cut into chunks of whole rows (``chunk_bytes // row_bytes`` rows each); a row larger than
``chunk_bytes`` is cut into pieces and ``offset`` is the piece's byte offset inside that row.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.transfer.plan import head_spans, page_ranges
from k3serve.transfer.spec import KDA_DTYPE, TransferSpec

KDA, MLA = "kda", "mla"


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a stream's plan. seq is its index in the plan (its identity on the wire)."""

    seq: int
    kind: str  # KDA | MLA
    layer: int  # index among the layers of `kind`
    start: int  # first global head (KDA) or first token (MLA)
    count: int  # heads or tokens
    row_elems: int  # floats per head block, or latent width
    dtype: str
    offset: int  # byte offset inside rows [start, start + count) (only non-zero when one row spans chunks)
    length: int  # payload bytes
    src_byte: int  # into the sender's tensor (Handoff.kda[src] or Handoff.mla), viewed as bytes
    dst_byte: int  # into the receiver's staging tensor (kda or mla), viewed as bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.count, self.row_elems)


def _cut(start: int, count: int, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """(first row, rows, byte offset in those rows, length) pieces of rows [start, start + count)."""
    if row_bytes <= chunk_bytes:
        per = chunk_bytes // row_bytes
        return [(start + i, min(per, count - i), 0, min(per, count - i) * row_bytes) for i in range(0, count, per)]
    return [(start + j, 1, off, min(chunk_bytes, row_bytes - off))
            for j in range(count) for off in range(0, row_bytes, chunk_bytes)]


def stream_plan(spec: TransferSpec, src: int, dst: int) -> tuple[ChunkRef, ...]:
    """Chunks prefill rank `src` sends to decode rank `dst`: KDA layers in order, then MLA layers in order."""
    g, p, d = spec.geometry, spec.prefill_tp, spec.decode_tp
    hp, hd = g.kda_heads // p, g.kda_heads // d
    out: list[ChunkRef] = []
    kda_row = g.kda_row_bytes
    spans = [s for s in head_spans(g.kda_heads, p, d) if (s.src_rank, s.dst_rank) == (src, dst)]
    for layer in range(g.kda_layers):
        for span in spans:
            src_base = (layer * hp + span.start - src * hp) * kda_row
            dst_base = (layer * hd + span.start - dst * hd) * kda_row
            for first, rows, off, length in _cut(span.start, span.count, kda_row, spec.chunk_bytes):
                rel = (first - span.start) * kda_row + off
                out.append(ChunkRef(len(out), KDA, layer, first, rows, g.kda_block_floats, KDA_DTYPE, off, length,
                                    src_base + rel, dst_base + rel))
    mla_row, n, pt = g.mla_row_bytes, g.num_tokens, spec.page_tokens
    ranges = page_ranges(spec.pages, p, spec.pages_per_range)[src]
    for layer in range(g.mla_layers):
        for first_page, n_pages in ranges:
            t0, t1 = first_page * pt, min(n, (first_page + n_pages) * pt)
            for first, rows, off, length in _cut(t0, t1 - t0, mla_row, spec.chunk_bytes):
                byte = (layer * n + first) * mla_row + off
                out.append(ChunkRef(len(out), MLA, layer, first, rows, g.mla_dim, g.mla_dtype, off, length,
                                    byte, byte))
    return tuple(out)


def by_layer(plan: tuple[ChunkRef, ...]) -> dict[tuple[str, int], list[ChunkRef]]:
    """The plan grouped by (kind, layer): what may leave once that layer is final."""
    out: dict[tuple[str, int], list[ChunkRef]] = {}
    for c in plan:
        out.setdefault((c.kind, c.layer), []).append(c)
    return out


def all_layers(spec: TransferSpec) -> list[tuple[str, int]]:
    g = spec.geometry
    return [(KDA, i) for i in range(g.kda_layers)] + [(MLA, i) for i in range(g.mla_layers)]
