"""Matmul FLOPs of a training step, to set achieved FLOP/s against the machine's own torch.mm rate.

Counted per token (elementwise work ignored, as in ``k3serve bench kernels``): 2 FLOPs per weight of every
matrix the token goes through (embedding lookups are free; routed experts count k of E), MLA scores and
values against the whole window as computed (the T x T block is masked, not skipped), the KDA chunk form
(``chunk_flops`` at the training chunk size), and backward = 2 x forward.
"""

from __future__ import annotations

from k3serve.kernels.flops import chunk_flops
from k3serve.kernels.kda_autograd import CHUNK
from k3serve.model.config import ModelConfig
from k3serve.model.names import SplitKind, checkpoint_specs


def forward_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Matmul FLOPs of one token's forward in a window of `context` tokens."""
    weights = 0.0
    for spec in checkpoint_specs(cfg):
        if len(spec.shape) < 2 or spec.name.endswith("embed_tokens.weight") or "conv1d" in spec.name:
            continue
        share = cfg.num_experts_per_token / cfg.num_experts if spec.split.kind is SplitKind.EXPERT else 1.0
        weights += spec.numel * share
    mla = cfg.num_mla_layers * cfg.num_attention_heads * 2 * context * (cfg.qk_head_dim + cfg.v_head_dim)
    k = cfg.kda_head_dim
    kda = cfg.num_kda_layers * chunk_flops(1, context, cfg.kda_num_heads, k, k, CHUNK) / context
    return 2.0 * weights + mla + kda


def train_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Forward + backward (2 x forward) matmul FLOPs per trained token."""
    return 3.0 * forward_flops_per_token(cfg, context)
