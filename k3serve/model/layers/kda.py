"""Kimi Delta Attention layer (MODEL.md §2) over explicit head-contiguous state blocks.

Heads are split over TP ranks (q/k/v/gate/decay projections column-parallel, ``o_proj`` row-parallel and
all-reduced); a rank sees only its local heads' blocks.
"""

from __future__ import annotations

import torch

from k3serve.kernels.gate import kda_gate
from k3serve.kernels.kda import chunk_kda, recurrent_kda
from k3serve.kernels.kda_records import record_offsets
from k3serve.kernels.kda_spec import kda_verify
from k3serve.kernels.short_conv import short_conv, short_conv_step
from k3serve.model.config import ModelConfig
from k3serve.model.deterministic import BMM_MIN_OUT, DefaultOps
from k3serve.model.layers.norm import rms_norm
from k3serve.model.layers.stacked import stack_rows
from k3serve.model.scalars import fp32
from k3serve.model.state import (conv_window_channels, conv_windows_all, kda_conv_view, kda_recurrent_view,
                                 store_conv_window, store_conv_windows_all)
from k3serve.model.tp import TPGroup


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-head L2 normalisation in fp32: x `[..., K]` -> x / sqrt(sum(x^2) + eps)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + fp32(eps))


class KDAAttention:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, tp: TPGroup,
                 ops: DefaultOps | None = None) -> None:
        self.cfg, self.tp = cfg, tp
        self.ops = ops or DefaultOps(tp)  # model/deterministic.py: the numerics mode's matmuls and TP sums
        self.heads = cfg.kda_num_heads // tp.world
        self.k = cfg.kda_head_dim
        w = lambda n: weights[prefix + n]  # noqa: E731
        self.w_q, self.w_k, self.w_v = w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")
        self.conv_w = [w(f"{x}_conv1d.weight").squeeze(1) for x in "qkv"]  # each [H_local*K, W]
        # decode steps run the three convs as one call over q | k | v channels: the taps stacked like the
        # projections (stacked.py; None for trained weights), the separate taps becoming views of the stack
        self.conv_w_qkv, _, conv_views = stack_rows(self.conv_w, self.ops.deterministic)
        self.conv_w = list(conv_views)
        a_log = w("A_log")
        self.a_log = a_log.reshape(-1).float()  # [H_local] (checkpoint quirks already sliced by the loader)
        self.dt_bias = w("dt_bias").float()
        self.w_f_a, self.w_f_b = w("f_a_proj.weight"), w("f_b_proj.weight")
        self.w_b = w("b_proj.weight")
        if cfg.use_full_rank_gate:
            self.w_g, self.w_g_a, self.w_g_b = w("g_proj.weight"), None, None
        else:
            self.w_g, self.w_g_a, self.w_g_b = None, w("g_a_proj.weight"), w("g_b_proj.weight")
        self.o_norm = w("o_norm.weight")
        self.w_o = w("o_proj.weight")
        self._stack_input_projections()

    def _stack_input_projections(self) -> None:
        """Decode: the six projections of x as one GEMV (layers/stacked.py)::

            w_in = [w_q; w_k; w_v; w_f_a; w_b; w_g (or w_g_a)]     [3 HK + r + H + g, d]
        """
        gate = self.w_g if self.w_g is not None else self.w_g_a
        self.w_in, self.in_sizes, views = stack_rows([self.w_q, self.w_k, self.w_v, self.w_f_a, self.w_b, gate],
                                                     self.ops.deterministic)
        self.w_q, self.w_k, self.w_v, self.w_f_a, self.w_b = views[:5]
        if self.w_g is not None:
            self.w_g = views[5]
        else:
            self.w_g_a = views[5]

    def forward(self, x: torch.Tensor, blocks: torch.Tensor, decode: bool,
                records: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B, T, d]`; blocks `[B, H_local, block_floats]` fp32 (updated in place). Returns `[B, T, d]`.

        records: speculative verify: `[B, H_local, T, record_floats(K)]` fp32, filled with this call's per-token
        records (kernels/kda_spec.py layout); blocks are then only read (the commit replays the records)."""
        cfg, h, k = self.cfg, self.heads, self.k
        lin, cu = self.ops.linear, self.ops.col_units  # cu: column-parallel weights' units on this rank
        bsz, t, _ = x.shape
        conv = kda_conv_view(blocks, k, cfg.conv_window)
        stacked = None
        if self.w_in is not None and (decode or self.ops.deterministic):  # deterministic: every call (stacked.py)
            stacked = self.ops.stack_linear(x, self.w_in)  # [B, T, 3 HK + ...]: q | k | v | f_a | b | g
        fused = stacked.split(self.in_sizes, -1) if stacked is not None else None
        if decode and stacked is not None and records is None and self.conv_w_qkv is not None:
            # one conv call over the q | k | v channels instead of three (a decode step is op-count bound; the
            # conv is per channel, so the bits are those of the three calls)
            y, new_window = short_conv_step(stacked[:, 0, : 3 * h * k].float(), self.conv_w_qkv,
                                            conv_windows_all(conv))
            store_conv_windows_all(conv, new_window)
            qkv = list(y.view(bsz, 1, 3, h, k).unbind(2))
        else:
            qkv = self._conv_each(x, fused, conv, decode, records)
        q, kk, v = l2_normalize(qkv[0]), l2_normalize(qkv[1]), qkv[2].float()
        z = lin(fused[3] if fused is not None else lin(x, self.w_f_a), self.w_f_b, cu)  # [B, T, H*K]
        g = kda_gate(z.float(), self.a_log, self.dt_bias, cfg.gate_lower_bound)  # [B, T, H, K] fp32
        # deterministic: b_proj's 1-head units keep their own narrow GEMMs (a column of the stack rounds
        # differently from a 1-column GEMM), the mode's bits stay those of the separate projections
        narrow = fused is None or (self.ops.deterministic and self.w_b.shape[0] // cu < BMM_MIN_OUT)
        beta = self.ops.unary(torch.sigmoid, (lin(x, self.w_b, cu) if narrow else fused[4]).float())
        state = kda_recurrent_view(blocks, k)
        if records is not None:
            off = record_offsets(k)
            o, u = kda_verify(q, kk, v, g.view(bsz, t, h, k), beta, state)
            records[..., off["k"]: off["k"] + k] = kk.transpose(1, 2)
            records[..., off["g"]: off["g"] + k] = g.view(bsz, t, h, k).transpose(1, 2)
            records[..., off["u"]: off["u"] + k] = u.transpose(1, 2)
        elif decode and not torch.is_grad_enabled():  # serving: the kernel updates the pool's state in place
            o, _ = recurrent_kda(q, kk, v, g.view(bsz, t, h, k), beta, initial_state=state, inplace_state=True)
        else:
            kernel = recurrent_kda if decode else chunk_kda
            o, final = kernel(q, kk, v, g.view(bsz, t, h, k), beta, initial_state=state, output_final_state=True)
            state.copy_(final)
        o = rms_norm(o.float(), self.o_norm, cfg.rms_norm_eps)  # [B, T, H, K]
        if fused is not None:
            gate = fused[5] if self.w_g is not None else lin(fused[5], self.w_g_b, cu)
        else:
            gate = lin(x, self.w_g, cu) if self.w_g is not None else lin(lin(x, self.w_g_a), self.w_g_b, cu)
        o = o * torch.sigmoid(gate.float().view(bsz, t, h, k))
        return self.ops.row_linear(o.flatten(2).to(x.dtype), self.w_o)

    def _conv_each(self, x: torch.Tensor, fused: tuple[torch.Tensor, ...] | None, conv: torch.Tensor, decode: bool,
                   records: torch.Tensor | None) -> list[torch.Tensor]:
        """q, k, v after their short convs, one projection at a time: each `[B, T, H, K]` fp32. x `[B, T, d]`;
        fused: the stacked projections' split output (or None: separate GEMMs); conv `[B, H, 3, W-1, K]` (the
        windows, updated unless verifying); records: as ``forward``."""
        h, k = self.heads, self.k
        bsz, t, _ = x.shape
        off = record_offsets(k)
        qkv = []
        for i, w_proj in enumerate((self.w_q, self.w_k, self.w_v)):
            raw = fused[i] if fused is not None else self.ops.linear(x, w_proj, self.ops.col_units)  # [B, T, H*K]
            window = conv_window_channels(conv, i)
            if records is not None:  # verify: the window is read, never stored; raw inputs go to the records
                y, _ = short_conv(raw.float(), self.conv_w[i], window)
                records[..., off["raw"] + i * k: off["raw"] + (i + 1) * k] = raw.float().view(bsz, t, h, k).transpose(1, 2)
                qkv.append(y.view(bsz, t, h, k))
                continue
            if decode:
                y, new_window = short_conv_step(raw[:, 0].float(), self.conv_w[i], window)
                y = y.unsqueeze(1)
            else:
                y, new_window = short_conv(raw.float(), self.conv_w[i], window)
            store_conv_window(conv, i, new_window)
            qkv.append(y.view(bsz, t, h, k))
        return qkv
