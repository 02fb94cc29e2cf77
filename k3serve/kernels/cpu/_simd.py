"""Explicit 16-lane fp32 vectors for numba kernels (``kda_cpu``): a numba type backed by LLVM's <16 x float>.

Why not leave vectorisation to LLVM: numba runs LLVM's loop vectoriser but not its SLP vectoriser, so an
auto-vectorised ``acc[e] += w * s[e]`` keeps its accumulators in memory (a load and a store per FMA) and the
small matrices of a KDA chunk ran at a fraction of the core's FMA rate. With values of this type as local
variables, a tile of 8 rows x 32 columns lives in 16 registers across the whole reduction loop (LLVM lowers
<16 x float> to one zmm register on AVX-512, to two ymm or four xmm registers on narrower CPUs, with the same
results).

Numerics: every operation is lane-wise and exact IEEE fp32 (``vfma`` / ``vfnma`` are ``llvm.fma``: one
rounding, the same bits on any x86-64 whatever the vector width); ``vexp`` is a fixed polynomial (Cephes
``expf``: within ~1 ulp of the exact exp over [-87, 88], tests/kernels/test_kda_cpu.py), so a value's bits
depend only on its inputs, never on its lane or on the machine's vector width.

Every ``vload`` / ``vstore`` reads / writes 16 consecutive fp32 elements ``arr[i, j:j + 16]`` of a 2-D
C-contiguous array without bounds checks: callers keep ``j + 16 <= arr.shape[1]``.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel import models
from numba.extending import intrinsic, register_model

LANES = 16
_F32, _F64, _I32 = ir.FloatType(), ir.DoubleType(), ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)
_VD = ir.VectorType(_F64, LANES)
_VI = ir.VectorType(_I32, LANES)


class F32x16(types.Type):
    def __init__(self):
        super().__init__(name="f32x16")


f32x16 = F32x16()


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


def _vptr(context, builder, aryty, ary, i, j, elem):
    """Pointer to arr[i, j] viewed as a pointer to <16 x elem>."""
    a = context.make_array(aryty)(context, builder, ary)
    p = cgutils.get_item_pointer(context, builder, aryty, a, [i, j], wraparound=False)
    return builder.bitcast(p, ir.PointerType(ir.VectorType(elem, LANES)))


def _splat(builder, x, vt):
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(_VI, [0] * LANES))


def _vconst(x):
    return ir.Constant(_VF, [x] * LANES)


def _call(builder, name, args):
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(args[0].type, [a.type for a in args]), name)
    return builder.call(fn, args)


def _fma(builder, a, b, c):
    return _call(builder, f"llvm.fma.v{LANES}f32", [a, b, c])


# ---- loads and stores (2-D C-contiguous arrays, 16 consecutive elements of a row) ----


@intrinsic
def vload(typingctx, arr, i, j):
    """arr[i, j:j + 16] of an fp32 2-D array."""
    def codegen(context, builder, sig, args):
        return builder.load(_vptr(context, builder, sig.args[0], args[0], args[1], args[2], _F32), align=4)
    return f32x16(arr, i, j), codegen


@intrinsic
def vloadd(typingctx, arr, i, j):
    """fp32(arr[i, j:j + 16]) of an fp64 2-D array (one rounding per lane)."""
    def codegen(context, builder, sig, args):
        a = builder.load(_vptr(context, builder, sig.args[0], args[0], args[1], args[2], _F64), align=8)
        return builder.fptrunc(a, _VF)
    return f32x16(arr, i, j), codegen


@intrinsic
def vdiff(typingctx, arr, i, j, i2):
    """fp32(arr[i, j:j + 16] - arr[i2, j:j + 16]) of an fp64 2-D array: the difference in fp64, rounded once."""
    def codegen(context, builder, sig, args):
        a = builder.load(_vptr(context, builder, sig.args[0], args[0], args[1], args[2], _F64), align=8)
        b = builder.load(_vptr(context, builder, sig.args[0], args[0], args[3], args[2], _F64), align=8)
        return builder.fptrunc(builder.fsub(a, b), _VF)
    return f32x16(arr, i, j, i2), codegen


@intrinsic
def vstore(typingctx, arr, i, j, v):
    """arr[i, j:j + 16] = v (fp32 2-D array)."""
    def codegen(context, builder, sig, args):
        builder.store(args[3], _vptr(context, builder, sig.args[0], args[0], args[1], args[2], _F32), align=4)
        return context.get_dummy_value()
    return types.none(arr, i, j, v), codegen


@intrinsic
def vcum(typingctx, G, i, ip, first, src, row, j):
    """G[i, j:j + 16] = (0 if first else G[ip, j:j + 16]) + fp64(src[row, j:j + 16]): one step of the fp64
    cumulative sum of an fp32 source row (G fp64 2-D, src fp32 2-D)."""
    def codegen(context, builder, sig, args):
        G, i, ip, first, src, row, j = args
        prev = builder.load(_vptr(context, builder, sig.args[0], G, ip, j, _F64), align=8)
        prev = builder.select(first, ir.Constant(_VD, [0.0] * LANES), prev)
        x = builder.fpext(builder.load(_vptr(context, builder, sig.args[4], src, row, j, _F32), align=4), _VD)
        builder.store(builder.fadd(prev, x), _vptr(context, builder, sig.args[0], G, i, j, _F64), align=8)
        return context.get_dummy_value()
    return types.none(G, i, ip, types.boolean, src, row, j), codegen


_ZIP_LO = ir.Constant(_VI, [x for i in range(LANES // 2) for x in (i, LANES + i)])
_ZIP_HI = ir.Constant(_VI, [x for i in range(LANES // 2, LANES) for x in (i, LANES + i)])


@intrinsic
def vtranspose(typingctx, src, r0, c0, dst, r1, c1):
    """dst[r1 + a, c1 + b] = src[r0 + b, c0 + a] for a, b < 16 (a 16 x 16 block of fp32 2-D arrays, transposed in
    registers: 4 rounds of zipping vector k with vector k + 8, 64 two-source shuffles instead of 256 scalar
    stores)."""
    def codegen(context, builder, sig, args):
        src, r0, c0, dst, r1, c1 = args
        rows = [builder.load(_vptr(context, builder, sig.args[0], src, builder.add(r0, ir.Constant(r0.type, i)),
                                   c0, _F32), align=4) for i in range(LANES)]
        for _ in range(4):   # log2(16) rounds; after them vector j holds column j
            half = LANES // 2
            rows = [builder.shuffle_vector(rows[k], rows[k + half], z) for k in range(half) for z in (_ZIP_LO, _ZIP_HI)]
        for j, vec in enumerate(rows):
            builder.store(vec, _vptr(context, builder, sig.args[3], dst, builder.add(r1, ir.Constant(r1.type, j)),
                                     c1, _F32), align=4)
        return context.get_dummy_value()
    return types.none(src, r0, c0, dst, r1, c1), codegen


# ---- lane-wise arithmetic ----


@intrinsic
def vsplat(typingctx, x):
    """All 16 lanes = x (cast to fp32)."""
    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.float32)
        return _splat(builder, x, _VF)
    return f32x16(x), codegen


@intrinsic
def vzero(typingctx):
    """All 16 lanes +0."""
    def codegen(context, builder, sig, args):
        return _vconst(0.0)
    return f32x16(), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c with one rounding."""
    def codegen(context, builder, sig, args):
        return _fma(builder, *args)
    return f32x16(f32x16, f32x16, f32x16), codegen


