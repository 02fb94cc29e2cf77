"""Triton paged MLA decode (absorbed form; math in ``mla_decode.py``), split over the context. Imported lazily.

A decode step has one query token per request, so one program per (request, head block) gives a 132-SM GPU
only B * cdiv(H, BH) programs, each walking its whole context alone, far below the copy bandwidth (docs/cuda.md).
So the context is split
(flash-decoding): each program takes one span of ``tokens_per_split`` tokens of one request and one head
block, and a second kernel merges the spans' partial softmaxes.

    request b's tokens:   0 ........................................... L_b   (block_table width * PS bound)
    splits:               | split 0  | split 1  | split 2  | ... | split S-1 |   tokens_per_split each
    program (b, hb, s):   walks split s in blocks of BN tokens; token t lives at
                          kv_pages[block_table[b, t // PS], t % PS]   (any page size: BN need not divide PS)
    partials:             m, l [B, S, H] (running max, normaliser), acc [B, S, H, Dl] (unnormalised context)
    merge (b, h):         M = max_s m_s;  out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s

A span past a request's length (or a request of length 0) leaves m = -inf, l = 0, acc = 0: it weighs 0 in the
merge, and a request with no tokens at all gets zeros. With one split the first kernel normalises and writes the
output itself. The split count needs no host copy of the lengths (no device sync): it comes from the block
table's width, the bound on every request's length.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BH = 16  # heads per program; tl.dot needs every dimension >= 16 (fewer heads are masked)
BN = 16  # tokens per inner block: the [BN, Dl] page tile (Dl = 512: 32 KiB fp32) stays in registers
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # enough programs in flight per multiprocessor to cover the page loads' latency


@triton.jit
def _mla_decode_split_kernel(
    ql_ptr, qpe_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    s_qlb, s_qlh, s_qld, s_qpb, s_qph, s_qpd,
    s_kvp, s_kvt, s_kvd, s_btb, s_btp,
    H, Dl, R, PS, scale, tokens_per_split, num_splits,
    BH: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
):
    i_b = tl.program_id(0)
    oh = tl.program_id(1) * BH + tl.arange(0, BH)
    i_s = tl.program_id(2)
    od = tl.arange(0, BD)
    orr = tl.arange(0, BR)
    on = tl.arange(0, BN)
    mh, md, mr = oh < H, od < Dl, orr < R

    ql = tl.load(ql_ptr + i_b * s_qlb + oh[:, None] * s_qlh + od[None, :] * s_qld,
                 mask=mh[:, None] & md[None, :], other=0.0).to(tl.float32)
    qp = tl.load(qpe_ptr + i_b * s_qpb + oh[:, None] * s_qph + orr[None, :] * s_qpd,
                 mask=mh[:, None] & mr[None, :], other=0.0).to(tl.float32)
    L = tl.load(lens_ptr + i_b).to(tl.int32)
    begin = i_s * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)

    m = tl.full([BH], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    for t0 in range(begin, end, BN):
        t = t0 + on
        mt = t < end
        page = tl.load(bt_ptr + i_b * s_btb + (t // PS) * s_btp, mask=mt, other=0).to(tl.int64)
        rows = kv_ptr + page * s_kvp + (t % PS).to(tl.int64) * s_kvt
        c = tl.load(rows[:, None] + od[None, :] * s_kvd, mask=mt[:, None] & md[None, :], other=0.0).to(tl.float32)
        kpe = tl.load(rows[:, None] + (Dl + orr[None, :]) * s_kvd, mask=mt[:, None] & mr[None, :],
                      other=0.0).to(tl.float32)
        s = tl.dot(ql, tl.trans(c), input_precision="ieee")
        s += tl.dot(qp, tl.trans(kpe), input_precision="ieee")
        s = tl.where(mt[None, :], s * scale, float("-inf"))
        # Every visited block holds >= 1 valid token (t0 < end), so m_new is finite and exp() sees no NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr, c, input_precision="ieee")
        m = m_new

    if SPLIT:
        part = (i_b * num_splits + i_s) * H + oh                # [BH] rows of m, l and acc
        tl.store(m_ptr + part, m, mask=mh)
        tl.store(l_ptr + part, l, mask=mh)
        tl.store(acc_ptr + part[:, None].to(tl.int64) * Dl + od[None, :], acc, mask=mh[:, None] & md[None, :])
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]            # seq_len 0 -> zeros
        p_out = out_ptr + (i_b * H + oh[:, None]).to(tl.int64) * Dl + od[None, :]
        tl.store(p_out, out, mask=mh[:, None] & md[None, :])


@triton.jit
def _mla_decode_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, H, Dl, num_splits,
                             BSP: tl.constexpr, BD: tl.constexpr):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    osp = tl.arange(0, BSP)
    od = tl.arange(0, BD)
    msp, md = osp < num_splits, od < Dl
    part = (i_b * num_splits + osp) * H + i_h                   # [BSP] this head's row in each split
    m = tl.load(m_ptr + part, mask=msp, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=msp, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    acc = tl.load(acc_ptr + part[:, None].to(tl.int64) * Dl + od[None, :], mask=msp[:, None] & md[None, :],
                  other=0.0)
    norm = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(norm > 0, norm, 1.0)   # no tokens at all -> zeros
    tl.store(out_ptr + (i_b * H + i_h).to(tl.int64) * Dl + od, out, mask=md)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_splits(batch: int, heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits of the context so that B * head blocks * splits fills the GPU, each split >= BN tokens."""
    programs = batch * triton.cdiv(heads, BH)
    want = triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(device), max(programs, 1))
    return max(1, min(want, triton.cdiv(max(max_tokens, 1), BN), MAX_SPLITS))


