"""Pool occupancy as it travels from a cluster to status readers (heartbeat load map -> router -> client).

The names and what they count are documented in `k3serve/cluster/pools.py`, which takes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolUsage:
    used: int
    capacity: int = 0  # 0: no fixed capacity


def as_load(pools: Mapping[str, PoolUsage]) -> dict[str, float]:
    """Flattened for the heartbeat's load map: ``pool.<name>.used`` / ``pool.<name>.capacity``."""
    out: dict[str, float] = {}
    for name, u in pools.items():
        out[f"pool.{name}.used"] = float(u.used)
        out[f"pool.{name}.capacity"] = float(u.capacity)
    return out


def from_load(load: Mapping[str, float]) -> dict[str, PoolUsage]:
    """Inverse of :func:`as_load` (what a router reads back from a heartbeat)."""
    names = {k[len("pool."):-len(".used")] for k in load if k.startswith("pool.") and k.endswith(".used")}
    return {n: PoolUsage(int(load[f"pool.{n}.used"]), int(load.get(f"pool.{n}.capacity", 0))) for n in sorted(names)}
