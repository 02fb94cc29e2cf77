"""The EAGLE-3 drafter: one MTP-structured decoder block over [enorm(embed(next)) | hnorm(fused feature)].

```
 target features at position t:  h_low  h_mid  h_high            (k3serve.model.eagle3.features)
                                   \\     |     /
 g_t = W_E3 · [h_low | h_mid | h_high]       (fc, [d, 3d], bias-free; init selects h_high: g_t = h_high)
 x   = eh_proj · [enorm(embed(x_{t+1})) | hnorm(g_t)]                       (embed: the target's, a frozen copy)
 y   = x + o_proj(attn(input_layernorm(x)) · sigmoid(g_proj(..)))     gated NoPE MLA, window of W rows
 d_t = y + mlp(post_attention_layernorm(y))                             the drafter's output feature
 q(x_{t+2}) = softmax(lm_head(shared_head.norm(d_t)))                   (lm_head: the target's, a frozen copy)
```

Unrolled (training-time test and chain drafting), step j feeds d from step j-1 in place of g and the token
step j-1 proposed (training: the data token, whose target distribution is the label). Tensors are views of
the weight dicts, so training passes leaves that require grad and serving passes loaded tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3serve.model.eagle3.attention import attend, shift_right, teacher_mask
from k3serve.model.eagle3.config import DrafterConfig
from k3serve.model.eagle3.weights import SHARED_EMBED, SHARED_HEAD
from k3serve.model.layers.ffn import GatedMLP
from k3serve.model.layers.mla import MLAAttention
from k3serve.model.layers.norm import rms_norm
from k3serve.model.tp import SINGLE


@dataclass(frozen=True)
class Unrolled:
    """Training-time-test outputs: per step j (0-based list index j-1) logits `[B, T, V]` at query positions
    p = a + j - 1 (valid for p >= j - 1), predicting token p + 2; and the last step's output features."""

    logits: list[torch.Tensor]


