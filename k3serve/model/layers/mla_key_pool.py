"""Decompressed MLA key blocks kept in one preallocated pool per MLA layer (numerics mode ``deterministic``).

:func:`~k3serve.model.layers.mla_blocked.blocked_attention` re-reads every key block of every request at every
decode step. A full block's latent rows never change, so its decompressed keys and values (a function of those
rows alone, computed by the same fixed-shape GEMMs) are computed once and reused bit for bit::

    storage (grown by doubling, in block units, up to max_bytes)
      keys   [cap, H, KB, Dq]    values [cap, H, KB, v]    rows [cap, KB, rank + rope] (to confirm a hit)
    index    fingerprint (first and last latent row's bytes) -> slot, least recently used first
    a call   blocks [n, KB, rank + rope] -> slots [n]: hits (confirmed by comparing all rows) and, for the
             misses and the partial last blocks, fresh slots filled by one batched decompression; the
             attention then gathers block column j of every query tile with one ``index_select`` per column

Content addressing (not request identity) is what makes a slot safe to reuse: a page freed and written again,
a prefix shared by two requests, another layer's rows or a transferred page can at worst miss, never serve
stale keys. The engine does not tell the model when a request ends, so blocks leave the pool least recently
used first when it is full; a request's blocks are the most recently used while it decodes. Partial blocks
(a request's last, still growing block) get transient slots, free again for the next call. Inference only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# Bytes of decompressed keys + values + rows one pool (one MLA layer of one model) holds at most.
DEFAULT_POOL_BYTES = 256 << 20


def _decompress(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c `[n, KB, rank]` (n key blocks), w `[H, out, rank]` -> `[n, H, KB, out]`: one fixed-shape GEMM per
    (block, head)."""
    n, kb, rank = c.shape
    heads, out = w.shape[0], w.shape[1]
    a = c.unsqueeze(1).expand(n, heads, kb, rank).reshape(n * heads, kb, rank)
    b = w.transpose(1, 2).unsqueeze(0).expand(n, heads, rank, out).reshape(n * heads, rank, out)
    return torch.bmm(a, b).view(n, heads, kb, out)


def key_blocks(blocks: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks `[n, KB, rank + rope]` -> (keys `[n, H, KB, nope + rope]`, values `[n, H, KB, v]`)."""
    heads, rank = w_uk.shape[0], w_uk.shape[2]
    c = blocks[..., :rank].contiguous()
    k_pe = blocks[..., rank:].unsqueeze(1).expand(-1, heads, -1, -1)
    return torch.cat([_decompress(c, w_uk), k_pe], dim=-1), _decompress(c, w_uv)


class KeyBlockPool:
    """One MLA layer's decompressed full key blocks in preallocated storage (module docstring).

    ``slots(blocks, full, w_uk, w_uv)`` returns, per block, the slot of ``keys`` / ``values`` holding its
    decompressed form; valid until the next call (transient slots are reused then, and growth replaces the
    storage tensors, so read ``keys`` / ``values`` after the call)."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.keys: torch.Tensor | None = None  # [cap, H, KB, Dq]
        self.values: torch.Tensor | None = None  # [cap, H, KB, v]
        self.rows: torch.Tensor | None = None  # [cap, KB, rank + rope]
        self._index: OrderedDict[bytes, int] = OrderedDict()  # fingerprint -> slot, LRU first
        self._free: list[int] = []
        self.hits = self.misses = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def bytes(self) -> int:
        """Bytes of the preallocated storage."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.rows) if t is not None)

    @property
    def cached(self) -> int:
        """Full blocks currently kept."""
        return len(self._index)

    @staticmethod
    def _fingerprints(blocks: torch.Tensor) -> list[bytes]:
        fp = blocks[:, [0, -1]].flatten(1).cpu().numpy()  # [n, 2 (rank + rope)]
        return [row.tobytes() for row in fp]

    def _grow(self, need: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> bool:
        """Grow the storage (doubling, within max_bytes) so that `need` slots are free; False when the bound
        leaves fewer. k `[m, H, KB, Dq]`, v `[m, H, KB, v]`, rows `[m, KB, D]` give the shapes."""
        per_block = (k[0].numel() + v[0].numel() + rows[0].numel()) * k.element_size()
        cap = self.capacity
        new_cap = min(self.max_bytes // per_block, max(cap + need - len(self._free), 2 * cap, 16))
        if new_cap > cap:
            grown = []
            for old, like in ((self.keys, k), (self.values, v), (self.rows, rows)):
                t = like.new_empty((new_cap, *like.shape[1:]))
                if old is not None:
                    t[:cap] = old
                grown.append(t)
            self.keys, self.values, self.rows = grown
            self._free.extend(range(new_cap - 1, cap - 1, -1))
        return need <= len(self._free)

    def _take(self, need: int, in_use: set[int], k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> list[int] | None:
        """`need` free slots: free ones, then growth, then the least recently used blocks this call does not use."""
        if need > len(self._free) and not self._grow(need, k, v, rows):
            while need > len(self._free) and self._index:
                fp, slot = next(iter(self._index.items()))
                if slot in in_use:  # every later entry was used (moved to the end) by this call
                    break
                del self._index[fp]
                self._free.append(slot)
            if need > len(self._free):
                return None
        return [self._free.pop() for _ in range(need)]

    def slots(self, blocks: torch.Tensor, full: list[bool], w_uk: torch.Tensor,
              w_uv: torch.Tensor) -> list[int] | None:
        """blocks `[n, KB, rank + rope]` fp32; full[i]: all KB rows of block i are real keys (cacheable).
        Returns each block's slot in ``keys`` / ``values`` (hits, then fresh slots for the rest, decompressed
        in one batch), or None when this call's blocks do not fit in max_bytes (then decompress without)."""
        n = blocks.shape[0]
        fps = self._fingerprints(blocks)
        out: list[int] = [-1] * n
        cand = [i for i in range(n) if full[i] and fps[i] in self._index]
        if cand:
            cs = [self._index[fps[i]] for i in cand]
            pick = torch.tensor(cs, device=blocks.device)
            same = (self.rows.index_select(0, pick) == blocks[cand]).flatten(1).all(1).tolist()
            for i, s, ok in zip(cand, cs, same):
                if ok:
                    out[i] = s
                    self._index.move_to_end(fps[i])
        miss = [i for i in range(n) if out[i] < 0]
        n_hit = n - len(miss)
        self.hits += n_hit
        self.misses += sum(full) - n_hit
        if not miss:
            return out
        sel = blocks[miss] if n_hit else blocks
        k_new, v_new = key_blocks(sel, w_uk, w_uv)
        fresh = self._take(len(miss), set(out[i] for i in range(n) if out[i] >= 0), k_new, v_new, sel)
        if fresh is None:
            return None
        at = torch.tensor(fresh, device=blocks.device)
        self.keys.index_copy_(0, at, k_new)
        self.values.index_copy_(0, at, v_new)
        self.rows.index_copy_(0, at, sel)
        transient = []
        for i, s in zip(miss, fresh):
            out[i] = s
            if full[i] and fps[i] not in self._index:
                self._index[fps[i]] = s
            else:  # a partial block, or a full one whose fingerprint another block holds: this call only
                transient.append(s)
        self._free.extend(transient)
        return out