@intrinsic
def vfnma(typingctx, a, b, c):
    """c - a * b with one rounding."""
    def codegen(context, builder, sig, args):
        return _fma(builder, builder.fneg(args[0]), args[1], args[2])
    return f32x16(f32x16, f32x16, f32x16), codegen


@intrinsic
def vmul(typingctx, a, b):
    """a * b lane-wise."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x16(f32x16, f32x16), codegen


@intrinsic
def vneg(typingctx, a):
    """-a lane-wise (exact)."""
    def codegen(context, builder, sig, args):
        return builder.fneg(args[0])
    return f32x16(f32x16), codegen


@intrinsic
def vexp(typingctx, x, lo, tiny):
    """exp(max(x, lo)) lane-wise, results <= tiny set to 0 (lo, tiny fp32 scalars; callers pass lo >= -87).

    Cephes expf: n = round(x / ln 2), r = x - n ln 2 (in two parts, exact for |n| < 2^10), a degree-7
    polynomial for e^r on |r| <= ln(2) / 2, times 2^n built in the exponent bits. x is also capped at 88 so the
    exponent cannot wrap (exp(88) = 1.65e38; callers' arguments are <= 60).
    """
    def codegen(context, builder, sig, args):
        x, lo, tiny = args
        lo, tiny = _splat(builder, lo, _VF), _splat(builder, tiny, _VF)
        x = builder.select(builder.fcmp_ordered("<", x, lo), lo, x)
        x = builder.select(builder.fcmp_ordered(">", x, _vconst(88.0)), _vconst(88.0), x)
        n = _call(builder, f"llvm.floor.v{LANES}f32",
                  [_fma(builder, x, _vconst(1.44269504088896341), _vconst(0.5))])
        r = _fma(builder, builder.fneg(n), _vconst(0.693359375), x)
        r = _fma(builder, n, _vconst(2.12194440e-4), r)
        p = _vconst(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = _fma(builder, p, r, _vconst(c))
        p = builder.fadd(_fma(builder, p, builder.fmul(r, r), r), _vconst(1.0))
        e = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * LANES)),
                        ir.Constant(_VI, [23] * LANES))
        y = builder.fmul(p, builder.bitcast(e, _VF))
        return builder.select(builder.fcmp_ordered(">", y, tiny), y, _vconst(0.0))
    return f32x16(f32x16, types.float32, types.float32), codegen


# ---- masks and reductions ----


@intrinsic
def vflush(typingctx, x, tiny, last):
    """Lane l of x where l <= last and |x| > tiny, else 0 (the triangular mask and the flush of tiny values
    in one select; last >= 15 keeps every lane that passes the flush)."""
    def codegen(context, builder, sig, args):
        x, tiny, last = args
        big = builder.fcmp_ordered(">", _call(builder, f"llvm.fabs.v{LANES}f32", [x]), _splat(builder, tiny, _VF))
        last32 = context.cast(builder, last, sig.args[2], types.int32)
        inside = builder.icmp_signed("<=", ir.Constant(_VI, list(range(LANES))), _splat(builder, last32, _VI))
        return builder.select(builder.and_(big, inside), x, _vconst(0.0))
    return f32x16(f32x16, types.float32, last), codegen


@intrinsic
def vmaxabs(typingctx, a, b):
    """max(a, |b|) lane-wise; a NaN in b is ignored (the caller sees it elsewhere)."""
    def codegen(context, builder, sig, args):
        b = _call(builder, f"llvm.fabs.v{LANES}f32", [args[1]])
        return builder.select(builder.fcmp_ordered(">", b, args[0]), b, args[0])
    return f32x16(f32x16, f32x16), codegen


@intrinsic
def vhmax(typingctx, a):
    """The largest lane of a (fp32 scalar)."""
    def codegen(context, builder, sig, args):
        m = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for k in range(1, LANES):
            x = builder.extract_element(args[0], ir.Constant(_I32, k))
            m = builder.select(builder.fcmp_ordered(">", x, m), x, m)
        return m
    return types.float32(f32x16), codegen


@intrinsic
def vhsum(typingctx, a):
    """Sum of the 16 lanes as an fp32 scalar, in a fixed tree order: lanes l and l + 8 first, then l and l + 4 of
    those, and so on (a value's bits never depend on anything but a's lanes)."""
    def codegen(context, builder, sig, args):
        v, n = args[0], LANES
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(f32x16), codegen
