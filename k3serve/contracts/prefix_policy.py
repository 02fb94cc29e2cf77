"""The prefix cache's policy (docs/architecture.md §9): how prompts are hashed into blocks and where KDA checkpoints
are saved. Pure functions of its fields, shared by the engine's cache and the router, which estimates a prompt's
uncached tokens with the very policy the clusters run."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("k3", "naive")


@dataclass(frozen=True)
class PrefixCachePolicy:
    """How the prefix cache hashes prompts and where it keeps KDA checkpoints.

    ``scheme="k3"``: hash blocks of ``hash_block_size`` tokens; checkpoints only at the last block end of each
    prompt (the turn boundary) and at every ``checkpoint_every_blocks``-th block end (absolute positions, so
    long shared documents line up across sessions).
    ``scheme="naive"``: the baseline the K3 scheme is compared with, where hash granularity = checkpoint granularity =
    ``naive_chunk`` and every block end is a checkpoint; a turn shorter than a chunk never gets a hit.
    ``eviction_alpha`` weighs depth and ``eviction_beta`` the continuations a checkpoint served against recency
    in :func:`checkpoint_scores`. ``max_checkpoints_per_session`` is a fairness guard per cache identity; the slot
    pool is the real budget, and checkpoints of shared prefixes (branch points) are not charged to anyone.
    """

    scheme: str = "k3"
    hash_block_size: int = 512
    page_size: int = 64
    checkpoint_every_blocks: int = 8
    max_checkpoints_per_session: int = 4
    naive_chunk: int = 4096
    eviction_alpha: float = 1.0
    eviction_beta: float = 1.0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"prefix_cache.scheme must be one of {SCHEMES}, got {self.scheme!r}")
        for name in ("hash_block_size", "page_size", "checkpoint_every_blocks", "max_checkpoints_per_session",
                     "naive_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"prefix_cache.{name} must be >= 1, got {getattr(self, name)}")
        if self.hash_block_size % self.page_size:
            raise ValueError(f"prefix_cache.page_size ({self.page_size}) must divide hash_block_size "
                             f"({self.hash_block_size}): a hash block owns whole MLA pages")
        if self.scheme == "naive" and self.naive_chunk % self.page_size:
            raise ValueError(f"prefix_cache.page_size ({self.page_size}) must divide naive_chunk "
                             f"({self.naive_chunk})")
        for name in ("eviction_alpha", "eviction_beta"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"prefix_cache.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def block_size(self) -> int:
        """Effective hash (and checkpoint-grid) granularity in tokens."""
        return self.naive_chunk if self.scheme == "naive" else self.hash_block_size

    @property
    def pages_per_block(self) -> int:
        """MLA pages owned by one hash block."""
        return self.block_size // self.page_size

    def checkpoint_boundaries(self, prompt_len: int, cached_tokens: int, branch_tokens: int = 0) -> list[int]:
        """Block ends in ``(cached_tokens, prompt_len]`` where a prefill should save a KDA checkpoint, ascending.

        k3: the last block end <= ``prompt_len`` (the next turn of this session resumes there), every
        ``checkpoint_every_blocks``-th block end (so a long prompt that diverges late still resumes near the
        divergence), and the branch point ``branch_tokens`` (where this prompt's hash-matched blocks end, i.e. it
        leaves a cached prefix: the next prompt under that prefix resumes there). naive: every block end. At most
        ``max_checkpoints_per_session`` positions, the deepest plus the branch point: the session budget would
        reject the shallower ones at ``register`` anyway (equally recent, less deep), so snapshotting them would
        be wasted copies, while the branch point is a shared prefix's and charged to no session.
        """
        if prompt_len < 0 or cached_tokens < 0 or branch_tokens < 0:
            raise ValueError(f"negative lengths: prompt_len={prompt_len}, cached_tokens={cached_tokens}, "
                             f"branch_tokens={branch_tokens}")
        bs = self.block_size
        first = cached_tokens // bs + 1  # first block index whose end lies strictly past cached_tokens
        last = prompt_len // bs
        if self.scheme == "naive":
            ends = {k * bs for k in range(first, last + 1)}
        else:
            every = self.checkpoint_every_blocks
            ends = {k * bs for k in range(first + (-first) % every, last + 1, every)}
            if last >= first:
                ends.add(last * bs)
        kept = sorted(ends)[-self.max_checkpoints_per_session:]
        if self.scheme == "k3" and branch_tokens % bs == 0 and cached_tokens < branch_tokens < prompt_len \
                and branch_tokens not in kept:
            kept = sorted([branch_tokens] + kept[int(len(kept) >= self.max_checkpoints_per_session):])
        return kept
