"""The cost model of one cluster in the fleet simulator: prefill rates and pool capacities.

Prefill is one FIFO server per cluster (a disaggregated cluster's prefill group works through its queue), so
time to first token = wait + uncached / ``prefill_tps`` + cached / ``restore_tps``. Decode runs on its own group
and does not delay a first token, so it is not modelled. Capacities are the prefix cache's pools: hash blocks of
MLA pages and KDA checkpoint slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    prefill_tps: float  # uncached prompt tokens per second per cluster
    restore_tps: float  # cached tokens per second (page and checkpoint copies)
    source: str  # where the figures come from

    def __post_init__(self) -> None:
        for name in ("prefill_tps", "restore_tps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost model: {name} must be > 0, got {getattr(self, name)}")

    def prefill_s(self, uncached: int, cached: int) -> float:
        return uncached / self.prefill_tps + cached / self.restore_tps


# K3 / Kimi Linear on one 8-GPU node (H100-class), an arithmetic estimate rather than a measurement: ~32B
# active parameters -> ~64 GFLOP per prompt token; 8 x 989 TFLOP/s dense BF16 at 40% utilisation ~= 3.2 PFLOP/s
# -> ~49K tokens/s, taken down to 40K for attention over long prompts. A restore copies pages and one KDA slot
# per checkpoint, device-local: ~1M tokens/s.
PRESETS = {
    "k3-8gpu": CostModel(40_000.0, 1_000_000.0, "estimate: 32B active params at 40% MFU on 8 H100 (docs/traffic.md)"),
}


def calibrated(path: str | Path) -> CostModel:
    """The model measured by ``k3serve bench trace --json`` on this machine (its ``prefill_tps`` figure)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"calibration file {path}: {e}") from None
    tps = data.get("prefill_tps")
    if not isinstance(tps, (int, float)) or tps <= 0:
        raise ValueError(f"calibration file {path}: no positive 'prefill_tps' (a `k3serve bench trace --json` "
                         f"result)")
    return CostModel(float(tps), float(tps) * 25, f"calibrated: {path} (bench trace, this machine)")


def model_named(name: str) -> CostModel:
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json"):
        return calibrated(name)
    raise ValueError(f"cost model must be one of {sorted(PRESETS)} or a bench trace JSON file, got {name!r}")


def with_rate(model: CostModel, prefill_tps: float | None) -> CostModel:
    return model if prefill_tps is None else replace(model, prefill_tps=prefill_tps,
                                                     source=f"{model.source}; prefill_tps set to {prefill_tps}")
