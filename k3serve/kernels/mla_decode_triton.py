"""Triton paged MLA decode (absorbed form; math in ``mla_decode.py``). Imported lazily.

One program per (request b, block of BH heads): all heads of a request share the same
latent KV rows, so a head block reuses each loaded page tile. The program walks the
request's pages with an online softmax (running max m, normaliser l, accumulator acc).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_decode_kernel(
    ql_ptr, qpe_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr,
    s_qlb, s_qlh, s_qld, s_qpb, s_qph, s_qpd,
    s_kvp, s_kvt, s_kvd, s_btb, s_btp,
    H, Dl, R, PS, scale,
    BH: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
):
    i_b = tl.program_id(0)
    oh = tl.program_id(1) * BH + tl.arange(0, BH)
    od = tl.arange(0, BD)
    orr = tl.arange(0, BR)
    os_ = tl.arange(0, BS)
    mh, md, mr = oh < H, od < Dl, orr < R

    ql = tl.load(ql_ptr + i_b * s_qlb + oh[:, None] * s_qlh + od[None, :] * s_qld,
                 mask=mh[:, None] & md[None, :], other=0.0).to(tl.float32)
    qp = tl.load(qpe_ptr + i_b * s_qpb + oh[:, None] * s_qph + orr[None, :] * s_qpd,
                 mask=mh[:, None] & mr[None, :], other=0.0).to(tl.float32)
    L = tl.load(lens_ptr + i_b).to(tl.int32)

    m = tl.full([BH], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    for p in range(0, tl.cdiv(L, PS)):
        page = tl.load(bt_ptr + i_b * s_btb + p * s_btp).to(tl.int64)
        mt = (os_ < PS) & (p * PS + os_ < L)
        rows = kv_ptr + page * s_kvp + os_[:, None].to(tl.int64) * s_kvt
        c = tl.load(rows + od[None, :] * s_kvd, mask=mt[:, None] & md[None, :], other=0.0).to(tl.float32)
        kpe = tl.load(rows + (Dl + orr[None, :]) * s_kvd, mask=mt[:, None] & mr[None, :],
                      other=0.0).to(tl.float32)
        s = tl.dot(ql, tl.trans(c), input_precision="ieee")
        s += tl.dot(qp, tl.trans(kpe), input_precision="ieee")
        s = tl.where(mt[None, :], s * scale, float("-inf"))
        # Every visited page holds >= 1 valid token, so m_new is finite and exp() sees no NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr, c, input_precision="ieee")
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]      # seq_len 0 -> zeros
    p_out = out_ptr + (i_b * H + oh[:, None]).to(tl.int64) * Dl + od[None, :]
    tl.store(p_out, out, mask=mh[:, None] & md[None, :])


def mla_decode_triton(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale):
    """Triton path.

    Args:
        q_latent: [B, H, Dl]; q_pe: [B, H, R]; kv_pages: [num_pages, page_size, Dl + R]
        (any strides); block_table: [B, max_pages] int; seq_lens: [B] int;
        softmax_scale: float.
    Returns:
        ctx_latent: [B, H, Dl] fp32.
    """
    B, H, Dl = q_latent.shape
    R = q_pe.shape[-1]
    PS = kv_pages.shape[1]
    out = torch.empty(B, H, Dl, dtype=torch.float32, device=q_latent.device)
    if B == 0:
        return out
    lens = seq_lens.to(device=q_latent.device, dtype=torch.int32).contiguous()
    # tl.dot needs every dimension >= 16: pad head, page and feature blocks with masks.
    # 16 heads per program keeps acc [BH, Dl] (8K fp32 at Dl = 512) within registers.
    BH = 16
    BD = triton.next_power_of_2(max(Dl, 16))
    BR = triton.next_power_of_2(max(R, 16))
    BS = triton.next_power_of_2(max(PS, 16))
    grid = (B, triton.cdiv(H, BH))
    _mla_decode_kernel[grid](
        q_latent, q_pe, kv_pages, block_table, lens, out,
        *q_latent.stride(), *q_pe.stride(),
        *kv_pages.stride(), *block_table.stride(),
        H, Dl, R, PS, float(softmax_scale),
        BH=BH, BD=BD, BR=BR, BS=BS,
    )
    return out
