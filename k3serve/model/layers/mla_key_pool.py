"""Decompressed MLA key blocks kept in one preallocated pool per MLA layer (numerics mode ``deterministic``).

:func:`~k3serve.model.layers.mla_blocked.blocked_attention` re-reads every key block of every request at every
decode step. A full block's latent rows never change, so its decompressed keys and values (a function of those
rows alone, computed by the same fixed-shape GEMMs) are computed once and reused bit for bit::

    storage (grown by doubling, in block units, up to max_bytes)
      keys   [cap, H, KB, Dq]    values [cap, H, KB, v]    rows [cap, KB, rank + rope] (to confirm a hit)
    index    (real rows, leading values of the first and last real row) -> slot, least recently used first
    a call   blocks [n, KB, rank + rope] -> slots [n]: hits (confirmed by comparing the rows), growing blocks
             (the same request's last block one step later: only the new rows are decompressed, into its
             slot) and fresh slots for the rest, filled by one batched decompression; the attention then
             gathers block column j of every query tile with one ``index_select`` (or reuses the last call's)

Content addressing (not request identity) is what makes a slot safe to reuse: a page freed and written again,
a prefix shared by two requests, another layer's rows or a transferred page can at worst miss, never serve
stale keys. The engine does not tell the model when a request ends, so blocks leave the pool least recently
used first when it is full; a request's blocks are the most recently used while it decodes. A block whose key
another slot of the same call already holds gets a transient slot, free again for the next call. Inference
only.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from k3serve.model.deterministic import MIN_TILE

# Values of a block's first and last real row that make up its index key (a candidate only: a hit is
# confirmed by comparing all rows, so two blocks sharing a key can at worst miss).
_KEY_FLOATS = 4
# Bytes of decompressed keys + values + rows one pool (one MLA layer of one model) holds at most.
DEFAULT_POOL_BYTES = 256 << 20


def _decompress(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c `[M, rank]` latent rows, w `[H, out, rank]` -> `[H, M, out]`: one GEMM per head over all M rows (the
    weights are not copied per block). A row's bits are those of the former per-block `[KB, rank]` GEMM: from
    MIN_TILE rows on, a GEMM row does not depend on how many rows share the call (pinned for these shapes in
    tests/model/test_numerics_invariants.py); fewer rows are padded to MIN_TILE."""
    m, rank = c.shape
    if m < MIN_TILE:
        c = torch.cat([c, c.new_zeros(MIN_TILE - m, rank)])
    out = torch.bmm(c.unsqueeze(0).expand(w.shape[0], -1, -1), w.transpose(1, 2))
    return out[:, :m]


