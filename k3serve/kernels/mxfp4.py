"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 block scales): quantise, the one dequantisation, and the
routed-expert matmul that reads packed weights.

Format (OCP MX v1.0; compressed-tensors ``mxfp4-pack-quantized``), for a weight ``W[out, in]``::

    weight_packed  uint8 [out, in / 2]    two E2M1 codes per byte: element 2i in the LOW nibble, 2i+1 in the HIGH
    weight_scale   uint8 [out, in / 32]   E8M0 per 32 consecutive inputs: 2^(s - 127); s = 0xFF is NaN

    byte j of row o:   bit 7   6 5 4 | 3   2 1 0
                           sign e e m | sign e e m
                           element 2j+1 | element 2j

    E2M1 code c (4 bits): sign = c >> 3; magnitude by c & 7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6   (code 8 is -0)
    value[o, k] = E2M1[code[o, k]] * 2^(scale[o, k // 32] - 127)

Every product of an E2M1 value and an E8M0 power of two is exact in fp32 (2^-127 is an fp32 subnormal), so
:func:`dequantize_mxfp4` is exact and the same in every backend; it is the only dequantisation in k3serve:
serving (the torch matmul below, per row block), PTQ round trips (``checkpoint dequantize``) and QAT fake
quantisation (:func:`fake_quant_mxfp4`) all call it, so training and serving share one arithmetic.

Scale rules (PTQ; recorded in the checkpoint's ``quantization_config`` and docs/mxfp4.md):

* ``ocp``      : 2^(floor(log2(amax)) - 2), the OCP spec's rule (emax of E2M1 is 2). Values above 6 * scale
                 (amax in (6, 8) * 2^k) saturate to +-6 * scale.
* ``round-up`` : 2^ceil(log2(amax / 6)), the smallest power of two that puts amax on or below 6: never clips,
                 costs one bit of resolution on blocks the OCP rule would have clipped.

Elements are x / scale rounded to the nearest E2M1 value, ties to the even code (round-half-even as in the
spec), saturating at +-6; the sign is kept, so a small negative rounds to -0. A block whose amax is 0 gets
scale code 0; a block holding a NaN or inf gets scale 0xFF (NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3serve.kernels._dispatch import resolve_backend
from k3serve.kernels.mxfp4_format import GROUP, check_packed

E2M1_EMAX = 2  # exponent of the largest E2M1 value (6 = 1.5 * 2^2)
SCALE_BIAS = 127
SCALE_NAN = 0xFF
SCALE_RULES = ("ocp", "round-up")
# magnitudes of codes 0..7
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# rounding thresholds between code i and i + 1, and whether a tie goes up (to the even code i + 1)
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
# scratch budget of the CPU matmul: at most this many dequantised weights exist at a time
SCRATCH_ELEMS = 1 << 16


def _e2m1_table() -> torch.Tensor:
    """fp32 [16]: value of each code (8..15 negative; code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def _pair_table() -> torch.Tensor:
    """fp32 [256, 2]: (value of the low nibble, value of the high nibble) of every byte."""
    t = _e2m1_table()
    b = torch.arange(256)
    return torch.stack([t[b & 15], t[b >> 4]], dim=1)


def _scale_table() -> torch.Tensor:
    """fp32 [256]: 2^(s - 127) for s < 255 (s = 0 is the subnormal 2^-127), NaN at 255."""
    vals = [2.0 ** (s - SCALE_BIAS) for s in range(255)] + [float("nan")]
    return torch.tensor(vals, dtype=torch.float32)


# Lookup tables, built once (constants). A byte's two values are one machine word (2 x fp32 = int64,
# 2 x bf16 = int32), so a single 1-D index_select of words per byte unpacks both nibbles (the fastest gather torch
# has on CPU). bf16 holds every E2M1 x E8M0 product exactly too (same exponent range as fp32, subnormals
# included); other dtypes go through fp32.
_WORD = {torch.float32: torch.int64, torch.bfloat16: torch.int32}
_TABLES = {dt: (_pair_table().to(dt).contiguous().view(_WORD[dt]).view(-1), _scale_table().to(dt))
           for dt in _WORD}


_FP32_WORDS = _TABLES[torch.float32][0]


def _tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(pair words [256], scale table [256], their value dtype) for outputs of `dtype` on `device`."""
    table_dtype = dtype if dtype in _TABLES else torch.float32
    pairs, scales = _TABLES[table_dtype]
    if device.type != "cpu":
        pairs, scales = pairs.to(device), scales.to(device)
    return pairs, scales, table_dtype


# ---------------------------------------------------------------------------------------------- dequantise
def scale_values(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 codes uint8 `[..., G]` -> their values 2^(s - 127) `[..., G, 1]` (NaN for 0xFF; the trailing 1
    broadcasts over a group's 32 inputs) in fp32 or bf16 (both exact; other dtypes get fp32). The CPU matmul
    keeps these per weight (4 bytes per 32 inputs in fp32)."""
    _, stab, _ = _tables(scales.device, dtype)
    return stab.index_select(0, scales.reshape(-1).int()).view(*scales.shape, 1)


def _decode(flat: torch.Tensor, svals: torch.Tensor, words: torch.Tensor, groups: tuple[int, int, int]) -> torch.Tensor:
    """The decode arithmetic, once: flat packed uint8 `[R * K/2]`, svals `[R, K/32, 1]`, `words` the pair table of
    svals' dtype, groups = (R, K/32, 32) -> `[R, K/32, 32]`: one gather per byte, one in-place multiply per 32."""
    return words.index_select(0, flat.int()).view(svals.dtype).view(groups).mul_(svals)


def decode_rows(packed: torch.Tensor, svals: torch.Tensor) -> torch.Tensor:
    """The arithmetic of :func:`dequantize_mxfp4` on rows: packed uint8 `[R, K/2]`, svals `[R, K/32, 1]` (from
    :func:`scale_values`, fp32 or bf16) -> `[R, K]` in svals' dtype. One gather per byte (byte -> its two E2M1
    values as one machine word), one in-place multiply per 32-wide group; exact."""
    r, k = packed.shape[0], packed.shape[-1] * 2
    words = _TABLES[svals.dtype][0]
    if packed.device.type != "cpu":
        words = words.to(packed.device)
    return _decode(packed.reshape(-1), svals, words, (r, k // GROUP, GROUP)).view(r, k)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The one MXFP4 dequantisation: packed uint8 `[..., K/2]`, scales uint8 `[..., K/32]` -> `[..., K]` in `dtype`.

    Two table lookups (byte -> its two E2M1 values as one word; scale code -> 2^(s-127)) and one multiply, all
    exact in fp32 and in bf16 (computed in fp32 and cast for other dtypes). :func:`decode_rows` is its
    arithmetic, called by the CPU matmul with the scale values it keeps.
    """
    k = check_packed(packed, scales)
    lead = packed.shape[:-1]
    svals = scale_values(scales, dtype)
    out = decode_rows(packed.reshape(-1, k // 2), svals.reshape(-1, k // GROUP, 1)).view(*lead, k)
    return out if out.dtype == dtype else out.to(dtype)


# ------------------------------------------------------------------------------------------------ quantise
def _scale_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Unbiased E8M0 exponent per block from amax > 0 (fp32), clamped to the E8M0 range [-127, 127]."""
    if rule == "ocp":
        e = torch.floor(torch.log2(amax)) - E2M1_EMAX
    elif rule == "round-up":
        e = torch.ceil(torch.log2(amax / 6.0))
    else:
        raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    return e.clamp(-SCALE_BIAS, SCALE_BIAS)


def quantize_mxfp4(w: torch.Tensor, rule: str = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    """w `[..., K]` (any float dtype, K % 32 == 0) -> (packed uint8 `[..., K/2]`, scales uint8 `[..., K/32]`).

    See the module docstring for the rounding and the scale rules. Values on the E2M1 x E8M0 grid come back
    exactly through :func:`dequantize_mxfp4`.
    """
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {w.shape[-1]}")
    x = w.detach().float()
    lead, k = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, k // GROUP, GROUP)
    amax = blocks.abs().amax(-1)  # NaN propagates
    bad = ~torch.isfinite(amax)
    zero = amax == 0
    e = _scale_exponent(torch.where(bad | zero, torch.ones_like(amax), amax), rule)
    scale_code = (e + SCALE_BIAS).to(torch.uint8)
    scale_code = torch.where(zero, torch.zeros_like(scale_code), scale_code)
    scale_code = torch.where(bad, torch.full_like(scale_code, SCALE_NAN), scale_code)
    # x / 2^e is exact for normal results; a subnormal quotient is below 0.25 and rounds to 0 either way
    a = (blocks.abs() * torch.exp2(-e).unsqueeze(-1)).nan_to_num(0.0, 0.0, 0.0)
    code = torch.zeros(a.shape, dtype=torch.uint8)
    for t, up in zip(_THRESHOLDS, _TIE_UP):
        code += (a >= t) if up else (a > t)  # 7 comparisons: the code is the count of thresholds passed
    code = code | (torch.signbit(blocks).to(torch.uint8) << 3)
    code = torch.where(bad.unsqueeze(-1), torch.zeros_like(code), code).reshape(*lead, k)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), scale_code.contiguous()


def fake_quant_mxfp4(w: torch.Tensor, rule: str = "ocp") -> torch.Tensor:
    """QAT fake quantisation with a straight-through estimator: the forward value is exactly
    ``dequantize_mxfp4(*quantize_mxfp4(w, rule), w.dtype)`` (the serving weights), the gradient passes to `w`
    unchanged. w `[..., K]`."""
    q = dequantize_mxfp4(*quantize_mxfp4(w, rule), dtype=w.dtype)
    return w + (q - w).detach()


# -------------------------------------------------------------------------------------------------- matmul
def mxfp4_linear_torch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       svals: torch.Tensor | None = None) -> torch.Tensor:
    """CPU path: ``x @ W^T`` with W dequantised one block of rows at a time into a scratch of at most
    :data:`SCRATCH_ELEMS` values (never the whole expert set, nor a large matrix at once).

    The math is fp32 whatever x's dtype (exact weights, fp32 products and sums; the result is cast to x's dtype
    once): torch's CPU fp32 GEMM/GEMV is several times faster than its bf16 one, which pays for the dequant.
    x `[N, K]`; packed uint8 `[O, K/2]`; scales uint8 `[O, K/32]`; svals: ``scale_values(scales)``, fp32
    `[O, K/32, 1]`, when the caller keeps them (:class:`~k3serve.model.layers.expert_weights.MXFP4Linear`
    does) -> `[N, O]` in x's dtype.
    """
    check_packed(packed, scales)
    return linear_rows(x, packed, scale_values(scales) if svals is None else svals)


def linear_rows(x: torch.Tensor, packed: torch.Tensor, svals: torch.Tensor) -> torch.Tensor:
    """:func:`mxfp4_linear_torch` without the checks (the caller validated the pair once): x `[N, K]`, packed
    uint8 `[O, K/2]`, svals fp32 `[O, K/32, 1]` -> `[N, O]` in x's dtype."""
    o, k = packed.shape[0], packed.shape[-1] * 2
    xf = x.float()
    if o * k <= SCRATCH_ELEMS:
        return F.linear(xf, decode_rows(packed, svals)).to(x.dtype)
    rows = max(1, SCRATCH_ELEMS // k)
    out = torch.empty(*x.shape[:-1], o, dtype=x.dtype, device=x.device)
    for r0 in range(0, o, rows):
        r1 = min(o, r0 + rows)
        out[..., r0:r1] = F.linear(xf, decode_rows(packed[r0:r1], svals[r0:r1]))
    return out


class CpuMatrix:
    """A packed pair prepared once for the CPU matmul of a decode step: validated, its scale values decoded
    (fp32 `[O, K/32, 1]`, 4 bytes per 32 inputs) and its views made at load, so a call is the 6 torch ops
    (x to fp32, bytes to int32, gather, scale multiply, GEMM, cast back) and little Python: a decode step makes
    ~50 such calls on small matrices, where each op costs more than its arithmetic. Matrices above
    :data:`SCRATCH_ELEMS` go through :func:`linear_rows` (row blocks)."""

    __slots__ = ("packed", "svals", "_flat", "_groups", "_shape", "_k", "_whole")

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """packed uint8 `[O, K/2]`, scales uint8 `[O, K/32]`, on the CPU."""
        k = check_packed(packed, scales)
        if packed.dim() != 2 or packed.device.type != "cpu":
            raise ValueError(f"CpuMatrix takes one CPU matrix, got {list(packed.shape)} on {packed.device}")
        o = packed.shape[0]
        self.packed, self.svals = packed, scale_values(scales)
        self._flat, self._groups, self._shape, self._k = packed.reshape(-1), (o, k // GROUP, GROUP), (o, k), k
        self._whole = o * k <= SCRATCH_ELEMS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, K]` -> `[N, O]` in x's dtype (fp32 math)."""
        if x.shape[-1] != self._k:
            raise ValueError(f"x has {x.shape[-1]} inputs, the packed weight {self._k}")
        if not self._whole:
            return linear_rows(x, self.packed, self.svals)
        w = _decode(self._flat, self.svals, _FP32_WORDS, self._groups).view(self._shape)
        return F.linear(x.float(), w).to(x.dtype)


def mxfp4_linear_blocks(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        svals: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mxfp4_linear_torch` with the matmul supplied: ``linear(x_fp32, W_block_fp32)`` per block of
    weight rows (the same blocks). Numerics mode deterministic passes its fixed-row-tile GEMM here.
    x `[N, K]`; svals as in :func:`mxfp4_linear_torch` -> `[N, O]` in x's dtype."""
    k = check_packed(packed, scales)
    svals = scale_values(scales) if svals is None else svals
    o = packed.shape[0]
    rows = max(1, SCRATCH_ELEMS // k)
    xf = x.float()
    parts = [linear(xf, decode_rows(packed[r0:min(o, r0 + rows)], svals[r0:min(o, r0 + rows)]))
             for r0 in range(0, o, rows)]
    return torch.cat(parts, dim=-1).to(x.dtype)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
                 backend: str | None = None) -> torch.Tensor:
    """Routed-expert matmul reading packed MXFP4 weights: x `[N, K]` -> `[N, O]` in x's dtype.

    packed uint8 `[O, K/2]`, scales uint8 `[O, K/32]` (a ``weight_packed`` / ``weight_scale`` pair).
    backend: "naive" (element loops, the oracle), "torch" (row-block scratch), "triton" (dequantises in
    registers); default by device (see :mod:`k3serve.kernels._dispatch`).
    """
    if x.shape[-1] != packed.shape[-1] * 2:
        raise ValueError(f"x has {x.shape[-1]} inputs, the packed weight {packed.shape[-1] * 2}")
    choice = resolve_backend(backend, x.device)
    if choice == "naive":
        from k3serve.kernels.mxfp4_naive import mxfp4_linear_naive

        return mxfp4_linear_naive(x, packed, scales)
    if choice == "triton":
        from k3serve.kernels.mxfp4_triton import mxfp4_linear_triton

        return mxfp4_linear_triton(x, packed, scales)
    return mxfp4_linear_torch(x, packed, scales)
