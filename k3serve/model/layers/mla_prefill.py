"""Decompressed MLA prefill attention of one request (default numerics mode): the chunk's queries against the
cached prefix and the chunk itself.

Two forms, same result to fp32 rounding:

* :func:`attend_flash_cpu`: torch's blocked flash-attention CPU kernel (online softmax over key blocks; never
  materialises ``T x L`` scores, all intra-op threads). The kernel's causal mask is aligned top-left (query i
  sees keys 0..i), so the keys are split where the mask changes and the two partial results are merged by
  their log-sum-exps::

      keys:     0 .............. start-1 | start ........ start+T-1
      query i:  all visible (no mask)      causal: key start+j visible iff j <= i   (top-left, T x T)

      out = (o_prefix * exp(lse_prefix - m) + o_chunk * exp(lse_chunk - m)) / (exp(lse_prefix - m) + ...)

  The kernel wants one head size for q, k and v; NoPE MLA has ``nope + rope`` for q/k and ``v_head_dim`` for v,
  so v is zero-padded to the q/k size (the padded output columns are exactly 0 and dropped). Its log-sum-exp
  output is not differentiable, so this form is for inference only.
* :func:`attend_blocked`: query blocks over explicit fp32 scores (bounded to ``_SCORE_BUDGET`` elements), mask
  only on each block's trailing square; autograd-safe, any device.

On CUDA the analogue of the flash form is a flash prefill kernel over the same two key ranges (or one kernel
with a bottom-right causal mask); no Triton kernel exists for it yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Most fp32 score elements one query block of the blocked form materialises: 2^22 = 16 MiB, small enough to
# stay near the caches, large enough that the per-block Python overhead is negligible.
_SCORE_BUDGET = 1 << 22
_MIN_QUERY_BLOCK = 16


def decompress_padded(rows: torch.Tensor, w_kv_b: torch.Tensor, heads: int, nope: int, rank: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached rows `[L, rank + rope]` (fp32) and ``kv_b_proj`` `[H * (nope + v), rank]` -> keys `[L, H, D]`
    = [c W_UK_h^T | k_pe] and values `[L, H, D]` = [c W_UV_h^T | 0], D = nope + rope, as two views of one
    buffer written by one GEMM (no concatenation or padding pass)::

        buffer [L, H, 2D], per head:  | nope: c W_UK_h^T | rope: k_pe (copied) | v: c W_UV_h^T | D - v: 0 |
                                      '---------- keys [.., :D] -------------' '---- values [.., D:] ---'

    The GEMM's weight is kv_b_proj with zero rows at the rope and padding columns (built per call: H * 2D x rank
    floats, negligible next to the L-row GEMM), so those output columns are exactly 0 before k_pe lands."""
    length, rope = rows.shape[0], rows.shape[1] - rank
    d = nope + rope
    w = w_kv_b.float().view(heads, -1, rank)  # [H, nope + v, rank]
    v_dim = w.shape[1] - nope
    w_pad = w.new_zeros(heads, 2 * d, rank)
    w_pad[:, :nope] = w[:, :nope]
    w_pad[:, d: d + v_dim] = w[:, nope:]
    buf = torch.mm(rows[:, :rank], w_pad.view(-1, rank).t()).view(length, heads, 2 * d)
    buf[:, :, nope:d] = rows[:, None, rank:]
    return buf[..., :d], buf[..., d:]