def key_blocks(blocks: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks `[n, KB, rank + rope]` -> (keys `[n, H, KB, nope + rope]`, values `[n, H, KB, v]`)."""
    n, kb = blocks.shape[0], blocks.shape[1]
    heads, rank = w_uk.shape[0], w_uk.shape[2]
    c = blocks[..., :rank].reshape(n * kb, rank)
    k_nope = _decompress(c, w_uk).view(heads, n, kb, -1).transpose(0, 1)  # [n, H, KB, nope]
    k_pe = blocks[..., rank:].unsqueeze(1).expand(-1, heads, -1, -1)
    return torch.cat([k_nope, k_pe], dim=-1), _decompress(c, w_uv).view(heads, n, kb, -1).transpose(0, 1)


class KeyBlockPool:
    """One MLA layer's decompressed key blocks in preallocated storage (module docstring).

    ``slots(blocks, valid, prev, w_uk, w_uv)`` returns, per block, the slot of ``keys`` / ``values`` holding
    its decompressed form; valid until the next call (transient slots are reused then, and growth replaces
    the storage tensors, so read ``keys`` / ``values`` after the call, or through :meth:`column`)."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.keys: torch.Tensor | None = None  # [cap, H, KB, Dq]
        self.values: torch.Tensor | None = None  # [cap, H, KB, v]
        self.rows: torch.Tensor | None = None  # [cap, KB, rank + rope]
        # (real rows, first and last real row's leading bytes) -> slot, least recently used first
        self._index: OrderedDict[tuple[int, bytes, bytes], int] = OrderedDict()
        self._free: list[int] = []
        self._gen: list[int] = []  # per slot: bumped whenever the slot is written
        # block column j of the last call: (its slots and their generations, keys, values), reused when the
        # next call's column j holds the same unchanged slots (decode: every column but the last)
        self._cols: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}
        self.hits = self.misses = self.grown = 0  # grown: hits extended by their new rows

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
            self._gen.extend([0] * (new_cap - cap))
        return need <= len(self._free)

    def _take(self, need: int, in_use: set[int], k: torch.Tensor, v: torch.Tensor,
              rows: torch.Tensor) -> list[int] | None:
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

    def slots(self, blocks: torch.Tensor, valid: list[int], prev: list[int], w_uk: torch.Tensor,
              w_uv: torch.Tensor) -> list[int] | None:
        """Each block's slot in ``keys`` / ``values``, holding its decompressed form.

        blocks `[n, KB, rank + rope]` fp32, zero past each block's real rows; valid[i]: block i's real rows
        (1..KB); prev[i]: how many of them the pool may already hold (the rows before this call, 0..valid[i]).
        A block found with all `valid` rows is a hit; one found with its first `prev` rows (the same
        request's block, one decode step ago) is extended by decompressing only the new rows, in
        MIN_TILE-row tiles (a row's bits do not depend on how many rows share its GEMM from MIN_TILE on:
        tests/model/test_numerics_invariants.py); the rest are decompressed whole in one batch. Both are
        confirmed by comparing the rows. None when this call's blocks do not fit in max_bytes."""
        n, kb = blocks.shape[0], blocks.shape[1]
        ar = torch.arange(n, device=blocks.device)
        ends = torch.tensor(valid, device=blocks.device) - 1
        befores = (torch.tensor(prev, device=blocks.device) - 1).clamp_(min=0)
        # the key only picks a candidate (comparing the rows confirms it): _KEY_FLOATS values of each row
        fp = torch.stack([blocks[:, 0], blocks[ar, ends], blocks[ar, befores]], 1)[..., :_KEY_FLOATS]
        fp = fp.contiguous().cpu().numpy()  # [n, 3, _KEY_FLOATS]
        fp = fp.view(np.dtype((np.void, fp.shape[2] * fp.itemsize)))[..., 0].tolist()  # [n][3] bytes
        out: list[int] = [-1] * n
        grow: list[tuple[int, int, tuple]] = []  # (block, slot, its old key)
        keys_now = []
        claimed: dict[int, int] = {}  # slot -> blocks of this call that use it
        index, stored, rows = self._index, self.rows, blocks.unbind(0)
        for i in range(n):
            first = fp[i][0]
            now = (valid[i], first, fp[i][1])
            keys_now.append(now)
            slot = index.get(now)
            if slot is not None and torch.equal(stored[slot], rows[i]):
                out[i] = slot
                index.move_to_end(now)
                claimed[slot] = claimed.get(slot, 0) + 1
            elif 0 < prev[i] < valid[i]:
                key = (prev[i], first, fp[i][2])
                slot = index.get(key)
                if slot is not None and torch.equal(stored[slot, : prev[i]], rows[i][: prev[i]]):
                    grow.append((i, slot, key))
                    claimed[slot] = claimed.get(slot, 0) + 1
        # a block another one also reads is never rewritten; blocks narrower than a tile are never grown
        grow = [g for g in grow if claimed[g[1]] == 1] if kb >= MIN_TILE else []
        for i, slot, _ in grow:
            out[i] = slot
        self.grown += len(grow)
        release = self._extend(blocks, grow, valid, prev, keys_now, w_uk, w_uv)
        miss = [i for i in range(n) if out[i] < 0]
        self.hits += n - len(miss)
        self.misses += len(miss)
        if not miss:
            self._free.extend(release)
            return out
        sel = blocks[miss] if len(miss) < n else blocks
        k_new, v_new = key_blocks(sel, w_uk, w_uv)
        fresh = self._take(len(miss), set(claimed), k_new, v_new, sel)
        if fresh is None:
            self._free.extend(release)
            return None
        at = torch.tensor(fresh, device=blocks.device)
        for s in fresh:
            self._gen[s] += 1
        self.keys.index_copy_(0, at, k_new)
        self.values.index_copy_(0, at, v_new)
        self.rows.index_copy_(0, at, sel)
        transient = release
        for i, s in zip(miss, fresh):
            out[i] = s
            if keys_now[i] not in self._index:
                self._index[keys_now[i]] = s
            else:  # another block of this call holds that key: this call only
                transient.append(s)
        self._free.extend(transient)
        return out

    def _extend(self, blocks: torch.Tensor, grow: list[tuple[int, int, tuple]], valid: list[int], prev: list[int],
                keys_now: list[tuple], w_uk: torch.Tensor, w_uv: torch.Tensor) -> list[int]:
        """Decompress rows prev[i] .. valid[i]-1 of each growing block i into its slot, in MIN_TILE-row tiles
        inside the block (a tile that would pass the block's end starts earlier: recomputed rows get their
        own bits again), and key the slot by its new last row. Returns the slots to free after this call (a
        grown block whose new key another slot already holds: the same rows, kept once)."""
        if not grow:
            return []
        kb = blocks.shape[1]
        tiles = [(i, s, min(a, kb - MIN_TILE)) for i, s, _ in grow for a in range(prev[i], valid[i], MIN_TILE)]
        dev = blocks.device
        block_of = torch.tensor([t[0] for t in tiles], device=dev)
        slot_of = torch.tensor([t[1] for t in tiles], device=dev).unsqueeze(1)
        row_of = torch.tensor([t[2] for t in tiles], device=dev).unsqueeze(1) + torch.arange(MIN_TILE, device=dev)
        rows = blocks[block_of.unsqueeze(1), row_of]  # [n_tiles, MIN_TILE, D]
        k_t, v_t = key_blocks(rows, w_uk, w_uv)  # [n_tiles, H, MIN_TILE, *]
        self.keys[slot_of, :, row_of] = k_t.transpose(1, 2)
        self.values[slot_of, :, row_of] = v_t.transpose(1, 2)
        self.rows[slot_of, row_of] = rows
        release = []
        for i, s, key in grow:
            self._gen[s] += 1
            del self._index[key]
            if keys_now[i] in self._index:
                release.append(s)
            else:
                self._index[keys_now[i]] = s
        return release

    def column(self, j: int, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[c, H, KB, Dq]` and values `[c, H, KB, v]` of slots idx, block column j of this call: one
        ``index_select`` each, or the last call's column j itself when it held the same slots, none written
        since (a full block's slot is never rewritten while it is indexed: decode re-gathers only the column
        of the growing blocks)."""
        key = (tuple(idx), tuple(self._gen[s] for s in idx))
        last = self._cols.get(j)
        if last is not None and last[0] == key:
            return last[1], last[2]
        at = torch.tensor(idx, device=self.keys.device)
        k, v = self.keys.index_select(0, at), self.values.index_select(0, at)
        self._cols[j] = (key, k, v)
        return k, v

    def keep_columns(self, n: int) -> None:
        """Forget the kept columns from n on (the last call had n)."""
        for j in [j for j in self._cols if j >= n]:
            del self._cols[j]
