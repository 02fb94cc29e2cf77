"""Hybrid prefix cache, driver side (docs/architecture.md §9).

MLA pages are indexed per hash block (chained hashes, so a block's hash names its whole prefix); KDA checkpoints
(one state slot holding all KDA layers at a block end) exist only at a sparse subset of block ends. A hit is the
longest run of cached blocks clamped DOWN to the deepest checkpoint inside it: resuming past the deepest saved
KDA state would be silently wrong.

Ownership, in one place:
- Pages: the cache holds one reference per page of every cached block. ``lookup`` adds one reference per
  returned page for the caller, who decrefs through the PageAllocator when its request ends.
- Checkpoint slots: ``register`` takes ownership of the slots it is handed; any it does not keep (duplicate of
  an existing checkpoint, or over the session's fairness cap) it frees to the SlotAllocator itself and lists in its
  return value, so the caller never frees a slot it handed over. ``lookup`` never gives a checkpoint away: it
  pins it under ``hit.lease``; the caller copies the slot into its private slot and then calls
  ``release(hit)`` (also on abort). Eviction never touches a pinned checkpoint.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.block_hash import block_hashes


@dataclass(frozen=True)
class PrefixHit:
    """Result of :meth:`HybridPrefixCache.lookup`.

    ``pages`` cover positions ``[0, num_tokens)`` and carry one reference each for the caller (decref them via
    the PageAllocator when the request ends). ``checkpoint_slot`` is the cache's KDA checkpoint at
    ``num_tokens``: copy it into the request's private slot, then ``release(hit)``; until then ``lease`` pins
    it against eviction. ``matched_blocks`` is the hash-match depth before clamping to a checkpoint (stats).
    """

    num_tokens: int
    pages: tuple[int, ...]
    checkpoint_slot: int | None
    matched_blocks: int
    lease: int | None = None

    @property
    def hit(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True)
class CheckpointInfo:
    """A snapshot of one cached KDA checkpoint (introspection and tests)."""

    slot: int
    num_tokens: int
    session_id: str
    last_used: int
    pinned: bool


def checkpoint_scores(last_used: Sequence[int], depths: Sequence[int], alpha: float,
                      served: Sequence[int] | None = None, beta: float = 0.0) -> list[float]:
    """Value of each checkpoint in a candidate set; the lowest is evicted first (Marconi-style).

    ``score = recency + alpha * depth / max(depths) + beta * log1p(served) / log1p(max(served))`` with
    ``recency = (t - t_min) / (t_max - t_min)`` over the set (1.0 when all ties). Depth stands for the prefill it
    saves per byte: every checkpoint costs the same bytes (all KDA layers at one boundary) and saves ``depth``
    tokens of prefill; ``served`` (hits it gave) for how often it will be used again, logarithmic so one hot
    system prompt does not make every other entry worthless. Each term is normalised to [0, 1], so ``alpha`` and
    ``beta`` are unit-free.
    """
    if len(last_used) != len(depths) or (served is not None and len(served) != len(depths)):
        raise ValueError("last_used, depths and served differ in length")
    if not last_used:
        return []
    t_min, t_max = min(last_used), max(last_used)
    span = t_max - t_min
    d_max = max(depths) or 1
    out = [((t - t_min) / span if span else 1.0) + alpha * d / d_max for t, d in zip(last_used, depths)]
    if served is not None and beta and max(served) > 0:
        s_max = math.log1p(max(served))
        out = [v + beta * math.log1p(s) / s_max for v, s in zip(out, served)]
    return out


@dataclass(slots=True)
class _Checkpoint:
    slot: int
    block: int  # hash of the block this checkpoint ends
    num_tokens: int
    session_id: str
    last_used: int
    pins: int = 0
    served: int = 0  # hits it gave (its continuations)
    shared: bool = False  # at a branch point of the cached tree: charged to no session


@dataclass(slots=True)
class _Block:
    hash: int
    parent: int | None
    index: int  # block i covers tokens [i * block_size, (i + 1) * block_size)
    pages: tuple[int, ...]
    last_used: int
    children: int = 0
    ckpt: _Checkpoint | None = None


class HybridPrefixCache:
    """Index of cached hash blocks (MLA pages) and sparse KDA checkpoints, budgeted by value over the slot pool.

    A checkpoint at a block with two or more cached continuations (a shared prefix) is *shared*: it leaves its
    registering session's fairness cap, so one identity's turns can never push a system prompt's state out."""

    def __init__(self, policy: PrefixCachePolicy, pages: PageAllocator, slots: SlotAllocator, key: bytes) -> None:
        """key: the block-hash key (block_hash.prefix_key)."""
        self.policy = policy
        self._pages = pages
        self._slots = slots
        if not isinstance(key, bytes) or not key:
            raise ValueError("key must be the block-hash key (block_hash.prefix_key), not a seed")
        self._key = key
        self._blocks: dict[int, _Block] = {}
        self._ckpts: dict[int, _Checkpoint] = {}  # by slot
        self._sessions: dict[str, set[int]] = {}  # session id -> unshared checkpoint slots it registered
        self._shared: set[int] = set()  # slots of shared checkpoints
        self.version = 0  # bumped whenever the set of checkpointed blocks changes (publishers diff on it)
        self._page_block: dict[int, int] = {}  # page -> hash of the block holding it (catches double registration)
        self._leases: dict[int, int] = {}  # lease id -> pinned checkpoint slot
        self._next_lease = 0
        self._clock = 0  # logical time for recency; one tick per lookup/register
        self._counters = dict(lookups=0, hits=0, hit_tokens=0, matched_tokens=0, evicted_blocks=0,
                              evicted_checkpoints=0, rejected_checkpoints=0)

    # ----------------------------------------------------------------------------------------------- queries
    def block_hashes(self, tokens: Sequence[int], salt: str = "") -> list[int]:
        """The chained hashes of ``tokens``' full blocks under this cache's key and the tenant ``salt``."""
        return block_hashes(tokens, self.policy.block_size, self._key, salt)

    def restorable(self, hashes: Sequence[int], prompt_len: int) -> int:
        """Tokens ``lookup`` would restore now for a prompt of ``prompt_len`` tokens with these block ``hashes``,
        without touching recency, counters or pins."""
        top = min(len(hashes), max(prompt_len - 1, 0) // self.policy.block_size)
        return next((k * self.policy.block_size for k in range(top, 0, -1) if self.has_checkpoint(hashes[k - 1])), 0)

    def lookup(self, tokens: Sequence[int], salt: str = "") -> PrefixHit:
        """Longest cached prefix of ``tokens`` that ends at a KDA checkpoint and leaves >= 1 token to compute.

        Only prefixes registered under the same tenant ``salt`` match (engine/block_hash.py).

        The returned pages are increfed for the caller; the checkpoint stays the cache's, pinned until
        ``release(hit)``. Marks the matched blocks and the used checkpoint as recently used.
        """
        bs = self.policy.block_size
        hashes = block_hashes(tokens, bs, self._key, salt)
        self._clock += 1
        matched = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks[h].last_used = self._clock
            matched += 1
        # The engine needs the last prompt token's logits, so the hit ends at most at len - 1.
        top = min(matched, (len(tokens) - 1) // bs) if tokens else 0
        depth = next((k for k in range(top, 0, -1) if self._blocks[hashes[k - 1]].ckpt is not None), 0)
        self._counters["lookups"] += 1
        self._counters["matched_tokens"] += matched * bs
        if depth == 0:
            return PrefixHit(0, (), None, matched)
        ck = self._blocks[hashes[depth - 1]].ckpt
        assert ck is not None
        ck.last_used = self._clock
        ck.served += 1
        ck.pins += 1
        lease = self._next_lease
        self._next_lease += 1
        self._leases[lease] = ck.slot
        pages = tuple(p for h in hashes[:depth] for p in self._blocks[h].pages)
        self._pages.incref(pages)
        self._counters["hits"] += 1
        self._counters["hit_tokens"] += depth * bs
        return PrefixHit(depth * bs, pages, ck.slot, matched, lease)

    def release(self, hit: PrefixHit) -> None:
        """Unpin the checkpoint of ``hit`` once its slot has been copied (or the request was aborted).

        A hit without a checkpoint is a no-op; releasing the same lease twice raises ValueError.
        """
        if hit.lease is None:
            return
        slot = self._leases.pop(hit.lease, None)
        if slot is None:
            raise ValueError(f"prefix-cache lease {hit.lease} is not held (released twice?)")
        self._ckpts[slot].pins -= 1

    def checkpoint_boundaries(self, prompt_len: int, cached_tokens: int, branch_tokens: int = 0) -> list[int]:
        """Positions in ``(cached_tokens, prompt_len]`` where the prefill should save a KDA checkpoint
        (``branch_tokens``: where the prompt's hash-matched blocks end, PrefixCachePolicy.checkpoint_boundaries)."""
        return self.policy.checkpoint_boundaries(prompt_len, cached_tokens, branch_tokens)

    def has_checkpoint(self, block_hash: int) -> bool:
        """Whether a hit can end at the block ``block_hash`` (it is cached and holds a checkpoint)."""
        b = self._blocks.get(block_hash)
        return b is not None and b.ckpt is not None

    def checkpoint_hashes(self) -> frozenset[int]:
        """The block hashes a hit can end at (what a cluster publishes to the routers; bounded by the slots)."""
        return frozenset(ck.block for ck in self._ckpts.values())

    # ---------------------------------------------------------------------------------------------- updates
    def register(self, tokens: Sequence[int], pages: Sequence[int], checkpoints: Mapping[int, int],
                 session_id: str, salt: str = "") -> list[int]:
        """Cache the full hash blocks of a prefilled ``tokens`` (under the tenant ``salt``) and take over its
        checkpoint slots.

        ``pages[i]`` covers positions ``[i * page_size, (i + 1) * page_size)``. Blocks already cached keep their
        (immutable) entry; new ones take their pages with a reference of the cache's own. ``checkpoints`` maps a
        block end -> a filled slot handed to the cache. Returns the handed-over slots the cache did not keep
        (already freed by the cache; the caller must not touch them). Validates everything before changing
        anything: ValueError leaves the cache as it was.
        """
        bs, ppb = self.policy.block_size, self.policy.pages_per_block
        hashes = block_hashes(tokens, bs, self._key, salt)
        new = [i for i, h in enumerate(hashes) if h not in self._blocks]
        self._validate_register(len(hashes), new, pages, checkpoints)
        self._clock += 1
        for h in hashes:
            if h in self._blocks:
                self._blocks[h].last_used = self._clock
        branched: list[_Block] = []
        for i in new:
            # Blocks are created in order, so the parent exists (cached before, or created one step earlier).
            parent = hashes[i - 1] if i else None
            own = tuple(pages[i * ppb:(i + 1) * ppb])
            self._pages.incref(own)
            self._blocks[hashes[i]] = _Block(hashes[i], parent, i, own, self._clock)
            for p in own:
                self._page_block[p] = hashes[i]
            if parent is not None:
                self._blocks[parent].children += 1
                if self._blocks[parent].children == 2:
                    branched.append(self._blocks[parent])
        rejected: list[int] = []
        added: set[int] = set()
        for pos in sorted(checkpoints):
            slot = checkpoints[pos]
            block = self._blocks[hashes[pos // bs - 1]]
            if block.ckpt is not None:
                rejected.append(slot)
                self._slots.free(slot)
                continue
            block.ckpt = _Checkpoint(slot, block.hash, pos, session_id, self._clock)
            self._ckpts[slot] = block.ckpt
            self.version += 1
            if block.children >= 2:
                block.ckpt.shared = True
                self._shared.add(slot)
            else:
                self._sessions.setdefault(session_id, set()).add(slot)
                added.add(slot)
        for block in branched:  # a prefix that just gained its second continuation is shared from now on
            if block.ckpt is not None and not block.ckpt.shared:
                self._share(block.ckpt)
        rejected += self._enforce_session_budget(session_id, added)
        self._counters["rejected_checkpoints"] += len(rejected)
        return rejected

    def evict(self, pages_needed: int = 0, slots_needed: int = 0) -> bool:
        """Free cache-held entries until the allocators have ``pages_needed`` / ``slots_needed`` free.

        Slots: drop unpinned checkpoints, lowest :func:`checkpoint_scores` (recency, depth, continuations
        served) first, over the whole pool whoever registered them. Pages: drop leaf blocks (an
        inner block must stay while a descendant is cached, else the descendant is unreachable), checkpoint-less
        leaves first (no hit can end in them), then least recently used, deepest first on ties; blocks whose
        pages a running request still shares, or that end at a pinned checkpoint, are skipped because dropping
        them frees nothing now. Returns whether both targets are met.
        """
        if self._slots.num_free < slots_needed:
            cands = [ck for ck in self._ckpts.values() if ck.pins == 0]
            scores = self._scores(cands)
            order = sorted(zip(scores, cands), key=lambda sc: (sc[0], sc[1].last_used, sc[1].num_tokens,
                                                               sc[1].slot))
            for _, ck in order:
                if self._slots.num_free >= slots_needed:
                    break
                self._drop_checkpoint(ck)
        if self._pages.num_free < pages_needed:
            heap = [self._leaf_key(b) for b in self._blocks.values() if b.children == 0]
            heapq.heapify(heap)
            while heap and self._pages.num_free < pages_needed:
                block = self._blocks[heapq.heappop(heap)[-1]]
                if (block.ckpt is not None and block.ckpt.pins) or any(
                        self._pages.refcount(p) > 1 for p in block.pages):
                    continue
                parent = self._drop_block(block)
                if parent is not None and parent.children == 0:
                    heapq.heappush(heap, self._leaf_key(parent))
        return self._pages.num_free >= pages_needed and self._slots.num_free >= slots_needed

    def clear(self) -> None:
        """Drop every block and checkpoint, releasing the cache's page references and slots.

        All hits must have been released first (RuntimeError otherwise): a pinned slot may be mid-copy.
        Cumulative counters in ``stats()`` are kept.
        """
        if self._leases:
            raise RuntimeError(f"clear() with {len(self._leases)} unreleased prefix-cache hit(s)")
        for ck in list(self._ckpts.values()):
            self._drop_checkpoint(ck, count=False)
        for block in self._blocks.values():
            self._pages.decref(block.pages)
        self._blocks.clear()
        self._page_block.clear()

    # ------------------------------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        """Cumulative counters (lookups, hits, hit_tokens, matched_tokens, evictions) and current sizes."""
        return dict(self._counters, blocks=len(self._blocks), checkpoints=len(self._ckpts),
                    shared_checkpoints=len(self._shared),
                    pages_held=len(self._page_block), pinned=len(self._leases), sessions=len(self._sessions))

    def session_of(self, slot: int) -> str | None:
        """The session that registered the checkpoint in ``slot``; None if the cache does not hold ``slot``."""
        ck = self._ckpts.get(slot)
        return ck.session_id if ck else None

    def checkpoints(self, session_id: str | None = None) -> list[CheckpointInfo]:
        """Cached checkpoints (of one session, or all), shallowest first."""
        cks = self._ckpts.values() if session_id is None else (
            c for c in self._ckpts.values() if c.session_id == session_id)
        return sorted((CheckpointInfo(c.slot, c.num_tokens, c.session_id, c.last_used, c.pins > 0) for c in cks),
                      key=lambda c: (c.num_tokens, c.slot))

    def held_pages(self) -> frozenset[int]:
        """Pages the cache holds one reference to."""
        return frozenset(self._page_block)

    def check_invariants(self) -> None:
        """Assert the index is self-consistent (tests and debug builds; O(size))."""
        bs, ppb = self.policy.block_size, self.policy.pages_per_block
        children: dict[int, int] = {}
        for h, b in self._blocks.items():
            assert b.hash == h and len(b.pages) == ppb, f"block {h:#x} malformed"
            if b.index == 0:
                assert b.parent is None, f"block 0 {h:#x} has a parent"
            else:
                parent = self._blocks.get(b.parent) if b.parent is not None else None
                assert parent is not None and parent.index == b.index - 1, f"block {h:#x}: chain broken"
                children[b.parent] = children.get(b.parent, 0) + 1
            for p in b.pages:
                assert self._page_block.get(p) == h and self._pages.refcount(p) >= 1, f"page {p} of {h:#x}"
        assert len(self._page_block) == len(self._blocks) * ppb, "stray pages in the page index"
        for h, b in self._blocks.items():
            assert b.children == children.get(h, 0), f"block {h:#x}: child count {b.children}"
        leased: dict[int, int] = {}
        for slot in self._leases.values():
            leased[slot] = leased.get(slot, 0) + 1
        for slot, ck in self._ckpts.items():
            b = self._blocks.get(ck.block)
            assert b is not None and b.ckpt is ck and ck.slot == slot, f"checkpoint {slot} detached"
            assert ck.num_tokens == (b.index + 1) * bs, f"checkpoint {slot} at the wrong depth"
            assert self._slots.is_used(slot), f"checkpoint slot {slot} is free"
            if ck.shared:
                assert slot in self._shared, f"shared checkpoint {slot} missing from the shared index"
            else:
                assert slot in self._sessions.get(ck.session_id, ()), f"checkpoint {slot} missing from its session"
                assert b.children < 2, f"checkpoint {slot} at a branch point is charged to {ck.session_id!r}"
            assert ck.pins == leased.get(slot, 0), f"checkpoint {slot}: pins {ck.pins} != leases"
        for sid, own in self._sessions.items():
            assert own and all(self._ckpts[s].session_id == sid and not self._ckpts[s].shared for s in own), \
                f"session {sid!r} index"
            assert len(own) <= self.policy.max_checkpoints_per_session, f"session {sid!r} over budget"
        assert all(self._ckpts[s].shared for s in self._shared), "shared index"
        assert sum(len(o) for o in self._sessions.values()) + len(self._shared) == len(self._ckpts)
        assert self._slots.num_used >= len(self._ckpts), "more checkpoints than used slots"

    # ------------------------------------------------------------------------------------------------ helpers
    def _validate_register(self, n_blocks: int, new: list[int], pages: Sequence[int],
                           checkpoints: Mapping[int, int]) -> None:
        bs, ppb = self.policy.block_size, self.policy.pages_per_block
        if new and len(pages) < (new[-1] + 1) * ppb:
            raise ValueError(f"register: {len(pages)} pages do not cover {n_blocks} blocks of {bs} tokens")
        fresh = [p for i in new for p in pages[i * ppb:(i + 1) * ppb]]
        if len(set(fresh)) != len(fresh):
            raise ValueError("register: a page appears twice in the request's page list")
        for p in fresh:
            if p in self._page_block:
                raise ValueError(f"register: page {p} already belongs to another cached block")
            if self._pages.refcount(p) == 0:
                raise ValueError(f"register: page {p} is not allocated")
        if len(set(checkpoints.values())) != len(checkpoints):
            raise ValueError("register: one slot handed over for two checkpoints")
        for pos, slot in checkpoints.items():
            if pos <= 0 or pos % bs or pos // bs > n_blocks:
                raise ValueError(f"register: checkpoint at {pos} is not a full block end (block size {bs}, "
                                 f"{n_blocks} full blocks)")
            if not self._slots.is_used(slot) or slot in self._ckpts:
                raise ValueError(f"register: slot {slot} is not an allocated slot owned by the caller")

    def _enforce_session_budget(self, session_id: str, added: set[int]) -> list[int]:
        """Evict the session's lowest-value unpinned checkpoints beyond the budget; return dropped new slots."""
        dropped_new: list[int] = []
        own = self._sessions.get(session_id, set())
        while len(own) > self.policy.max_checkpoints_per_session:
            cands = [self._ckpts[s] for s in own if self._ckpts[s].pins == 0]
            if not cands:
                break
            scores = self._scores(cands)
            _, victim = min(zip(scores, cands), key=lambda sc: (sc[0], sc[1].last_used, sc[1].num_tokens,
                                                                sc[1].slot))
            if victim.slot in added:
                dropped_new.append(victim.slot)
            self._drop_checkpoint(victim, count=victim.slot not in added)  # a new one counts as rejected
        return dropped_new

    def _scores(self, cands: list[_Checkpoint]) -> list[float]:
        return checkpoint_scores([c.last_used for c in cands], [c.num_tokens for c in cands],
                                 self.policy.eviction_alpha, [c.served for c in cands], self.policy.eviction_beta)

    def _share(self, ck: _Checkpoint) -> None:
        own = self._sessions[ck.session_id]
        own.discard(ck.slot)
        if not own:
            del self._sessions[ck.session_id]
        ck.shared = True
        self._shared.add(ck.slot)

    def _drop_checkpoint(self, ck: _Checkpoint, count: bool = True) -> None:
        assert ck.pins == 0, "a pinned checkpoint may be mid-copy"
        self._blocks[ck.block].ckpt = None
        del self._ckpts[ck.slot]
        self.version += 1
        if ck.shared:
            self._shared.discard(ck.slot)
        else:
            own = self._sessions[ck.session_id]
            own.discard(ck.slot)
            if not own:
                del self._sessions[ck.session_id]
        self._slots.free(ck.slot)
        if count:
            self._counters["evicted_checkpoints"] += 1

    def _drop_block(self, block: _Block) -> _Block | None:
        """Remove a leaf block (and its checkpoint); return its parent."""
        assert block.children == 0
        if block.ckpt is not None:
            self._drop_checkpoint(block.ckpt)
        self._pages.decref(block.pages)
        for p in block.pages:
            del self._page_block[p]
        del self._blocks[block.hash]
        self._counters["evicted_blocks"] += 1
        if block.parent is None:
            return None
        parent = self._blocks[block.parent]
        parent.children -= 1
        return parent

    @staticmethod
    def _leaf_key(block: _Block) -> tuple[bool, int, int, int]:
        return (block.ckpt is not None, block.last_used, -block.index, block.hash)
