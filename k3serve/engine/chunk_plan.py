"""Chunked-prefill planning: which token ranges of which requests run in one prefill step.

A pure function so the scheduling rules are unit-tested without a model:

* every step has a token budget; short-class requests go first, so a 2K prompt never waits behind a 1M one
  for more than one step;
* while any long-class request is running it keeps a minimum share of each step (it cannot starve); in a step
  that serves short requests the long class gets only that share, so the step stays short and the next short
  request waits for little; steps without short work give the long class the whole budget, up to
  ``long_step_tokens``: a short request that arrives during a long-only step waits for that step, so the cap
  bounds the extra time to first token a burst of long prompts can cause (the cost of a long chunk grows with
  its context, so the cap is what keeps late chunks of a 1M prompt from stalling everyone);
* a chunk never crosses a KDA checkpoint boundary: the state at the boundary must exist between two chunks to
  be copied into the prefix cache;
* with ``grid > 1`` (numerics mode ``deterministic``) a chunk that does not finish its prompt ends on a multiple
  of ``grid`` absolute positions, so the chunked KDA kernel sees the chunks of a one-shot prefill.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkCandidate:
    request_id: str
    is_long: bool
    num_computed: int
    prompt_len: int
    boundaries: tuple[int, ...]  # checkpoint positions still ahead, ascending


@dataclass(frozen=True)
class ChunkWork:
    request_id: str
    start: int
    end: int  # exclusive

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _chunks_for(c: ChunkCandidate, budget: int, grid: int = 1) -> tuple[list[ChunkWork], int]:
    work, pos = [], c.num_computed
    while budget > 0 and pos < c.prompt_len:
        end = min(c.prompt_len, pos + budget)
        nxt = next((b for b in c.boundaries if b > pos), None)
        if nxt is not None:
            end = min(end, nxt)
        if end < c.prompt_len:
            end -= end % grid
            if end <= pos:
                break  # not enough budget left to reach the next grid point
        work.append(ChunkWork(c.request_id, pos, end))
        budget -= end - pos
        pos = end
    return work, budget


def plan_chunks(candidates: list[ChunkCandidate], token_budget: int, long_min_share: float = 0.25,
                long_step_tokens: int | None = None, grid: int = 1) -> list[ChunkWork]:
    """Chunks for one step, shorts first (candidates keep their arrival order within a class).

    token_budget: tokens per step; long_step_tokens: the most tokens long requests get in one step
    (None: the whole budget); grid: unfinished chunks end on multiples of it (1: anywhere)."""
    if token_budget <= 0:
        raise ValueError("token_budget must be positive")
    if long_step_tokens is not None and long_step_tokens <= 0:
        raise ValueError("long_step_tokens must be positive")
    if token_budget < grid or (long_step_tokens is not None and long_step_tokens < grid):
        raise ValueError(f"step_token_budget and long_step_tokens must be >= the chunk grid {grid} "
                         f"(numerics: deterministic), got {token_budget} and {long_step_tokens}")
    shorts = [c for c in candidates if not c.is_long]
    longs = [c for c in candidates if c.is_long]
    long_cap = token_budget if long_step_tokens is None else min(token_budget, long_step_tokens)
    reserve = min(long_cap, int(token_budget * long_min_share)) if longs else 0
    budget = token_budget - reserve
    plan: list[ChunkWork] = []
    for c in shorts:
        work, budget = _chunks_for(c, budget, grid)
        plan += work
    budget = reserve if plan else min(long_cap, budget + reserve)
    for c in longs:
        work, budget = _chunks_for(c, budget, grid)
        plan += work
    return plan
