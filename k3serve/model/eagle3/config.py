"""The EAGLE-3 drafter's config: which target it drafts for, which target features it fuses, its window.

A drafter checkpoint directory holds ``config.json`` (this, :meth:`DrafterConfig.to_json`) and
``model.safetensors`` (:mod:`k3serve.model.eagle3.weights`). The target's whole HF config is embedded, so a
drafter is refused against any other target (:meth:`DrafterConfig.check_target`).

Feature blocks (docs/speculative.md, EAGLE-3: outputs of the 1st, 4th and last Attention-Residual blocks)::

    target layers   0 1 2 | 3 4 5 | 6 7 8          (tiny presets: 9 layers, attn_res_block_size 3 -> 3 blocks)
    block           0     | 1     | 2
    K3 rule         low = block 0, mid = block 3, high = last block      (needs >= 5 blocks)
    fewer blocks    low = block 0, mid = block n // 2, high = last       (tiny: 0, 1, 2)

low and mid are the blocks' outputs (the completed sublayer sum each block adds to the AttnRes sources;
without AttnRes the residual stream after the block, blocks of PLAIN_BLOCK_SIZE = 3 layers); high is the target's final hidden
state (the output mix, before the final norm): the tensor the target's head reads and what an MTP layer
is trained on, so the identity-on-high initialisation starts the drafter from MTP's input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from k3serve.model.config import ConfigError, ModelConfig

ARCHITECTURE = "K3Eagle3Drafter"
MODEL_TYPE = "k3_eagle3"
CONFIG_FILE = "config.json"
DEFAULT_WINDOW = 32


def feature_blocks(num_layers: int, block_size: int) -> tuple[int, int, int]:
    """(low, mid, high) block indices for a stack of `num_layers` in blocks of `block_size` (rule above)."""
    n = -(-num_layers // block_size)
    if n < 3:
        raise ConfigError(f"an EAGLE-3 drafter needs a target with >= 3 blocks of {block_size} layers; "
                          f"this one has {n}")
    return 0, (3 if n >= 5 else n // 2), n - 1


@dataclass(frozen=True)
class DrafterConfig:
    """One drafter: its target, the fused blocks, its attention window (positions, its per-request state)."""

    target: ModelConfig
    blocks: tuple[int, int, int]
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ConfigError(f"drafter window must be >= 2 positions, got {self.window}")
        n = self.num_blocks
        if not (0 <= self.blocks[0] < self.blocks[1] < self.blocks[2] == n - 1):
            raise ConfigError(f"drafter blocks {self.blocks} must be increasing and end at the last block {n - 1}")

    @classmethod
    def for_target(cls, target: ModelConfig, window: int = DEFAULT_WINDOW) -> "DrafterConfig":
        return cls(target, feature_blocks(target.num_hidden_layers, block_size(target)), window)

    @property
    def num_blocks(self) -> int:
        return -(-self.target.num_hidden_layers // block_size(self.target))

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def layer_index(self) -> int:
        """The drafter's layer number in the name space (vLLM's MTP convention: right after the target's)."""
        return self.target.num_hidden_layers

    @property
    def prefix(self) -> str:
        return f"{self.target.name_prefix}layers.{self.layer_index}."

    def to_json(self) -> dict:
        return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_size": self.hidden_size,
                "layer_index": self.layer_index, "feature_blocks": list(self.blocks), "window": self.window,
                "torch_dtype": "float32", "target": self.target.to_hf_dict()}

    @classmethod
    def from_json(cls, d: dict) -> "DrafterConfig":
        if d.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"drafter config: model_type must be {MODEL_TYPE!r}, got {d.get('model_type')!r}")
        for key in ("feature_blocks", "window", "target"):
            if key not in d:
                raise ConfigError(f"drafter config: missing key {key!r}")
        cfg = cls(ModelConfig.from_hf_dict(d["target"]), tuple(int(b) for b in d["feature_blocks"]), int(d["window"]))
        if d.get("layer_index", cfg.layer_index) != cfg.layer_index:
            raise ConfigError(f"drafter config: layer_index {d['layer_index']} != target layers {cfg.layer_index}")
        return cfg

    def save(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / CONFIG_FILE
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "DrafterConfig":
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"no drafter config at {path}")
        return cls.from_json(json.loads(path.read_text()))

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a target other than the one this drafter was made for (its features would mean nothing)."""
        if target.to_hf_dict() != self.target.to_hf_dict():
            raise ConfigError("this drafter was made for a different target model config")


# Layers per feature block of a target without Attention Residuals (the tiny presets' AttnRes block size).
PLAIN_BLOCK_SIZE = 3


def block_size(cfg: ModelConfig) -> int:
    """Layers per feature block: the Attention-Residual block size, or PLAIN_BLOCK_SIZE."""
    return cfg.attn_res_block_size or PLAIN_BLOCK_SIZE
