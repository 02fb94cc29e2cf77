"""QAT: fine-tune a trained checkpoint with the routed experts fake-quantised to MXFP4 (straight-through estimator).

The trainable leaves stay full precision (the "master" weights); every forward sees each routed expert weight
as ``fake_quant_mxfp4(w)``, whose value is exactly what serving computes from the packed checkpoint
(``dequantize_mxfp4(quantize_mxfp4(w))``: one dequantisation function, :mod:`k3serve.kernels.mxfp4`), and whose
gradient passes to ``w`` unchanged. Everything else (attention, router, latent projections, shared experts,
head) trains unquantised, as it is served.

Out dir of ``k3serve train qat``::

    config.json, model.safetensors   the MXFP4 serving checkpoint (routed experts packed, scale rule recorded)
    master/                          the full-precision master weights (what --resume continues from)
    train_state.pt, train_log.json, loss_curves.png   as for ``train target``
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.kernels.mxfp4 import fake_quant_mxfp4, quantize_mxfp4
from k3serve.model.checkpoint import save_checkpoint
from k3serve.model.config import ModelConfig
from k3serve.model.names import mxfp4_names
from k3serve.model.quant_config import MXFP4_FORMAT

MASTER_DIR = "master"


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and name.endswith(".weight")


def fake_quant_view(params: dict[str, torch.Tensor], rule: str) -> dict[str, torch.Tensor]:
    """`params` with every routed expert weight replaced by its fake-quantised value (STE; same keys)."""
    return {n: fake_quant_mxfp4(t, rule) if is_routed_expert(n) else t for n, t in params.items()}


def mxfp4_config(cfg: ModelConfig, rule: str) -> ModelConfig:
    return cfg.replace(quantization=MXFP4_FORMAT, quant_scale_rule=rule)


def save_mxfp4(cfg: ModelConfig, params: dict[str, torch.Tensor], out: str | Path, rule: str) -> Path:
    """Write the serving checkpoint of QAT weights: routed experts packed with `rule`, the rest as trained."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if is_routed_expert(name):
            p, s = mxfp4_names(name)
            tensors[p], tensors[s] = quantize_mxfp4(t.detach(), rule)
        else:
            tensors[name] = t
    return save_checkpoint(mxfp4_config(cfg, rule), tensors, out)
