"""Trainable tensors under their public checkpoint names, and the model built over them for one step.

The checkpoint's full-shape tensors are the parameters (fp32 leaves). A :class:`~k3serve.model.model.HybridModel`
is rebuilt from them for every step (it only takes views, microseconds), so the training forward is exactly
the serving model's code over tensors that require grad. MoE selection biases (``e_score_correction_bias``)
are not gradient-trained: :mod:`k3serve.train.balance` sets them.
"""

from __future__ import annotations

import torch

from k3serve.model.config import ModelConfig
from k3serve.model.init import random_weights
from k3serve.model.model import HybridModel
from k3serve.model.names import SplitKind, checkpoint_specs

BIAS_SUFFIX = "gate.e_score_correction_bias"
# Output projections of each residual branch start smaller, so the 9-layer stack starts near the identity
# (GPT-2's scaled residual init); the random-checkpoint init is tuned for varied outputs, not for training.
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight", ".w2.weight", "routed_expert_up_proj.weight")


def init_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """fp32 leaves at the checkpoint's full shapes, from the random-checkpoint init (seeded by name)."""
    out: dict[str, torch.Tensor] = {}
    scale = (2.0 * cfg.num_hidden_layers) ** -0.5
    for name, t in random_weights(cfg.replace(torch_dtype="float32"), seed).items():
        t = t.float().clone()
        if name.endswith(_RESIDUAL_OUT):
            t.mul_(scale)
        if name.endswith(BIAS_SUFFIX):
            t.zero_()
        out[name] = t.requires_grad_(not name.endswith(BIAS_SUFFIX))
    return out


def no_decay(name: str) -> bool:
    """Tensors AdamW must not shrink toward 0: norms, gates' decay parameters, biases, conv taps, AttnRes."""
    return (name.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight", "_res_proj.weight"))
            or name.endswith(BIAS_SUFFIX))


def model_view(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> HybridModel:
    """A single-rank HybridModel over `params` (views: gradients flow back into the leaves).

    The loader hands the model each tensor's TP=1 local part; for K3's zero-padded ``A_log`` that is the first
    H entries, so the same slice is taken here.
    """
    local = {}
    for spec in checkpoint_specs(cfg):
        t = params[spec.name]
        local[spec.name] = t[spec.local_index(0, 1)] if spec.split.kind is SplitKind.HEAD_PREFIX else t
    return HybridModel(cfg, local)