def mla_decode_triton(q_latent, q_pe, kv_pages, block_table, seq_lens, softmax_scale, num_splits=None, *,
                      block_tokens: int = BN, num_warps: int = 4):
    """Triton path.

    Args:
        q_latent: [B, H, Dl]; q_pe: [B, H, R]; kv_pages: [num_pages, page_size, Dl + R]
        (any strides); block_table: [B, max_pages] int; seq_lens: [B] int (each <= max_pages * page_size);
        softmax_scale: float; num_splits: context splits (None: ``choose_splits``);
        block_tokens, num_warps: the launch's tile (a power of two >= 16) and warps (``benchmarks.cuda_sweep``
        measures them).
    Returns:
        ctx_latent: [B, H, Dl] fp32.
    """
    B, H, Dl = q_latent.shape
    R = q_pe.shape[-1]
    PS = kv_pages.shape[1]
    out = torch.empty(B, H, Dl, dtype=torch.float32, device=q_latent.device)
    if B == 0:
        return out
    bound = block_table.shape[1] * PS
    splits = num_splits or choose_splits(B, H, bound, q_latent.device)
    bn = block_tokens
    per_split = triton.cdiv(triton.cdiv(bound, splits), bn) * bn   # a multiple of BN: blocks never straddle
    splits = max(1, triton.cdiv(bound, per_split))
    lens = seq_lens.to(device=q_latent.device, dtype=torch.int32).contiguous()
    BD = triton.next_power_of_2(max(Dl, 16))
    BR = triton.next_power_of_2(max(R, 16))
    part_shape = (B, splits, H) if splits > 1 else (1,)
    m = torch.empty(part_shape, dtype=torch.float32, device=q_latent.device)
    l = torch.empty_like(m)
    acc = torch.empty((*part_shape, Dl) if splits > 1 else (1,), dtype=torch.float32, device=q_latent.device)
    _mla_decode_split_kernel[(B, triton.cdiv(H, BH), splits)](
        q_latent, q_pe, kv_pages, block_table, lens, out, m, l, acc,
        *q_latent.stride(), *q_pe.stride(),
        *kv_pages.stride(), *block_table.stride(),
        H, Dl, R, PS, float(softmax_scale), per_split, splits,
        BH=BH, BD=BD, BR=BR, BN=bn, SPLIT=splits > 1, num_warps=num_warps,
    )
    if splits > 1:
        _mla_decode_merge_kernel[(B, H)](m, l, acc, out, H, Dl, splits,
                                         BSP=triton.next_power_of_2(splits), BD=BD)
    return out
