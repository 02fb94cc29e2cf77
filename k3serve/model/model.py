"""The hybrid KDA/MLA model: one class for kimi_linear and kimi_k3, driven by the config.

Weights are plain tensors (this rank's TP slices) keyed by their checkpoint names, and the
forward runs over an explicit :class:`~k3serve.model.state.ForwardBatch` (KDA blocks + MLA latent cache), so
the same code serves the reference generator, chunked prefill from any initial state, and batched decode.
Serving calls :meth:`HybridModel.forward` (inference mode); training calls :meth:`HybridModel.logits` with
weights that require grad (``k3serve.train``), so both run the same layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.contracts.numerics import Numerics
from k3serve.model.config import ModelConfig
from k3serve.model.deterministic import DefaultOps, make_ops
from k3serve.model.layers.attn_res import attn_res_mix
from k3serve.model.layers.ffn import MoE, DenseFFN
from k3serve.model.layers.kda import KDAAttention
from k3serve.model.layers.mla import MLAAttention
from k3serve.model.layers.norm import rms_norm
from k3serve.model.profiling import profile_label
from k3serve.model.state import ForwardBatch, new_kda_blocks
from k3serve.model.tp import SINGLE, TPGroup

# torch.profiler labels of the sublayers (with their input norms); `bench decode` sums them per step.
PROFILE_LABELS = {"kda": "k3serve.attention.kda", "mla": "k3serve.attention.mla", "moe": "k3serve.ffn.moe",
                  "dense": "k3serve.ffn.dense"}


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer: int, tp: TPGroup,
                 ops: DefaultOps) -> None:
        p = f"{cfg.name_prefix}layers.{layer}."
        self.layer, self.is_kda = layer, cfg.is_kda_layer(layer)
        self.kda_idx = cfg.kda_index(layer) if self.is_kda else -1
        self.input_norm = weights[p + "input_layernorm.weight"]
        self.post_norm = weights[p + "post_attention_layernorm.weight"]
        if self.is_kda:
            self.attn = KDAAttention(cfg, weights, p + "self_attn.", tp, ops)
        else:
            self.attn = MLAAttention(cfg, weights, p + "self_attn.", tp, cfg.mla_index(layer), ops)
        self.ffn = MoE(cfg, weights, p, tp, ops) if cfg.is_moe_layer(layer) else DenseFFN(cfg, weights, p, tp, ops)
        self.attn_label = PROFILE_LABELS["kda" if self.is_kda else "mla"]
        self.ffn_label = PROFILE_LABELS["moe" if cfg.is_moe_layer(layer) else "dense"]
        if cfg.attn_res_block_size:
            self.attn_res = (weights[p + "self_attention_res_proj.weight"], weights[p + "self_attention_res_norm.weight"])
            self.mlp_res = (weights[p + "mlp_res_proj.weight"], weights[p + "mlp_res_norm.weight"])

    def attention(self, x: torch.Tensor, batch: ForwardBatch, eps: float) -> torch.Tensor:
        with profile_label(self.attn_label):
            h = rms_norm(x, self.input_norm, eps)
            if self.is_kda:
                records = batch.kda_records[self.kda_idx] if batch.kda_records is not None else None
                return self.attn.forward(h, batch.kda_blocks[self.kda_idx], batch.decode, records)
            return self.attn.forward(h, batch)

    def feed_forward(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        with profile_label(self.ffn_label):
            return self.ffn.forward(rms_norm(x, self.post_norm, eps))


class HybridModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], tp: TPGroup = SINGLE,
                 numerics: Numerics | None = None) -> None:
        """numerics: the mode (contracts/numerics.py); None is the default mode."""
        cfg.check_tp(tp.world)
        self.cfg, self.tp = cfg, tp
        self.ops = make_ops(cfg, tp, numerics, weights)  # deterministic: refuses a CPU that breaks its GEMM facts
        p = cfg.name_prefix
        self.embed = weights[p + "embed_tokens.weight"]
        self.layers = [DecoderLayer(cfg, weights, i, tp, self.ops) for i in range(cfg.num_hidden_layers)]
        self.norm = weights[p + "norm.weight"]
        self.lm_head = weights[cfg.lm_head_name]
        if cfg.attn_res_block_size:
            self.output_res = (weights[p + "output_attn_res_proj.weight"], weights[p + "output_attn_res_norm.weight"])

    @property
    def kda_heads_local(self) -> int:
        return self.cfg.kda_num_heads // self.tp.world

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_kda_state(self, batch: int) -> list[torch.Tensor]:
        """Zeroed KDA blocks for `batch` fresh requests (this rank's heads)."""
        return new_kda_blocks(self.cfg, batch, self.kda_heads_local, self.device)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """token_ids `[B, T]` (int64) -> logits fp32 `[B, T, vocab]` if all_logits else `[B, vocab]` (last token).

        Advances the state in `batch` by T tokens per request (the caller advances its positions).
        """
        return self.logits(token_ids, batch, all_logits)

    def logits(self, token_ids: torch.Tensor, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """:meth:`forward` without inference mode: differentiable when the weights require grad (training)."""
        if batch.decode and token_ids.shape[1] != 1:
            raise ValueError("decode forward takes exactly one token per request")
        with self.ops.threads():  # deterministic numerics: a fixed intra-op thread count
            x = F.embedding(token_ids, self.embed)
            h = self._stack_attn_res(x, batch) if self.cfg.attn_res_block_size else self._stack_plain(x, batch)
            if self.cfg.num_hidden_layers in batch.capture_layers:  # "layer L": the final hidden state (EAGLE-3's high)
                batch.captured[self.cfg.num_hidden_layers] = h.float()
            if not all_logits:
                h = h[:, -1]
            return self.ops.linear(rms_norm(h, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    def _stack_plain(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        for layer in self.layers:
            x = x + layer.attention(x, batch, eps)
            if batch.on_layer is not None:
                batch.on_layer(layer.layer)
            x = x + layer.feed_forward(x, eps)
            if layer.layer in batch.capture_layers:
                batch.captured[layer.layer] = x.float()
        return x

    def _stack_attn_res(self, emb: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Block Attention Residuals (MODEL.md §4).

        ```
        B = [] (completed sources), P = emb (partial sum of the current block)
        per layer l: x = mix(B + [P]) if B else P;  if l % S == 0: B += [P]; P = None
                     P = Attn(x) (+ P);  x = mix(B + [P]);  P = P + FFN(x)
        end: h = mix(B + [P])
        ```
        """
        eps, size = self.cfg.rms_norm_eps, self.cfg.attn_res_block_size
        sm, dot = self.ops.softmax0, self.ops.row_dot  # the numerics mode's operators (model/deterministic.py)
        done: list[torch.Tensor] = []
        partial: torch.Tensor | None = emb
        for layer in self.layers:
            x = attn_res_mix(done + [partial], *layer.attn_res, eps, sm, dot) if done else partial
            if layer.layer % size == 0:
                done.append(partial)
                partial = None
            a = layer.attention(x, batch, eps)
            if batch.on_layer is not None:
                batch.on_layer(layer.layer)
            partial = a if partial is None else partial + a
            x = attn_res_mix(done + [partial], *layer.mlp_res, eps, sm, dot)
            partial = partial + layer.feed_forward(x, eps)
            if layer.layer in batch.capture_layers:
                batch.captured[layer.layer] = partial.float()
        return attn_res_mix(done + [partial], *self.output_res, eps, sm, dot)