def attend_flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                     v_dim: int) -> torch.Tensor:
    """q `[T, H, D]` for positions start..start+T-1; k `[start + T, H, D]`, v `[start + T, H, D]` (v
    zero-padded past ``v_dim``) -> `[T, H, v_dim]` fp32. Causal inside the chunk, the prefix fully visible."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    t = q.shape[0]
    q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))  # [1, H, n, D] views of [1, n, H, D]
    if start == 0:
        out = flash(q4, k4, v4, 0.0, True, scale=scale)[0]
    else:
        o_p, lse_p = flash(q4, k4[:, :, :start], v4[:, :, :start], 0.0, False, scale=scale)[:2]
        o_c, lse_c = flash(q4, k4[:, :, start: start + t], v4[:, :, start: start + t], 0.0, True, scale=scale)[:2]
        out = _merge(o_p, lse_p, o_c, lse_c)  # [1, H, T, D]
    return out[0, :, :, :v_dim].transpose(0, 1)  # [T, H, v_dim]


def absorbed_is_cheaper(t: int, nope: int, rope: int, rank: int) -> bool:
    """Whether a chunk of ``t`` queries runs the absorbed form (:func:`attend_absorbed_flash_cpu`) rather than
    decompressing the keys and values. Multiply-adds per key and head: absorbed ``2 t (rank + rope)``,
    decompressed ``2 t (nope + rope)`` + ``2 (nope + rope) rank`` (the padded decompression GEMM), so by FLOPs
    absorbed wins below ``t = (nope + rope) rank / (rank - nope)`` (96 on the tiny preset). It also skips the
    decompression's writes and gives the flash kernel ``t * H`` query rows per key block instead of ``t``:
    in time the crossover sits near 3x the FLOP bound (tiny preset, 8192-token prefix), so the bound is scaled
    by 3."""
    return rank <= nope or t * (rank - nope) < 3 * (nope + rope) * rank


def attend_absorbed_flash_cpu(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, w_uk: torch.Tensor,
                              w_uv: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Absorbed form for short chunks: q_nope `[T, H, nope]`, q_pe `[T, H, rope]`, cached rows `[start + T, rank
    + rope]` (fp32), W_UK `[H, nope, rank]`, W_UV `[H, v, rank]` -> `[T, H, v]` fp32.

    Scores ``[q_nope W_UK_h | q_pe] . [c | k_pe]``: every head attends to the same rows (MQA in latent space),
    so nothing is decompressed and the rows serve as keys and as values (the output's rope columns are
    dropped, the latent context is mapped out by W_UV afterwards). Over the prefix (no mask) the heads fold
    into the query rows, one flash call of ``T * H`` queries; over the chunk (causal) heads are the kernel's
    head dim over one stride-0 key tensor::

        prefix:  q [1, 1, T*H, rank+rope] (row t*H + h)  vs  rows[:start]      -> o [T, H, rank+rope], lse [T, H]
        chunk:   q [1, H, T, rank+rope]                  vs  rows[start:] x H  -> causal, merged by lse
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    t, heads = q_nope.shape[:2]
    rank = w_uk.shape[-1]
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()), q_pe.float()], dim=-1)
    d = q.shape[-1]  # rank + rope
    kc = rows[None, None, start: start + t].expand(1, heads, t, d)
    o_c, lse_c = flash(q.unsqueeze(0).transpose(1, 2), kc, kc, 0.0, True, scale=scale)[:2]
    o_c, lse_c = o_c[0].transpose(0, 1), lse_c[0].transpose(0, 1)  # [T, H, d], [T, H]
    if start == 0:
        ctx = o_c[..., :rank]
    else:
        kp = rows[None, None, :start]
        o_p, lse_p = flash(q.view(1, 1, t * heads, d), kp, kp, 0.0, False, scale=scale)[:2]
        ctx = _merge(o_p.view(t, heads, d), lse_p.view(t, heads), o_c, lse_c)[..., :rank]
    return torch.einsum("thr,hvr->thv", ctx, w_uv.float())


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of two attention partials over disjoint key sets: o `[..., D]`, lse `[...]`."""
    m = torch.maximum(lse_a, lse_b)
    w_a = (lse_a - m).exp_().unsqueeze(-1)
    w_b = (lse_b - m).exp_().unsqueeze(-1)
    return (o_a * w_a).add_(o_b * w_b).div_(w_a + w_b)


def attend_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q `[H, T, D]` (scale folded in) for positions start..start+T-1; k `[H, start + T, D]`, v `[H, start + T,
    Dv]` -> `[H, T, Dv]`.

    Queries run in blocks of ``bq`` rows so the fp32 scores never exceed ``_SCORE_BUDGET`` elements. Block
    [a, b) sees keys 0 .. start+b-1; only its trailing bq x bq square needs the causal mask, and keys past
    start+b-1 are never touched (half the chunk's causal work is skipped)::

        keys:   0 ........ start-1 | start ... start+a-1 | start+a ... start+b-1 | (not read)
        row i:  visible              visible               visible iff j' <= i
    """
    heads, t = q.shape[:2]
    bq = max(_MIN_QUERY_BLOCK, _SCORE_BUDGET // (heads * (start + t)))
    if bq >= t:
        return _attend_block(q, k, v, start, t)
    out = q.new_empty(heads, t, v.shape[-1])
    for a in range(0, t, bq):
        e = min(t, a + bq)
        out[:, a:e] = _attend_block(q[:, a:e], k[:, : start + e], v[:, : start + e], start + a, e - a)
    return out


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """q `[H, n, Dq]` (scale folded in) for positions first .. first+n-1; k `[H, first+n, Dq]`,
    v `[H, first+n, Dv]` -> `[H, n, Dv]`. Keys first .. first+n-1 are causally masked."""
    scores = torch.bmm(q, k.transpose(1, 2))  # [H, n, first + n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)  # key j > query i
    scores[:, :, first:].masked_fill_(causal, float("-inf"))
    return torch.bmm(scores.softmax(-1), v)