class Eagle3Drafter:
    def __init__(self, cfg: DrafterConfig, weights: dict[str, torch.Tensor]) -> None:
        """weights: the drafter's tensors by name (:mod:`k3serve.model.eagle3.weights`), including its frozen
        copies of the target's embedding and head `[V, d]`."""
        self.cfg, t, p = cfg, cfg.target, cfg.prefix
        self.eps = t.rms_norm_eps
        w = lambda n: weights[p + n]  # noqa: E731
        self.embed, self.lm_head = w(SHARED_EMBED), w(SHARED_HEAD)
        self.fc, self.enorm, self.hnorm, self.eh_proj = w("fc.weight"), w("enorm.weight"), w("hnorm.weight"), w("eh_proj.weight")
        self.input_norm, self.post_norm = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        self.attn = MLAAttention(t, weights, p + "self_attn.", SINGLE, 0)
        self.mlp = GatedMLP(t, weights, p + "mlp.")
        self.head_norm = w("shared_head.norm.weight")

    @property
    def device(self) -> torch.device:
        return self.fc.device

    # ------------------------------------------------------------------------------------------ pieces
    def fuse(self, low: torch.Tensor, mid: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """Target features `[..., d]` each -> fused g `[..., d]` (fp32)."""
        return F.linear(torch.cat([low.float(), mid.float(), high.float()], dim=-1), self.fc)

    def block_input(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """tokens `[B, T]` (the next token at each position), g `[B, T, d]` -> x `[B, T, d]`."""
        e = rms_norm(F.embedding(tokens, self.embed).float(), self.enorm, self.eps)
        return F.linear(torch.cat([e, rms_norm(g, self.hnorm, self.eps)], dim=-1), self.eh_proj)

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, d]` -> keys `[B, H, T, nope + rope]`, values `[B, H, T, v]` (MLA latent decompressed)."""
        a, c = self.attn, self.cfg.target
        lat = a.latent_rows(rms_norm(x, self.input_norm, self.eps)).float()  # [B, T, rank + rope]
        lat_c, k_pe = lat[..., : c.kv_lora_rank], lat[..., c.kv_lora_rank:]
        k_nope = torch.einsum("btr,hnr->bhtn", lat_c, a.w_uk.float())
        v = torch.einsum("btr,hvr->bhtv", lat_c, a.w_uv.float())
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    def own_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, d]` -> per-position rows `[B, T, H, Dq]`, `[B, T, H, Dv]` (the layout :func:`attend` aligns)."""
        k, v = self.rows(x)
        return k.transpose(1, 2), v.transpose(1, 2)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, d]` -> q `[B, T, H, nope + rope]` with the softmax scale folded in."""
        q_nope, q_pe = self.attn.queries(rms_norm(x, self.input_norm, self.eps))
        return torch.cat([q_nope, q_pe], dim=-1).float() * self.attn.scale

    def finish(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """x `[B, T, d]`, attention context `[B, T, H, v]` -> output feature d `[B, T, d]` (fp32)."""
        a = self.attn
        ctx = ctx.flatten(2)
        if a.w_gate is not None:
            ctx = ctx * torch.sigmoid(F.linear(rms_norm(x, self.input_norm, self.eps), a.w_gate).float())
        y = x + F.linear(ctx, a.w_o)
        return y + self.mlp.partial(rms_norm(y, self.post_norm, self.eps))

    def logits(self, d: torch.Tensor) -> torch.Tensor:
        """Output feature `[..., d]` -> logits fp32 `[..., V]` through the target's head."""
        return F.linear(rms_norm(d, self.head_norm, self.eps), self.lm_head).float()

    # -------------------------------------------------------------------------------------- training
    def unroll(self, tokens: torch.Tensor, g: torch.Tensor, steps: int) -> Unrolled:
        """Training-time test over whole windows.

        tokens `[B, T]`: position p's next token (x_{p+1}); g `[B, T, d]`: fused target features at p.
        Step j's logits at p (anchor a = p - j + 1) predict x_{p+2}; queries see the rows in attention.py.
        """
        t, win = tokens.shape[1], self.cfg.window
        x = self.block_input(tokens, g)
        k1, v1 = self.rows(x)
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        for j in range(1, steps + 1):
            if j > 1:
                x = self.block_input(tokens, shift_right(d, 1))
                k, v = self.own_rows(x)
                own_k.append(k)
                own_v.append(v)
            # own row of step i (i = 2..j) for query p sits at p - (j - i) in step i's rows
            ks = [shift_right(k, j - i) for i, k in enumerate(own_k, start=2)]
            vs = [shift_right(v, j - i) for i, v in enumerate(own_v, start=2)]
            ctx = attend(self.query(x), k1, v1, teacher_mask(t, win, j, x.device), ks, vs)
            d = self.finish(x, ctx)
            out.append(self.logits(d))
        return Unrolled(out)

    # --------------------------------------------------------------------------------------- serving
    @torch.inference_mode()
    def draft(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor, k: int,
              choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain-draft k tokens for B requests from their windows (greedy unless `choose` picks otherwise).

        tokens `[B, W]` int64, feats `[B, W, d]` fp32: the last W committed (next token, fused feature) pairs,
        right-aligned (index W-1 is the anchor, the last committed position); counts `[B]`: valid pairs (the
        last counts[b] entries). choose: logits `[B, V]` -> tokens `[B]` (default argmax; a sampler gives the
        drafts of sampled speculative decoding). Returns (drafts `[B, k]` int64, the logits `[B, k, V]` fp32
        each was chosen from).
        """
        b, win = tokens.shape
        if win != self.cfg.window:
            raise ValueError(f"drafter window is {self.cfg.window} positions, got tokens [{b}, {win}]")
        valid = torch.arange(win, device=tokens.device).unsqueeze(0) >= (win - counts).unsqueeze(1)  # [B, W]
        x_all = self.block_input(tokens, feats)
        k1, v1 = self.rows(x_all)
        x = x_all[:, -1:]
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        drafts, logits = [], []
        for j in range(1, k + 1):
            if j > 1:
                x = self.block_input(drafts[-1].unsqueeze(1), d)
                kj, vj = self.own_rows(x)
                own_k.append(kj)
                own_v.append(vj)
            mask = (valid & (torch.arange(win, device=tokens.device) >= j - 1)).unsqueeze(1)  # [B, 1, W]
            d = self.finish(x, attend(self.query(x), k1, v1, mask, own_k, own_v))
            lg = self.logits(d[:, 0])
            drafts.append((lg.argmax(-1) if choose is None else choose(lg)).long())
            logits.append(lg)
        return torch.stack(drafts, 1), torch.stack(logits, 1)
