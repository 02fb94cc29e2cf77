"""Build a :class:`HybridModel` for one TP rank from a checkpoint, reading only that rank's slices."""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.contracts.numerics import Numerics
from k3serve.model.checkpoint import CheckpointError, CheckpointReader, load_config
from k3serve.model.model import HybridModel
from k3serve.model.names import checkpoint_specs
from k3serve.model.quant_check import check_tensor_forms
from k3serve.model.tp import SINGLE, TPGroup


def load_weights(path: str | Path, tp: TPGroup = SINGLE, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """This rank's tensors by checkpoint name (experts it does not own are not read: for MXFP4 checkpoints,
    their packed bytes and scales stay on disk)."""
    cfg = load_config(path)
    cfg.check_loadable()
    cfg.check_tp(tp.world)
    reader = CheckpointReader(path)
    # the tensors present decide the form of each weight; a config that says otherwise is refused
    check_tensor_forms(cfg, set(reader.names()), reader.dtype, CheckpointError)
    weights = {}
    for spec in checkpoint_specs(cfg):
        if spec.owned_by(tp.rank, tp.world, cfg.num_experts):
            weights[spec.name] = reader.read_local(spec, tp.rank, tp.world).to(device)
    return weights


def load_model(path: str | Path, tp: TPGroup = SINGLE, device: str | torch.device = "cpu",
               numerics: Numerics | None = None) -> HybridModel:
    """numerics: the mode (contracts/numerics.py); None is the default mode."""
    return HybridModel(load_config(path), load_weights(path, tp, device), tp, numerics)
