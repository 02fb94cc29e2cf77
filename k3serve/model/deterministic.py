"""The model's matmul and reduction operators per numerics mode (contracts/numerics.py, docs/numerics.md).

Layers call ``ops.linear`` (replicated or column-parallel weights), ``ops.row_linear`` (row-parallel: the
TP-reduced result), ``ops.reduce`` (a rank's partial sum of whole-row outputs) and the few others of
:class:`DefaultOps`, each defined by what it computes; which library runs a GEMM (MKL, oneDNN's packed GEMM) and
the packed copies are the ops' ``gemm``'s (model/cpu_gemm.py, model/packed_gemm.py). :class:`DefaultOps` computes
in the batch's shapes with one all-reduce, :class:`DeterministicOps` the same values in shapes and orders that
do not depend on how many rows share the call or on the TP degree:

```
 rows     x [N, K] ──pad to >= 16 rows─▶ one [N, K] x [K, n] GEMM: each row has the bits of its [R, K] x [K, n]
          tile GEMM (R = MIN_TILE .. numerics.row_tile; from 16 rows on a row's bits do not depend on
          the row count); weights narrower than BMM_MIN_OUT (n = 1 does depend on it): each output a row-local
          sum of elementwise products (narrow_linear), no GEMM
 columns  W [n_local, K] = units_local x [n/U, K]: one GEMM per unit (U = shard units: the largest TP)
 reduce   row-parallel W [N, K_local], K_local = units_local x K/U:
          partial_u = x[:, K_u] W[:, K_u]^T     (u = this rank's units)
          all-gather the partials of all U units (in rank order = unit order), then
          out = ((p_0 + p_1) + p_2) + ... + p_{U-1}     on every TP, including 1
```
Pinned at one thread (tests/model/test_numerics_invariants.py): a row of a GEMM does not depend on
the other rows nor on its place, and from MIN_TILE rows on not on the row count either (up to 4096 rows for the
model's shapes; 1-column weights excepted), and a batch of tiles equals separate calls; a GEMM with fewer rows
takes another kernel (a ~1e-5 different result), and 1 vs 2 threads differ (with 2 threads the row count does
change a row's bits); that is why calls are padded to MIN_TILE rows and the thread count is fixed during a forward.
Where the small-M kernel starts depends on the CPU: on an AVX2 Xeon (the machine of the fourth wave) from 4 rows,
on an AVX-512 Xeon with AMX (Sapphire Rapids class, MKL 2.13's CPU build) only from 16 rows for K >= 192 (with 4,
58 deterministic tests failed there); 16 holds on both and is the floor.
"""

from __future__ import annotations

import contextlib
import math

import torch

from k3serve.contracts.numerics import GemmLibrary, Numerics
from k3serve.model.cpu_gemm import CpuGemm
from k3serve.model.gemm_facts import check_packed_rows, check_row_floor, linear_shapes
from k3serve.model.packed_gemm import DeterministicGemm
from k3serve.model.tp import TPGroup

# Elements per padded elementwise call: a multiple of 2 x the widest vector (AVX-512: 16 floats).
ELEMENTWISE_VEC = 64
# Output widths from which the row tiles of one linear run as one bmm (narrower: one mm per tile).
BMM_MIN_OUT = 16
# The smallest row tile: from 16 rows on, a row of a GEMM gets the same bits whatever the GEMM's row count (one
# kernel; fewer rows take another for K >= 192 on AVX-512 MKL, fewer than 4 on AVX2: see the module docstring and
# tests/model/test_numerics_invariants.py, which names the shape if a CPU breaks it).
MIN_TILE = 16
# Most elements of a narrow linear's product temporary (narrow_linear): longer calls go in row chunks.
NARROW_BUDGET = 1 << 20


def tile_rows(rows: int, tile: int) -> int:
    """Rows per tile for a call of `rows` rows: the smallest of MIN_TILE, 2 MIN_TILE, ... up to `tile` that
    holds them (a decode step of 1 row pads to MIN_TILE). Every choice gives a row the same bits (MIN_TILE)."""
    t = MIN_TILE
    while t < rows and t < tile:
        t *= 2
    return min(t, tile) if tile >= MIN_TILE else tile


