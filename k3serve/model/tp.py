"""Tensor-parallel group handle: the rank, the degree, and the one collective the model needs.

The model calls :meth:`TPGroup.all_reduce` after every row-parallel projection (KDA/MLA ``o_proj``, dense
``down_proj``, MoE partial sums). With ``world == 1`` it is the identity, so the single-process reference and
a TP=1 worker run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world: int = 1
    group: Any = None  # a torch.distributed ProcessGroup, None for the default group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"TP rank {self.rank} outside [0, {self.world})")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group in place (returns it). Identity for a single rank."""
        if self.world == 1:
            return t
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` stacked in rank order: `[world, *t.shape]` (deterministic numerics' ordered sums)."""
        if self.world == 1:
            return t.unsqueeze(0)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return torch.stack(out)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s tensor on every rank (used to keep sampled tokens identical across ranks)."""
        if self.world == 1:
            return t
        dist.broadcast(t, src=self._global(src), group=self.group)
        return t

    def _global(self, local_rank: int) -> int:
        if self.group is None:
            return local_rank
        return dist.get_global_rank(self.group, local_rank)


SINGLE = TPGroup()


def init_tp_group(rank: int, world: int, init_file: str, backend: str | None = None) -> TPGroup:
    """Join a process group rendezvousing through a shared file (no TCP port to pick or leak).

    `backend` defaults to nccl when CUDA is available, else gloo.
    """
    if world == 1:
        return SINGLE
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    return TPGroup(rank=rank, world=world, group=None)
