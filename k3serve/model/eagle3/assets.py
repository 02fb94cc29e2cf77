"""The shipped EAGLE-3 drafters: package data beside the trained target they draft for.

``k3serve/assets/tiny-trained-drafter`` (LK loss, the default) and ``tiny-trained-drafter-kl`` (the KL
baseline, same budget), each made by the command in its ``train_log.json`` settings (docs/speculative.md).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# trained target preset -> {bench row name: asset directory}
SHIPPED = {"tiny-trained": {"eagle3-lk": "tiny-trained-drafter", "eagle3-kl": "tiny-trained-drafter-kl"}}


def shipped_drafters(target: str) -> dict[str, str]:
    """Row name -> directory of the drafters shipped for trained preset `target`."""
    if target not in SHIPPED:
        raise ValueError(f"no drafters ship for {target!r} (shipped: {sorted(SHIPPED)}); pass --drafters name=DIR")
    out = {}
    for name, sub in SHIPPED[target].items():
        path = Path(str(resources.files("k3serve.assets") / sub))
        if not (path / "config.json").is_file():
            raise ValueError(f"shipped drafter {path} is missing (package data not installed?)")
        out[name] = str(path)
    return out
