"""Gated NoPE MLA layer (MODEL.md §3).

Prefill (and the reference's decode) decompress the cached latent with ``kv_b_proj``; engine decode uses the
absorbed form over pages: ``q_lat_h = W_UK_h^T q_nope_h`` scores against ``[c | k_pe]`` rows, the context stays in
latent space, then ``W_UV_h`` maps it out. Both give the same result to fp32 rounding. Heads are split over TP
ranks; the latent (``kv_a_proj_with_mqa``) is computed identically on every rank.
"""

from __future__ import annotations

import math

import torch

from k3serve.kernels.mla_decode import mla_decode
from k3serve.model.config import ModelConfig
from k3serve.model.deterministic import DefaultOps, per_head_gemm
from k3serve.model.layers.mla_blocked import attend_blocks
from k3serve.model.layers.mla_prefill import (absorbed_is_cheaper, attend_absorbed_flash_cpu, attend_blocked,
                                              attend_flash_cpu, decompress_padded)
from k3serve.model.layers.norm import rms_norm
from k3serve.model.layers.stacked import stack_rows
from k3serve.model.state import ForwardBatch
from k3serve.model.tp import TPGroup


class MLAAttention:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, tp: TPGroup,
                 mla_idx: int, ops: DefaultOps | None = None) -> None:
        self.cfg, self.tp, self.mla_idx = cfg, tp, mla_idx
        self.ops = ops or DefaultOps(tp)  # model/deterministic.py
        self.heads = cfg.num_attention_heads // tp.world
        w = lambda n: weights[prefix + n]  # noqa: E731
        if cfg.q_lora_rank:
            self.w_q_a, self.q_a_norm, self.w_q = w("q_a_proj.weight"), w("q_a_layernorm.weight"), w("q_b_proj.weight")
        else:
            self.w_q_a, self.q_a_norm, self.w_q = None, None, w("q_proj.weight")
        self.w_kv_a, self.kv_a_norm = w("kv_a_proj_with_mqa.weight"), w("kv_a_layernorm.weight")
        self.w_kv_b = w("kv_b_proj.weight")  # [H_local * (nope + v), rank]
        kv_b = self.w_kv_b.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        self.w_uk = kv_b[:, : cfg.qk_nope_head_dim]  # [H_local, nope, rank]
        self.w_uv = kv_b[:, cfg.qk_nope_head_dim:]  # [H_local, v, rank]
        self.w_gate = w("g_proj.weight") if cfg.mla_use_output_gate else None
        self.w_o = w("o_proj.weight")
        self.scale = 1.0 / math.sqrt(cfg.qk_head_dim)
        self._stack_input_projections()

    def _stack_input_projections(self) -> None:
        """Decode: the projections of x (``kv_a_proj_with_mqa``, ``q_a_proj`` or ``q_proj``, ``g_proj``) as one
        GEMV (layers/stacked.py)."""
        parts = [self.w_kv_a, self.w_q_a if self.w_q_a is not None else self.w_q]
        parts += [self.w_gate] if self.w_gate is not None else []
        self.w_in, self.in_sizes, views = stack_rows(parts, self.ops.deterministic)
        self.w_kv_a = views[0]
        if self.w_q_a is not None:
            self.w_q_a = views[1]
        else:
            self.w_q = views[1]
        if self.w_gate is not None:
            self.w_gate = views[2]

    def latent_rows(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B, T, d]` -> cached rows `[B, T, rank + rope]` = [RMSNorm(c_kv) | k_pe]. kv: x's
        ``kv_a_proj_with_mqa`` output when already computed (decode's stacked GEMV)."""
        kv = self.ops.linear(x, self.w_kv_a) if kv is None else kv
        c = rms_norm(kv[..., : self.cfg.kv_lora_rank], self.kv_a_norm, self.cfg.rms_norm_eps)
        return torch.cat([c, kv[..., self.cfg.kv_lora_rank:]], dim=-1)

    def queries(self, x: torch.Tensor, qa: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, d]` -> (q_nope `[B, T, H, nope]`, q_pe `[B, T, H, rope]`). qa: x's ``q_a_proj`` (or
        ``q_proj``) output when already computed (decode's stacked GEMV)."""
        lin, cu = self.ops.linear, self.ops.col_units
        if self.w_q_a is not None:
            qa = lin(x, self.w_q_a) if qa is None else qa
            q = lin(rms_norm(qa, self.q_a_norm, self.cfg.rms_norm_eps), self.w_q, cu)
        else:
            q = lin(x, self.w_q, cu) if qa is None else qa
        q = q.view(*x.shape[:2], self.heads, self.cfg.qk_head_dim)
        return q[..., : self.cfg.qk_nope_head_dim], q[..., self.cfg.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x `[B, T, d]` -> `[B, T, d]`; writes this call's latent rows into batch.latent first."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        if self.w_in is not None and self.ops.deterministic:  # every call: the same tiled GEMM (stacked.py)
            fused = self.ops.stack_linear(x, self.w_in).split(self.in_sizes, -1)
        elif batch.decode and self.w_in is not None:
            fused = self.ops.stack_linear(x, self.w_in).split(self.in_sizes, -1)
        else:
            fused = (None, None, None)
        batch.latent.write(self.mla_idx, self.latent_rows(x, fused[0]), batch.start_positions)
        q_nope, q_pe = self.queries(x, fused[1])
        if self.ops.deterministic:
            return self._forward_blocked(x, q_nope, q_pe, batch, fused[2] if len(fused) > 2 else None)
        if batch.decode and batch.latent.paged:
            attn = self._decode_absorbed(q_nope[:, 0], q_pe[:, 0], batch).unsqueeze(1)
        elif batch.kda_records is not None and batch.latent.paged:
            attn = self._verify_absorbed(q_nope, q_pe, batch)
        else:
            attn = torch.stack([self._decompressed(q_nope[b], q_pe[b], batch, b) for b in range(bsz)])
        attn = attn.flatten(2)  # [B, T, H_local * v]
        if self.w_gate is not None:
            gate = fused[2] if fused[0] is not None else self.ops.linear(x, self.w_gate)
            attn = attn * torch.sigmoid(gate.float())
        return self.ops.row_linear(attn.to(x.dtype), self.w_o)

    def _forward_blocked(self, x: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         batch: ForwardBatch, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Numerics mode ``deterministic`` (mla_blocked.py): the same fixed-block form for prefill and decode.
        gate: x's ``g_proj`` output when the stacked projection computed it."""
        ops, t = self.ops, x.shape[1]
        q = torch.cat([q_nope, q_pe], dim=-1).float() * self.scale  # [B, T, H, Dq]
        starts, kb = list(batch.start_positions), ops.numerics.key_block
        lengths = [s + t for s in starts]
        blocks = batch.latent.read_blocks(self.mla_idx, lengths, kb).float()  # [sum nb, KB, rank + rope]
        w_uk, w_uv = self.w_uk.float(), self.w_uv.float()
        # the packed GEMM caches model weights: a bf16 model's fp32 copies are made per call, so they keep the bmm
        head_gemm = ops.head_gemm if w_uk is self.w_uk and w_uv is self.w_uv else per_head_gemm
        outs = attend_blocks(list(q.unbind(0)), blocks, lengths, starts, w_uk, w_uv, kb, head_gemm)
        attn = torch.stack(outs).flatten(2)  # [B, T, H_local * v]
        if self.w_gate is not None:
            gate = ops.linear(x, self.w_gate, ops.col_units) if gate is None else gate
            attn = attn * torch.sigmoid(gate.float())
        return ops.row_linear(attn.to(x.dtype), self.w_o)

    def _decompressed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, b: int) -> torch.Tensor:
        """One request: q_nope `[T, H, nope]`, q_pe `[T, H, rope]` -> attention output `[T, H, v]` fp32.

        Keys are the L = start + T cached rows; the chunk's queries sit at positions start..start+T-1 (the
        prefix fully visible, causal inside the chunk). Inference on the CPU: torch's flash kernel, in the
        absorbed form for short chunks and over keys and values decompressed by one GEMM otherwise (the
        choice by FLOP count, mla_prefill.py); autograd or another device: the query-blocked form over
        explicit scores."""
        cfg = self.cfg
        t, heads = q_nope.shape[0], q_nope.shape[1]
        start = batch.start_positions[b]
        rows = batch.latent.read(self.mla_idx, b, start + t).float()  # [L, rank + rope]
        needs_grad = torch.is_grad_enabled() and (q_nope.requires_grad or q_pe.requires_grad
                                                  or rows.requires_grad or self.w_kv_b.requires_grad)
        if rows.device.type == "cpu" and not needs_grad:
            if absorbed_is_cheaper(t, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank):
                return attend_absorbed_flash_cpu(q_nope, q_pe, rows, self.w_uk, self.w_uv, start, self.scale)
            k, v = decompress_padded(rows, self.w_kv_b, heads, cfg.qk_nope_head_dim,
                                     cfg.kv_lora_rank)  # [L, H, nope + rope] each
            q = torch.cat([q_nope, q_pe], dim=-1).float()  # [T, H, nope + rope]
            return attend_flash_cpu(q, k, v, start, self.scale, cfg.v_head_dim)
        c, k_pe = rows[:, : cfg.kv_lora_rank], rows[:, cfg.kv_lora_rank:]
        k_nope = torch.einsum("lr,hnr->hln", c, self.w_uk.float())  # [H, L, nope]
        v = torch.einsum("lr,hvr->hlv", c, self.w_uv.float())  # [H, L, v]
        k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(heads, -1, -1)], dim=-1)  # [H, L, nope + rope]
        q = torch.cat([q_nope, q_pe], dim=-1).float().transpose(0, 1) * self.scale  # [H, T, nope + rope]
        return attend_blocked(q, k, v, start).transpose(0, 1)  # [T, H, v]

    def _verify_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Speculative verify: q_nope `[B, T, H, nope]`, q_pe `[B, T, H, rope]` -> `[B, T, H, v]` fp32.

        Each verify row is one query of the paged decode kernel: row i of request b sees that request's rows
        0 .. start_b + i (causal inside the window), so every row is computed as a plain decode step would."""
        bsz, t = q_nope.shape[:2]
        latent = batch.latent
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope.float(), self.w_uk.float()).flatten(0, 1)
        tables = latent.block_tables.repeat_interleave(t, dim=0)
        seq_lens = torch.tensor([s + i + 1 for s in batch.start_positions for i in range(t)], device=q_lat.device)
        ctx = mla_decode(q_lat, q_pe.float().flatten(0, 1), latent.layer_pages(self.mla_idx), tables, seq_lens,
                         self.scale)
        return torch.einsum("bhr,hvr->bhv", ctx.float(), self.w_uv.float()).unflatten(0, (bsz, t))

    def _decode_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope `[B, H, nope]`, q_pe `[B, H, rope]` -> `[B, H, v]` fp32 via the paged latent kernel."""
        latent = batch.latent
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), self.w_uk.float())
        seq_lens = torch.tensor([s + 1 for s in batch.start_positions], device=q_lat.device)
        ctx = mla_decode(q_lat, q_pe.float(), latent.layer_pages(self.mla_idx), latent.block_tables,
                               seq_lens, self.scale)
        return torch.einsum("bhr,hvr->bhv", ctx.float(), self.w_uv.float())
