"""The simulator's runs: every (fleet size, cache size, policy) of one invocation, the shared-cache reference,
a cluster's death, and the smallest fleet that meets the TTFT SLO (what ``k3serve sim --json`` prints)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.router.placement import POLICIES
from k3serve.sim.cost import CostModel
from k3serve.sim.fleet import FleetSpec, simulate
from k3serve.sim.trace import BLOCK, TraceRequest, ideal_reuse, scale_rate, working_set_blocks


@dataclass(frozen=True)
class SimPlan:
    clusters: tuple[int, ...]
    policies: tuple[str, ...]
    cache: tuple[float, ...] = (1.0,)  # fleet cache capacity as fractions of the trace's working set
    pages: int = 0  # hash blocks per cluster instead of a fraction (a deployment's pool), 0: use ``cache``
    slots: int = 0  # KDA slots per cluster, 0: one per ``slot_blocks`` blocks of cache (at least 8)
    slot_blocks: int = 8
    rate_scale: float = 1.0
    slo_s: float = 2.0
    kill_at_s: float | None = None
    fleet_search: bool = False
    policy: PrefixCachePolicy = PrefixCachePolicy(page_size=BLOCK)

    def __post_init__(self) -> None:
        if not self.clusters or min(self.clusters) < 1:
            raise ValueError(f"--clusters must list sizes >= 1, got {self.clusters}")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValueError(f"--policy must list some of {POLICIES}, got {self.policies}")
        if not self.cache or not all(0 < c for c in self.cache):
            raise ValueError(f"--cache fractions must be > 0, got {self.cache}")
        if self.slot_blocks < 1 or self.pages < 0 or self.slots < 0:
            raise ValueError("--slot-blocks must be >= 1 and --pages/--slots >= 0")
        if not self.slo_s > 0:
            raise ValueError(f"--slo-s must be > 0, got {self.slo_s}")


def fleet_for(plan: SimPlan, n: int, frac: float, ws: int, largest: int) -> FleetSpec:
    """Per-cluster pools: the fleet's share of ``frac`` x the working set, never below the largest prompt."""
    pages = plan.pages or max(math.ceil(frac * ws / n), largest + 1)
    slots = plan.slots or max(8, pages // plan.slot_blocks)
    return FleetSpec(n, pages, slots, plan.policy)


def run_plan(reqs: list[TraceRequest], plan: SimPlan, cost: CostModel) -> dict:
    scaled = scale_rate(reqs, plan.rate_scale) if plan.rate_scale != 1.0 else [(r, 0) for r in reqs]
    base = [r for r, _ in scaled]
    ws = working_set_blocks(reqs) * max(1, math.ceil(plan.rate_scale))
    largest = max(r.blocks for r in base)
    runs = []
    for frac in plan.cache:
        shared = None
        for n in plan.clusters:
            spec = fleet_for(plan, n, frac, ws, largest)
            if shared is None:  # one cache of the whole fleet's capacity: what sharding costs in reuse
                total = replace(spec, clusters=1, pages=spec.pages * n, slots=spec.slots * n)
                shared = simulate(scaled, total, cost, plan.policies[0], slo_s=plan.slo_s)["reuse"]
            for policy in plan.policies:
                kill = ("c0", plan.kill_at_s) if plan.kill_at_s is not None and n > 1 else None
                run = simulate(scaled, spec, cost, policy, slo_s=plan.slo_s, kill=kill)
                run.update(cache_fraction=frac, rate_scale=plan.rate_scale, shared_cache_reuse=shared)
                runs.append(run)
    reused, prompt = ideal_reuse(reqs)
    out = {"requests": len(scaled), "working_set_blocks": ws, "ideal_reuse_of_trace": round(reused / prompt, 4),
           "cost_model": {"prefill_tps": cost.prefill_tps, "restore_tps": cost.restore_tps, "source": cost.source},
           "runs": runs}
    if plan.fleet_search:
        out["fleet_needed"] = {p: smallest_fleet(scaled, plan, cost, p, ws, largest) for p in plan.policies}
    return out


def smallest_fleet(scaled, plan: SimPlan, cost: CostModel, policy: str, ws: int, largest: int,
                   limit: int = 1024) -> dict:
    """The fewest clusters with >= 99% of requests under the SLO (first cache fraction): doubling, then
    bisection. ``clusters`` None when even ``limit`` does not."""
    def ok(n: int) -> bool:
        run = simulate(scaled, fleet_for(plan, n, plan.cache[0], ws, largest), cost, policy, slo_s=plan.slo_s)
        return run["slo_attainment"] >= 0.99

    hi = 1
    while not ok(hi):
        if hi >= limit:
            return {"clusters": None, "slo_s": plan.slo_s, "searched_up_to": limit}
        hi *= 2
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return {"clusters": hi, "slo_s": plan.slo_s, "cache_fraction": plan.cache[0]}
