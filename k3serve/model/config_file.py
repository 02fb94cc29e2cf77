"""A checkpoint's ``config.json``: where it lives and how it is read, without torch.

Kept apart from ``checkpoint.py`` (safetensors and torch) so that processes that only need the model's shape
(a router validates token ids and prompt lengths against it) do not import torch, ~3 s of CPU per process.
"""

from __future__ import annotations

from pathlib import Path

from k3serve.model.config import ConfigError, ModelConfig

CONFIG_FILE = "config.json"


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint dir, or of a bare config.json file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"no such file or directory: {path}")
    if path.is_dir() and not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"{path} has no {CONFIG_FILE}")
    return ModelConfig.from_json_file(path)