def per_head_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[H, M, K]`, w `[H, n, K]` -> `[H, M, n]`: one `[M, K] x [K, n]` GEMM per head (B transposed), rows
    zero-padded to MIN_TILE (fewer rows take another kernel; from MIN_TILE on a row's bits do not depend on M)."""
    m = x.shape[1]
    if m < MIN_TILE:
        x = torch.cat([x, x.new_zeros(x.shape[0], MIN_TILE - m, x.shape[2])], dim=1)
    return torch.bmm(x, w.transpose(1, 2))[:, :m]


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The packed GEMM (oneDNN, CPU) takes fp32 CPU operands; others (CUDA) keep the tiled path."""
    return x.dtype == torch.float32 and w.is_cpu


def shard_units(cfg) -> int:
    """The largest TP degree the model supports: the fixed shard unit count of deterministic reductions."""
    return math.gcd(cfg.kda_num_heads, cfg.num_attention_heads, cfg.num_experts, cfg.intermediate_size,
                    cfg.shared_expert_intermediate_size or cfg.num_experts)


class DefaultOps:
    """The default mode: whatever shapes the batch gives, one all-reduce per row-parallel output; the linears on
    ``gemm`` (model/cpu_gemm.py: oneDNN's packed GEMM or MKL per call; MKL's ``F.linear`` where none is given).

    What a layer calls, each operator defined by the values it computes (in the deterministic mode, by their
    bits): ``linear``, ``stack_linear``, ``linear_pair``, ``transient_linear``, ``row_linear``, ``reduce``,
    ``unary``, ``softmax0``, ``row_dot``; ``threads`` scopes a forward. Which library runs a GEMM, packing and
    the packed copies are ``gemm``'s; ``packs`` is the one thing a layer asks about that choice (see there)."""

    deterministic = False
    col_units = 1  # units of a column-parallel weight on this rank (pass to linear)

    def __init__(self, tp: TPGroup, gemm: CpuGemm | None = None) -> None:
        self.tp = tp
        self.gemm = gemm if gemm is not None else CpuGemm(GemmLibrary.MKL)  # MKL: F.linear, no packed copies

    def linear(self, x: torch.Tensor, w: torch.Tensor, units: int = 1) -> torch.Tensor:
        """x `[..., K]` times w `[n, K]` -> `[..., n]`: a weight whose shape is the same on every TP (replicated, a
        routed expert on its owning rank; units 1), or this rank's column slice of `units` shard units."""
        return self.gemm.linear(x, w)

    def stack_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[..., K]` times a layer's row-stacked input projections w `[sum n_i, K]` (layers/stacked.py: this
        rank's column slices next to replicated weights, so its width changes with TP) -> `[..., sum n_i]`."""
        return self.gemm.linear(x, w)

    def linear_pair(self, x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(x, w_a), linear(x, w_b)) for two weights of one input `[N, K]` (an expert's gate and up): one
        call, so that the GEMM may run both as one."""
        return self.gemm.linear_pair(x, w_a, w_b)

    def transient_linear(self, x: torch.Tensor, w: torch.Tensor, whole: tuple[int, int] | None = None
                         ) -> torch.Tensor:
        """x `[N, K]` times a weight w `[n, K]` made for this call (a block of rows of a dequantised MXFP4 weight
        of shape `whole`) -> `[N, n]`: ``linear`` for a weight that is not the model's, so never kept packed."""
        return self.gemm.transient(x, w, whole)

    def packs(self, x: torch.Tensor, n: int, k: int) -> bool:
        """Whether ``linear`` of x `[..., k]` by a weight `[n, k]` runs on oneDNN's packed GEMM rather than
        torch's mm. The MoE has forms of its own for many experts' products (grouped and padded GEMMs over the
        stacked experts, the MXFP4 kernel), which are torch's mm: it takes them only where ``linear`` would not
        pack. That keeps the deterministic mode's bits ``linear``'s; here it leaves a packed expert on the faster
        library."""
        return self.gemm.takes_shape(x, n, k)

    def row_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[..., K_local]`, w `[n, K_local]` (this rank's input columns) -> the TP-reduced `[..., n]`."""
        return self.tp.all_reduce(self.gemm.linear(x, w))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank partial `[...]` over the TP group."""
        return self.tp.all_reduce(partial)

    def unary(self, fn, x: torch.Tensor) -> torch.Tensor:
        """An elementwise op `fn` (sigmoid, ...) on `x` of any shape."""
        return fn(x)

    def softmax0(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over dim 0 of `[n, ...]`."""
        return x.softmax(0)

    def row_dot(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each row of x `[..., d]` dotted with v `[d]` -> `[...]`: one GEMV (a single read of x, where the
        elementwise product and row sum write and re-read a full-size temporary; a row's bits may depend on the
        row count, which the default mode allows)."""
        return torch.matmul(x, v)

    def threads(self) -> contextlib.AbstractContextManager:
        """The scope of one forward: the deterministic mode fixes the intra-op thread count there."""
        return contextlib.nullcontext()


class DeterministicOps(DefaultOps):
    """Fixed row tiles, fixed shard units, unit-ordered TP sums, a fixed thread count (numerics mode
    ``deterministic``); the long reductions and large fixed-shape units on oneDNN's packed GEMM (``gemm``). One
    operator more: ``head_gemm``, for the blocked MLA attention that only this mode runs."""

    deterministic = True

    def __init__(self, tp: TPGroup, numerics: Numerics, units: int) -> None:
        if units % tp.world:
            raise ValueError(f"shard units {units} are not divisible by TP {tp.world}")
        self.tp = tp
        self.numerics, self.units, self.units_local = numerics, units, units // tp.world
        self.col_units = self.units_local
        self.tile = numerics.row_tile
        # which GEMM units take oneDNN's packed GEMM (model/packed_gemm.py), by shapes the same on every TP
        self.gemm = DeterministicGemm(numerics, BMM_MIN_OUT)

    def check_gemm_facts(self, weights: dict[str, torch.Tensor]) -> None:
        """Refuse a CPU whose GEMMs break the mode's row facts for the shapes of `weights` (model/gemm_facts.py)."""
        shapes = linear_shapes(weights, self.units, BMM_MIN_OUT)
        threads = self.numerics.threads
        # a shape packed by size only (experts, row-parallel units) may be a linear's on MKL tiles too: both
        check_row_floor([(k, n) for k, n in shapes if not self.gemm.takes(k, n, torch.float32)], MIN_TILE, threads)
        check_packed_rows([(k, n) for k, n in shapes if self.gemm.takes(k, n, torch.float32, sized=True)], threads)

    def packs(self, x: torch.Tensor, n: int, k: int) -> bool:
        # the weight's shape decides (``linear`` with units 1), whatever x's rows
        return x.is_cpu and self.gemm.takes(k, n, x.dtype, sized=True)

    # ------------------------------------------------------------------------------------------- tiles
    def _tiled(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[N, K]` (any N), w `[n, K]` -> `[N, n]` with each row's bits those of a [R, K] x [K, n] tile GEMM.

        Weights with at least BMM_MIN_OUT rows run as one GEMM over all N rows (zero-padded to MIN_TILE when
        fewer): from MIN_TILE rows on a row's bits do not depend on the GEMM's row count (up to 4096 rows for
        the model's shapes, and equal to a bmm over tiles: tests/model/test_numerics_invariants.py),
        so this is the tile loop's result without the tiles. Narrower ones (a 1-head unit of b_proj), whose
        GEMM rows do change with the row count (n = 1 at 5, 6, 7 .. rows), take :func:`narrow_linear`."""
        rows, k = x.shape
        if w.shape[0] < BMM_MIN_OUT:
            return narrow_linear(x, w)
        if rows < MIN_TILE:
            x = torch.cat([x, x.new_zeros(MIN_TILE - rows, k)])
        return torch.mm(x, w.t())[:rows]

    def _one_tile(self, x: torch.Tensor) -> torch.Tensor | None:
        """x `[N, K]` padded to its single tile `[R, K]`, or None when N needs more than one tile."""
        rows, k = x.shape
        size = tile_rows(rows, self.tile)
        if rows > size:
            return None
        return torch.cat([x, x.new_zeros(size - rows, k)]) if size > rows else x

    def linear(self, x: torch.Tensor, w: torch.Tensor, units: int = 1) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        n_u = w.shape[0] // units
        if self.gemm.takes(k, n_u, w.dtype, sized=True) and _packable(x, w):
            # a column's bits do not depend on the GEMM's width: the local weight in one call is each unit's GEMM
            # (a unit's shape, like a replicated weight's, is the same on every TP, so it may decide by size)
            out = self.gemm.packed.linear(flat, w)
        elif units == 1 or n_u < BMM_MIN_OUT:  # narrow units: every output column is its own (narrow_linear)
            out = self._tiled(flat, w)
        elif (tile := self._one_tile(flat)) is not None:  # (n_u >= BMM_MIN_OUT here)
            # one tile (a decode step): the units' GEMMs as one bmm, each batch entry the same [R, K] x [K, n/U]
            # GEMM (B transposed) that the per-unit path runs: [U, R, n/U] -> [R, U n/U]
            out = torch.bmm(tile.unsqueeze(0).expand(units, -1, -1), w.view(units, n_u, k).transpose(1, 2))
            out = out.transpose(0, 1).reshape(tile.shape[0], -1)[: flat.shape[0]]
        else:
            out = torch.cat([self._tiled(flat, wu) for wu in w.chunk(units)], dim=-1)
        return out.view(*lead, w.shape[0])

    def stack_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        if self.gemm.takes(k, w.shape[0], w.dtype) and _packable(x, w):  # by K only: the width changes with TP
            return self.gemm.packed.linear(flat, w).view(*lead, w.shape[0])
        return self._tiled(flat, w).view(*lead, w.shape[0])

    def linear_pair(self, x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        if w_a.shape == w_b.shape and self.gemm.takes_weight(w_a) and x.dtype == torch.float32:
            # one packed GEMM over [w_a; w_b]: a column's bits do not depend on the other columns of the call
            both = self.gemm.packed.linear_stacked(x, (w_a, w_b))
            return both[:, : w_a.shape[0]], both[:, w_a.shape[0]:]
        both = _adjacent_rows(w_a, w_b)
        if both is not None and min(w_a.shape[0], w_b.shape[0]) >= BMM_MIN_OUT and not self.gemm.takes_weight(both):
            # w_b's rows follow w_a's in memory (an expert's w1 and w3, views of its stacked w13: moe_grouped.py):
            # one tiled GEMM over both, whose columns have the bits of the two GEMMs (each alone would take the
            # same one-GEMM path of _tiled, being at least BMM_MIN_OUT wide); one padding and one call, not two
            out = self._tiled(x, both)
            return out[:, : w_a.shape[0]], out[:, w_a.shape[0]:]
        return self.linear(x, w_a), self.linear(x, w_b)

    def transient_linear(self, x: torch.Tensor, w: torch.Tensor, whole: tuple[int, int] | None = None
                         ) -> torch.Tensor:
        # MKL tiles whatever the shape: the packed copies are kept per model weight, and one made per call is not
        return self._tiled(x, w)

    def head_gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[H, M, K]`, w `[H, n, K]` (this rank's heads of a model weight) -> `[H, M, n]`: the MLA's per-head
        GEMMs (layers/mla_blocked.py), packed per head when a head's `[n, K]` is large (its shape does not change
        with TP), else ``per_head_gemm``'s padded bmm."""
        heads, _, k = x.shape
        if self.gemm.takes(k, w.shape[1], w.dtype, sized=True) and _packable(x, w):
            return torch.stack([self.gemm.packed.linear(x[h], w[h]) for h in range(heads)])
        return per_head_gemm(x, w)

    def row_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        ul, n = self.units_local, w.shape[0]
        width = k // ul
        if self.gemm.takes(width, n, w.dtype, sized=True) and _packable(x, w):
            parts = self.gemm.packed.unit_partials(flat, w, ul)  # [units_local, N, n]: a packed copy per unit
        elif n >= BMM_MIN_OUT:
            # the units' partial GEMMs [N, K/U] x [K/U, n] (N padded to MIN_TILE) as one bmm over the unit slices
            # of x and w (strided views, no copies: a GEMM's bits do not depend on its operands' leading
            # dimensions, and from MIN_TILE rows on not on the row count, so each entry has the bits of the unit's
            # own GEMM, tests/model/test_numerics_invariants.py); a prefill chunk's per-unit copies and stack of
            # partials cost more than the GEMMs (tiny preset, 4096 rows: 14.3 against 8.7 ms)
            rows = flat if flat.shape[0] >= MIN_TILE else torch.cat([flat, flat.new_zeros(MIN_TILE - flat.shape[0], k)])
            xs = rows.view(rows.shape[0], ul, width).transpose(0, 1)  # [U_local, N, K/U]
            ws = w.view(n, ul, width).transpose(0, 1)  # [U_local, n, K/U]
            parts = torch.bmm(xs, ws.transpose(1, 2))[:, : flat.shape[0]]  # [U_local, N, n]
        else:
            parts = torch.stack([self._tiled(flat[:, u * width: (u + 1) * width].contiguous(),
                                             w[:, u * width: (u + 1) * width].contiguous())
                                 for u in range(ul)])  # [units_local, N, n]
        return self._sum_units(self._gather(parts)).view(*lead, n)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A partial that is non-zero on exactly one rank per element (expert-parallel slots): the gathered
        sum adds exact zeros, so it is the owning rank's value on every TP."""
        if self.tp.world == 1:
            return partial
        return self.tp.all_gather(partial).sum(0)

    def unary(self, fn, x: torch.Tensor) -> torch.Tensor:
        """fn over a flat copy padded to a multiple of ELEMENTWISE_VEC elements: torch's CPU kernels compute the last
        (numel mod 2 x vector width) elements with scalar code, whose exp-based results (sigmoid, ...) differ
        from the vector code's by an ulp, so an element's bits would depend on how many share the tensor."""
        flat = x.reshape(-1)
        n = flat.numel()
        pad = -n % ELEMENTWISE_VEC
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return fn(flat)[:n].view(x.shape)

    def softmax0(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over dim 0, computed as a last-dim softmax of `[..., n]` rows: one row at a time, the same
        code for a row whatever the number of rows (dim-0 softmax vectorises across the rows instead)."""
        return x.movedim(0, -1).contiguous().softmax(-1).movedim(-1, 0)

    def row_dot(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each row of x `[..., d]` dotted with v `[d]` -> `[...]` as an elementwise product and a last-dim sum:
        a row's bits depend only on that row (a GEMV's do not: a different row count can take another kernel)."""
        return (x * v).sum(-1)

    def _gather(self, parts: torch.Tensor) -> torch.Tensor:
        """[units_local, ...] per rank -> [units, ...] in unit order (rank r holds units r*ul .. r*ul+ul-1)."""
        if self.tp.world == 1:
            return parts
        return self.tp.all_gather(parts).flatten(0, 1)

    @staticmethod
    def _sum_units(parts: torch.Tensor) -> torch.Tensor:
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    @contextlib.contextmanager
    def threads(self):
        before = torch.get_num_threads()
        torch.set_num_threads(self.numerics.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def narrow_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[N, K]`, w `[n, K]` with n < BMM_MIN_OUT (KDA's b_proj, whose shard units are one head each) -> `[N, n]`:
    each output the sum over K of one row's elementwise products with one weight row, as a last-dim sum of a
    contiguous product (``DeterministicOps.row_dot``'s rule): torch reduces each output's K values by one code
    path whatever the number of outputs, so an output's bits depend on its row and weight row only, not on N,
    n, the unit split or the TP degree. A GEMM this narrow rounds a row by the row count, and the tile loop it
    replaces (one mm per 16 rows per unit) made 4 x 520 GEMM calls per KDA layer of an 8K-token prefill.
    Rows go in chunks of at most NARROW_BUDGET product elements (row-local: chunking moves no bit). Both operands
    are made contiguous so that the product is, whatever the callers' views (a permuted product would be reduced
    along a strided dim, by another code path)."""
    x, w = x.contiguous(), w.contiguous()
    rows, k = x.shape
    step = max(1, NARROW_BUDGET // max(1, w.shape[0] * k))
    if rows <= step:
        return (x.unsqueeze(1) * w).sum(-1)
    return torch.cat([(x[i: i + step].unsqueeze(1) * w).sum(-1) for i in range(0, rows, step)])


def _adjacent_rows(w_a: torch.Tensor, w_b: torch.Tensor) -> torch.Tensor | None:
    """w_a `[n_a, K]` and w_b `[n_b, K]` as one `[n_a + n_b, K]` view when w_b's rows directly follow w_a's in one
    contiguous storage, else None."""
    if (w_a.dim() != 2 or w_b.dim() != 2 or w_a.shape[1] != w_b.shape[1] or w_a.dtype != w_b.dtype
            or w_a.device != w_b.device or not (w_a.is_contiguous() and w_b.is_contiguous())
            or w_a.untyped_storage().data_ptr() != w_b.untyped_storage().data_ptr()
            or w_b.storage_offset() != w_a.storage_offset() + w_a.numel()):
        return None
    return w_a.as_strided((w_a.shape[0] + w_b.shape[0], w_a.shape[1]), w_a.stride())


def make_ops(cfg, tp: TPGroup, numerics: Numerics | None, weights: dict[str, torch.Tensor]) -> DefaultOps:
    """The operators for `numerics` (None: default) of a model of this rank's `weights`. Deterministic ones first
    check this CPU's GEMMs for the weights' shapes, and refuse to start where the mode cannot hold."""
    if numerics is None or not numerics.deterministic:
        return DefaultOps(tp, CpuGemm((numerics or Numerics()).default_gemm))
    ops = DeterministicOps(tp, numerics, shard_units(cfg))
    ops.check_gemm_facts(weights)
    return ops
