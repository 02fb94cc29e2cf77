"""Explicit per-request state the model forward reads and updates.

KDA state: one block of fp32 values per (request, KDA layer, head), head-contiguous, so a TP rank's heads are a
view and one head is the unit of transfer (docs/architecture.md §7). S is stored **[K, V]** (key-major, as fla):

```
 block[b, layer, h] (block_floats = K*V + 3*(W-1)*K fp32 values):
 ┌──────────────── S_h: K x V ────────────────┬─ conv q_h ─┬─ conv k_h ─┬─ conv v_h ─┐
 │ S[i, j] at i*V + j                          │ (W-1) x K  │ (W-1) x K  │ (W-1) x K  │
 └─────────────────────────────────────────────┴────────────┴────────────┴────────────┘
   conv windows hold the last W-1 RAW (pre-conv) projections of h's channels, oldest first:
   conv x_h[t, d] at K*V + x*(W-1)*K + t*K + d   (x = 0 q, 1 k, 2 v)
```

MLA state: the 576-wide (``kv_lora_rank + qk_rope_head_dim``) latent row per token per MLA layer, behind the
:class:`LatentCache` interface: :class:`DenseLatentCache` (the reference: plain growing tensors, attention
decompressed) and :class:`PagedLatentCache` (engines: rows in a page pool addressed by block tables, decode
attention in the absorbed form by the paged kernel).
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass, field
from typing import Protocol

import torch

from k3serve.model.config import ModelConfig


# ----------------------------------------------------------------------------------------------- KDA blocks
def kda_recurrent_view(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """S of every head: blocks `[B, H, block_floats]` -> view `[B, H, K, V]` (V = K)."""
    b, h, _ = blocks.shape
    return blocks[..., : k * k].unflatten(-1, (k, k))


def kda_conv_view(blocks: torch.Tensor, k: int, window: int) -> torch.Tensor:
    """Conv windows: blocks `[B, H, block_floats]` -> view `[B, H, 3 (q,k,v), W-1, K]`."""
    return blocks[..., k * k:].unflatten(-1, (3, window, k))


def conv_window_channels(conv: torch.Tensor, which: int) -> torch.Tensor:
    """One projection's window in channel layout: conv `[B, H, 3, W-1, K]` -> `[B, W-1, H*K]` (copy)."""
    x = conv[:, :, which]  # [B, H, W-1, K]
    return x.permute(0, 2, 1, 3).flatten(2)


def store_conv_window(conv: torch.Tensor, which: int, window: torch.Tensor) -> None:
    """Inverse of :func:`conv_window_channels`: window `[B, W-1, H*K]` into conv `[B, H, 3, W-1, K]`."""
    b, h, _, w, k = conv.shape
    conv[:, :, which].copy_(window.view(b, w, h, k).permute(0, 2, 1, 3))


def conv_windows_all(conv: torch.Tensor) -> torch.Tensor:
    """The q, k and v windows at once in channel layout: conv `[B, H, 3, W-1, K]` -> `[B, W-1, 3*H*K]` (copy),
    channels ordered (projection, head, k) like a row-stacked q | k | v projection's output."""
    b, h, n, w, k = conv.shape
    return conv.permute(0, 3, 2, 1, 4).reshape(b, w, n * h * k)


def store_conv_windows_all(conv: torch.Tensor, window: torch.Tensor) -> None:
    """Inverse of :func:`conv_windows_all`: window `[B, W-1, 3*H*K]` into conv `[B, H, 3, W-1, K]`."""
    b, h, n, w, k = conv.shape
    conv.copy_(window.view(b, w, n, h, k).permute(0, 3, 2, 1, 4))


def new_kda_blocks(cfg: ModelConfig, batch: int, heads: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Zeroed KDA state for `batch` fresh requests: one `[batch, heads, block_floats]` fp32 tensor per KDA layer."""
    return [torch.zeros(batch, heads, cfg.kda_head_block_floats, dtype=torch.float32, device=device)
            for _ in range(cfg.num_kda_layers)]


# ------------------------------------------------------------------------------------------- MLA latents
class LatentCache(Protocol):
    """Per-request MLA latent rows. Positions come from ForwardBatch.start_positions."""

    paged: bool

    def write(self, mla_idx: int, rows: torch.Tensor, starts: list[int]) -> None:
        """Store rows `[B, T, D]` of MLA layer `mla_idx` at positions starts[b] .. starts[b]+T-1."""

    def read(self, mla_idx: int, b: int, length: int) -> torch.Tensor:
        """Rows 0..length-1 of request b: `[length, D]`."""

    def read_blocks(self, mla_idx: int, lengths: list[int], block: int) -> torch.Tensor:
        """Rows 0..lengths[b]-1 of every request b, cut into `block`-row blocks at absolute positions:
        `[sum_b ceil(lengths[b] / block), block, D]`, request order, each request's last block zero-padded."""


def blocks_of(rows: list[torch.Tensor], block: int) -> torch.Tensor:
    """rows[b] `[L_b, D]` -> `[sum_b ceil(L_b / block), block, D]` as LatentCache.read_blocks returns them
    (one copy per request)."""
    nbs = [-(-r.shape[0] // block) for r in rows]
    out = rows[0].new_empty(sum(nbs), block, rows[0].shape[1])
    flat, at = out.view(-1, rows[0].shape[1]), 0
    for r, nb in zip(rows, nbs):
        flat[at: at + r.shape[0]] = r
        flat[at + r.shape[0]: at + nb * block] = 0
        at += nb * block
    return out


class DenseLatentCache:
    """Growing per-request tensors; the reference generator's cache (no pages, no sharing)."""

    paged = False

    def __init__(self, num_mla_layers: int, batch: int) -> None:
        self._rows: list[list[torch.Tensor | None]] = [[None] * batch for _ in range(num_mla_layers)]

    def write(self, mla_idx: int, rows: torch.Tensor, starts: list[int]) -> None:
        for b, start in enumerate(starts):
            old = self._rows[mla_idx][b]
            have = 0 if old is None else old.shape[0]
            if have != start:
                raise ValueError(f"dense latent cache: request {b} has {have} rows, write starts at {start}")
            new = rows[b]
            self._rows[mla_idx][b] = new.clone() if old is None else torch.cat([old, new])

    def read(self, mla_idx: int, b: int, length: int) -> torch.Tensor:
        rows = self._rows[mla_idx][b]
        if rows is None or rows.shape[0] < length:
            raise ValueError(f"dense latent cache: request {b} has fewer than {length} rows")
        return rows[:length]

    def read_blocks(self, mla_idx: int, lengths: list[int], block: int) -> torch.Tensor:
        return blocks_of([self.read(mla_idx, b, n) for b, n in enumerate(lengths)], block)


@dataclass
class PagedLatentCache:
    """Latent rows in a shared page pool.

    pool `[num_pages, num_mla_layers, page_size, D]`; block_tables `[B, max_pages]` (int64) maps a request's
    logical page i (tokens i*page_size ..) to a physical page. Token p of request b lives at
    ``pool[block_tables[b, p // page_size], layer, p % page_size]``, which is row

        (page * num_mla_layers + layer) * page_size + p % page_size     of pool viewed as [-1, D]

    Reads gather with ``index_select`` (whole pages of ``pool[:, layer]``, or those flat row ids on the `[-1, D]`
    view of the contiguous pool): advanced indexing of the 4-d pool, or of its strided ``pool[:, layer]`` view,
    runs 3-30x slower on the CPU for the same copy.
    """

    pool: torch.Tensor
    block_tables: torch.Tensor
    paged: bool = True

    @property
    def page_size(self) -> int:
        return self.pool.shape[2]

    def _rows(self) -> torch.Tensor:
        """The pool as `[num_pages * num_mla_layers * page_size, D]` (a view; the worker allocates it contiguous)."""
        return self.pool.view(-1, self.pool.shape[-1])

    def _row_ids(self, mla_idx: int, pages: torch.Tensor, offs: torch.Tensor | int) -> torch.Tensor:
        """Flat row ids (class docstring) of rows `offs` of physical `pages` in layer `mla_idx` (broadcast)."""
        return (pages.to(torch.long) * self.pool.shape[1] + mla_idx) * self.page_size + offs

    def _slots(self, b: int, start: int, count: int) -> torch.Tensor:
        pos = torch.arange(start, start + count, device=self.pool.device)
        return self.block_tables[b, pos // self.page_size], pos % self.page_size

    def write(self, mla_idx: int, rows: torch.Tensor, starts: list[int]) -> None:
        t = rows.shape[1]
        for b, start in enumerate(starts):
            pages, offs = self._slots(b, start, t)
            self.pool[pages, mla_idx, offs] = rows[b].to(self.pool.dtype)  # index_put: as fast as index_copy_ here

    def read(self, mla_idx: int, b: int, length: int) -> torch.Tensor:
        # whole pages in one gather (a page's rows are contiguous), then the rows past the end cut off: the
        # same values as a per-row gather at a fraction of its cost (a prefix hit reads 8K rows per layer)
        n = -(-length // self.page_size)
        pages = self.pool[:, mla_idx].index_select(0, self.block_tables[b, :n])  # [n, page_size, D]
        return pages.view(-1, pages.shape[-1])[:length]

    def read_blocks(self, mla_idx: int, lengths: list[int], block: int) -> torch.Tensor:
        """Rows in whole `block`-row blocks, one ``index_select`` for all requests (of pages when blocks are
        pages, else of flat row ids: class docstring); position p of block j of request b is row j * block + p, zero past lengths[b]. When blocks
        tile pages (page_size a multiple of `block`) block j of request b is the `block` rows from
        ``(table[b, j * block // page_size], j * block % page_size)`` on; otherwise each row is looked up."""
        dev, ps, d = self.pool.device, self.page_size, self.pool.shape[-1]
        nbs = [-(-n // block) for n in lengths]
        if ps % block == 0:
            table, layers = self.block_tables.tolist(), self.pool.shape[1]
            firsts = [(table[b][j * block // ps] * layers + mla_idx) * ps + j * block % ps
                      for b, nb in enumerate(nbs) for j in range(nb)]
            if block == ps:  # whole pages: one gather of pages
                out = self.pool[:, mla_idx].index_select(0, torch.tensor([f // ps // layers for f in firsts], device=dev))
            else:
                ids = (torch.tensor(firsts, device=dev)[:, None] + torch.arange(block, device=dev)).reshape(-1)
                out = self._rows().index_select(0, ids).view(-1, block, d)
            at = 0
            for n, nb in zip(lengths, nbs):
                at += nb
                if n % block:
                    out[at - 1, n % block:] = 0
            return out
        nbs_t = torch.tensor(nbs, device=dev)
        req = torch.repeat_interleave(torch.arange(len(lengths), device=dev), nbs_t * block)  # [sum nb * block]
        first = torch.repeat_interleave(torch.cumsum(nbs_t * block, 0) - nbs_t * block, nbs_t * block)
        pos = torch.arange(req.shape[0], device=dev) - first  # position inside its request
        length = torch.tensor(lengths, device=dev)[req]
        real = pos < length
        at_pos = torch.minimum(pos, length - 1)  # past the end: any real row of the request, zeroed below
        rows = self._rows().index_select(0, self._row_ids(mla_idx, self.block_tables[req, at_pos // ps], at_pos % ps))
        rows.masked_fill_(~real.unsqueeze(1), 0)
        return rows.view(-1, block, d)

    def layer_pages(self, mla_idx: int) -> torch.Tensor:
        """Strided view `[num_pages, page_size, D]` of one MLA layer (input of the paged decode kernel)."""
        return self.pool[:, mla_idx]


# ---------------------------------------------------------------------------------------------- the batch
@dataclass
class ForwardBatch:
    """What one forward call reads and updates: B requests, T new tokens each.

    kda_blocks: per KDA layer `[B, H_local, block_floats]` fp32, updated in place.
    latent: the MLA rows; this call writes positions start_positions[b] .. + T - 1.
    start_positions: tokens each request already has in its state (``num_computed_tokens``).
    decode: T == 1 for every request; MLA uses the paged absorbed kernel when the cache is paged.
    kda_records: speculative verify (docs/speculative.md): per KDA layer a `[B, H_local, T, record_floats(K)]`
        fp32 buffer the layer fills with its per-token records (kernels/kda_spec.py) *instead of* updating
        kda_blocks, which it then only reads. MLA rows are written as in prefill (rolled back by length).
    capture_layers: layer indices whose hidden states the forward stores into ``captured`` (the drafter
        feature hook, engine/spec/drafter.py): `[B, T, d]` fp32, the residual stream after that layer (with
        Block AttnRes: the running partial sum of the layer's block, which at a block's last layer is the
        block's output).
    on_layer: called with a decoder layer's index right after that layer's attention updated its state (its
        KDA block or its MLA rows for this call's tokens): layer-wise export sends the state of a prefill's last
        chunk layer by layer while the rest of the forward runs (engine/worker.py PrefillStreamed).
    """

    kda_blocks: list[torch.Tensor]
    latent: LatentCache
    start_positions: list[int]
    decode: bool = False
    kda_records: list[torch.Tensor] | None = None
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    on_layer: Callable[[int], None] | None = None
