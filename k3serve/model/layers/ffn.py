"""Dense MLP (layer 0) and the two MoE flavours (MODEL.md §5).

TP: the dense MLP and the shared experts split their intermediate width (column- then row-parallel); routed
experts are split whole across ranks (expert parallel inside the TP group); each rank adds its experts'
weighted outputs and one all-reduce sums them. For K3 Stable LatentMoE the expert sum ``u`` lives in the
latent space and must be fully reduced before ``routed_expert_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.model.config import ModelConfig
from k3serve.model.deterministic import BMM_MIN_OUT, ELEMENTWISE_VEC, MIN_TILE, DefaultOps, tile_rows
from k3serve.model.layers.expert_weights import DenseLinear, expert_linear
from k3serve.model.layers.moe_grouped import (PADDED_MAX_ROWS, PADDED_MIN_ACTIVE, grouped_experts,
                                               looped_experts, padded_experts, stack_dense_experts)
from k3serve.model.layers.moe_mxfp4 import fuse_mxfp4_experts
from k3serve.model.layers.norm import glu, rms_norm
from k3serve.model.layers.stacked import stack_rows
from k3serve.model.tp import TPGroup


def _scaled(w: torch.Tensor, factor: float) -> torch.Tensor:
    """w times the routed scaling factor; a factor of 1 is skipped (x * 1 is x, bit for bit)."""
    return w if factor == 1.0 else w * factor


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """ids `[N, k]` -> (order `[N*k]`, counts `[E]`, counts as a list): one stable sort of the assignments::

        flat = ids.view(-1)          assignment a = row * k + slot
        order = argsort(flat)        [a for expert e0 ..., a for expert e1 ..., ...]  (stable: rows ascending)
        counts[e]                    assignments of expert e; expert e's run is order[off_e : off_e + counts[e]]
    """
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    return torch.argsort(flat, stable=True), counts, counts.tolist()


def expert_runs(order: torch.Tensor, counts: list[int], k: int, expert_ids: range):
    """(e, rows `[n_e]`, slots `[n_e]`) for each expert of `expert_ids` that has assignments, in ascending expert
    order, rows ascending within a run: the rows and order the former ``(ids == e).nonzero()`` loop gave."""
    rows_all, slot_all = order // k, order % k
    off = sum(counts[: expert_ids.start])
    for e in expert_ids:
        n = counts[e]
        if n:
            yield e, rows_all[off: off + n], slot_all[off: off + n]
            off += n


class GatedMLP:
    """`down(act(gate x) * up x)`; partial over TP ranks (caller reduces)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 ops: DefaultOps | None = None) -> None:
        self.cfg, self.ops = cfg, ops
        self.w_gate = weights[prefix + "gate_proj.weight"]
        self.w_up = weights[prefix + "up_proj.weight"]
        self.w_down = weights[prefix + "down_proj.weight"]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, d]` -> this rank's partial output `[N, d]`."""
        c = self.cfg
        lin = F.linear if self.ops is None else self.ops.linear
        h = glu(lin(x, self.w_gate), lin(x, self.w_up), c.hidden_act, c.activation_situ_beta,
                c.activation_situ_linear_beta)
        return lin(h, self.w_down)

    def reduced(self, x: torch.Tensor, gate: torch.Tensor | None = None,
                up: torch.Tensor | None = None) -> torch.Tensor:
        """x `[N, d]` -> the TP-reduced output `[N, d]` through the numerics mode's operators. gate, up: x's
        ``gate_proj`` / ``up_proj`` outputs `[N, I_local]` when a stacked projection computed them."""
        c, ops = self.cfg, self.ops
        gate = ops.linear(x, self.w_gate, ops.col_units) if gate is None else gate
        up = ops.linear(x, self.w_up, ops.col_units) if up is None else up
        h = glu(gate, up, c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
        return ops.row_linear(h, self.w_down)


class DenseFFN:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, tp: TPGroup,
                 ops: DefaultOps | None = None) -> None:
        self.ops = ops or DefaultOps(tp)
        self.mlp, self.tp = GatedMLP(cfg, weights, prefix + "mlp.", self.ops), tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, d]` -> `[B, T, d]`."""
        if self.ops.deterministic:
            return self.mlp.reduced(x)
        return self.tp.all_reduce(self.mlp.partial(x))


class MoE:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, tp: TPGroup,
                 ops: DefaultOps | None = None) -> None:
        self.cfg, self.tp = cfg, tp
        self.ops = ops or DefaultOps(tp)
        m = prefix + "block_sparse_moe."
        self.w_router = weights[m + "gate.weight"].float()
        self.score_bias = weights[m + "gate.e_score_correction_bias"].float()
        per_rank = cfg.num_experts // tp.world
        self.expert_ids = range(tp.rank * per_rank, (tp.rank + 1) * per_rank)
        # (w1, w3, w2) per expert, each an object that multiplies in its stored form (full precision or MXFP4)
        self.experts = {e: tuple(expert_linear(weights, f"{m}experts.{e}.{w}.weight") for w in ("w1", "w3", "w2"))
                        for e in self.expert_ids}
        # full-precision experts on the CPU, not trained: stacked once, one grouped GEMM per matrix (moe_grouped.py);
        # the per-expert objects become views of the stacks, so the weights are held once
        self.stacked = stack_dense_experts([self.experts[e] for e in self.expert_ids])
        if self.stacked is not None:
            self.experts = dict(zip(self.expert_ids, self.stacked.views()))
        # MXFP4 experts on the CPU: stacked packed bytes, one fused kernel call per layer (moe_mxfp4.py)
        self.fused = None if self.stacked is not None else fuse_mxfp4_experts(
            [self.experts[e] for e in self.expert_ids], self.expert_ids.start, cfg.hidden_act,
            cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        if self.fused is not None:
            self.experts = dict(zip(self.expert_ids, self.fused.views()))
        self.shared = GatedMLP(cfg, weights, m + "shared_experts.", self.ops) if cfg.num_shared_experts else None
        if cfg.uses_latent_moe:
            self.w_down = weights[m + "routed_expert_down_proj.weight"]
            self.latent_norm = weights[m + "routed_expert_norm.weight"]
            self.w_up = weights[m + "routed_expert_up_proj.weight"]
        self._stack_input_projections()
        # pack now what the experts' first tokens would (a decode step reaches a new expert for dozens of steps)
        dense = [t for t in self.experts.values() if all(isinstance(m, DenseLinear) for m in t)]
        self.ops.gemm.prepack([w2.weight for _, _, w2 in dense], [(w1.weight, w3.weight) for w1, w3, _ in dense])

    def _stack_input_projections(self) -> None:
        """Numerics mode ``deterministic``: the projections of the layer's input (router, latent down, shared
        gate and up) as one tiled GEMM over their row-stacked fp32 weights, whose columns have the separate
        GEMMs' bits (layers/stacked.py); the weights become views of the stack (held once)."""
        self.w_in, self.in_sizes = None, ()
        parts = [self.w_router] + ([self.w_down] if self.cfg.uses_latent_moe else [])
        parts += [self.shared.w_gate, self.shared.w_up] if self.shared is not None else []
        if not self.ops.deterministic or any(p.dtype != torch.float32 for p in parts):
            return
        self.w_in, self.in_sizes, views = stack_rows(parts, True)
        if self.w_in is None:  # weights that train
            return
        self.w_router = views[0]
        if self.cfg.uses_latent_moe:
            self.w_down = views[1]
        if self.shared is not None:
            self.shared.w_gate, self.shared.w_up = views[-2:]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, d]` -> (expert ids `[N, k]`, weights `[N, k]` fp32).

        Selection on sigmoid scores + correction bias; weights are the unbiased scores renormalised to 1,
        times routed_scaling_factor.
        """
        scores = torch.sigmoid(F.linear(x.float(), self.w_router))
        ids = torch.topk(scores + self.score_bias, self.cfg.num_experts_per_token, dim=-1).indices
        w = scores.gather(-1, ids)
        w = _scaled(w / w.sum(-1, keepdim=True), self.cfg.routed_scaling_factor)
        return ids, w

    def _routed_partial(self, z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                        decode: bool = False) -> torch.Tensor:
        """Weighted sum of this rank's experts: z `[N, e_in]`, ids / w `[N, k]` -> `[N, e_in]` (fp32).

        decode: one token per request (a decode step); only then may the padded bmm form run. Prefill chunks and
        verify windows keep the grouped GEMM, whose bits equal the per-expert loop's (so a full-precision model
        and an MXFP4 model whose experts dequantise to the same values agree bit for bit on a prompt).

        Tokens are grouped by expert once (one stable sort of the N*k assignments) and only the experts
        that received tokens run, each with its tokens' rows in ascending order; the weighted outputs are
        summed with one ``index_add_`` in ascending expert order. That is the row set, row order and
        summation order of the former per-expert ``(ids == e).nonzero()`` loop, so results are identical,
        without the 2 small ops per idle expert that dominated decode steps (docs/performance.md). Stacked
        (full-precision) experts run all of the rank's runs as one grouped GEMM per matrix instead of the loop
        (moe_grouped.py; the same GEMM per run, bit-identical), or, for decode-sized runs over many experts, as
        two bmm over zero-padded runs (last-bit rounding may then differ, as with any other batch). The
        grouping is :func:`group_by_expert`. MXFP4 experts on the CPU run all of this (grouping, experts, the
        weighted sum in ascending expert order) as one fused kernel call (moe_mxfp4.py): its fixed per-row
        order makes a token's result independent of the call's other tokens, and equal to the loop's within
        fp32 rounding.
        """
        if self.fused is not None and self.fused.takes(z):  # MXFP4 on the CPU: one fused call
            return self.fused(z, ids, w)
        c = self.cfg
        k = ids.shape[1]
        order, counts_t, counts = group_by_expert(ids, c.num_experts)
        lo = sum(counts[: self.expert_ids.start])
        hi = lo + sum(counts[self.expert_ids.start: self.expert_ids.stop])
        out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        if hi == lo:
            return out
        if self.stacked is not None:  # this rank's assignments order[lo:hi], grouped by expert, in one pass
            mine = order[lo:hi]
            rows, slot = mine // k, mine % k
            # only the span of local experts from the first to the last active one (the CPU grouped GEMM
            # issues one mm per group, empty ones included: at batch 1 most of the rank's experts are idle)
            active = [i for i, e in enumerate(self.expert_ids) if counts[e]]
            first, last = active[0], active[-1] + 1
            e0 = self.expert_ids.start
            run = counts_t[e0 + first: e0 + last]
            act = (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
            width = max(counts[e0 + first: e0 + last])
            if self.ops.packs(z, *self.stacked.w1.shape[1:]):  # oneDNN for these experts (model/cpu_gemm.py)
                y = looped_experts(z[rows], [counts[e0 + i] for i in active], self.stacked, active, *act, self.ops)
            elif decode and len(active) >= PADDED_MIN_ACTIVE and width <= PADDED_MAX_ROWS:  # 2 padded bmm
                expert = ids.reshape(-1)[mine] - (e0 + first)
                pos = torch.arange(hi - lo, device=z.device) - (run.cumsum(0) - run)[expert]
                y = padded_experts(z[rows], expert, pos, width, self.stacked.span(first, last), *act)
            elif 2 * len(active) < last - first:
                # most of the span idle (a decode step of a few requests): the active experts' GEMMs one by one,
                # the same mm per run that grouped_mm issues (bit-identical), without its one mm per idle group
                y = looped_experts(z[rows], [counts[e0 + i] for i in active], self.stacked, active, *act)
            else:
                y = grouped_experts(z[rows], run.cumsum(0).to(torch.int32), self.stacked.span(first, last), *act)
            out.index_add_(0, rows, y.float() * w[rows, slot].unsqueeze(-1))
            return out
        ys, rows_used = [], []
        for e, rows, slot in expert_runs(order, counts, k, self.expert_ids):
            w1, w3, w2 = self.experts[e]
            zi = z[rows]
            if self.ops.packs(zi, *w1.shape):  # as the stacked experts; MXFP4 blocks as plain weights
                h = glu(w1.tiled(zi, self.ops), w3.tiled(zi, self.ops), c.hidden_act, c.activation_situ_beta,
                        c.activation_situ_linear_beta)
                y = w2.tiled(h, self.ops)
            else:
                y = w2(glu(w1(zi), w3(zi), c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta))
            ys.append(y.float() * w[rows, slot].unsqueeze(-1))
            rows_used.append(rows)
        out.index_add_(0, torch.cat(rows_used), torch.cat(ys))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, d]` -> `[B, T, d]`."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.ops.deterministic:
            return moe_deterministic(self, flat).reshape(shape)
        ids, w = self.route(flat)
        decode = shape[-2] == 1 and flat.shape[0] > 1  # [B, 1, d]: a decode step over several requests
        if self.cfg.uses_latent_moe:
            u = self.tp.all_reduce(self._routed_partial(self.ops.linear(flat, self.w_down), ids, w, decode))
            routed = self.ops.linear(rms_norm(u.to(x.dtype), self.latent_norm, self.cfg.rms_norm_eps), self.w_up)
            shared = self.tp.all_reduce(self.shared.partial(flat)) if self.shared else 0
            out = routed + shared
        else:
            partial = self._routed_partial(flat, ids, w, decode).to(x.dtype)
            if self.shared is not None:
                partial = partial + self.shared.partial(flat)
            out = self.tp.all_reduce(partial)
        return out.reshape(shape)


def moe_deterministic(moe: MoE, flat: torch.Tensor) -> torch.Tensor:
    """:meth:`MoE.forward` in numerics mode ``deterministic``: flat `[N, d]` -> `[N, d]`.

    Every token's expert outputs are kept per slot (``[N, k, e_in]``, zero where another rank owns the slot's
    expert), made whole by a gather (one non-zero per element: exact), then added in slot order; the expert
    GEMMs run in fixed row tiles, so neither the tokens sharing an expert nor the TP degree moves a bit::

        y[n, s] = w[n, s] * expert_{ids[n, s]}(z[n])      (on the rank that owns that expert)
        u[n]    = ((y[n, 0] + y[n, 1]) + ...) + y[n, k-1]
    """
    c, ops = moe.cfg, moe.ops
    fused = ops.stack_linear(flat, moe.w_in).split(moe.in_sizes, -1) if moe.w_in is not None else None
    scores = ops.unary(torch.sigmoid, fused[0] if fused else ops.linear(flat.float(), moe.w_router))
    ids = torch.topk(scores + moe.score_bias, c.num_experts_per_token, dim=-1).indices
    w = scores.gather(-1, ids)
    w = _scaled(w / w.sum(-1, keepdim=True), c.routed_scaling_factor)
    if c.uses_latent_moe:
        z = fused[1] if fused else ops.linear(flat, moe.w_down)
    else:
        z = flat
    shared_in = fused[-2:] if fused and moe.shared is not None else (None, None)
    y = torch.zeros(*ids.shape, z.shape[-1], dtype=torch.float32, device=z.device)  # [N, k, e_in]
    # group the N*k assignments by expert with one stable sort (as MoE._routed_partial): expert e's run of
    # `order` holds its (row, slot) pairs in the ascending order the former (ids == e).nonzero() gave, and
    # only experts with tokens run (no 2 small ops per idle expert)
    order, counts_t, counts = group_by_expert(ids, c.num_experts)
    if _tiled_experts(moe, z, ids, w, y, order, counts_t, counts):
        return _finish_deterministic(moe, flat, y, shared_in)
    # the loop addresses assignments a = row * k + slot (order's entries) in the flat views: index_select and
    # index_copy_ (exact copies) where (rows, slot) advanced indexing cost ~2x per expert at batch 1
    k = ids.shape[1]
    y_flat, w_flat = y.view(-1, y.shape[-1]), w.reshape(-1)
    off = sum(counts[: moe.expert_ids.start])
    for e in moe.expert_ids:
        n = counts[e]
        if not n:
            continue
        a = order[off: off + n]
        off += n
        w1, w3, w2 = moe.experts[e]
        zi = z.index_select(0, a // k)
        if isinstance(w1, DenseLinear) and isinstance(w3, DenseLinear):
            gate, up = ops.linear_pair(zi, w1.weight, w3.weight)
        else:
            gate, up = w1.tiled(zi, ops), w3.tiled(zi, ops)
        out = w2.tiled(glu(gate, up, c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta), ops)
        y_flat.index_copy_(0, a, out.float() * w_flat.index_select(0, a).unsqueeze(-1))
    return _finish_deterministic(moe, flat, y, shared_in)


def _tiled_experts(moe: MoE, z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                   order: torch.Tensor, counts_t: torch.Tensor, counts: list[int]) -> bool:
    """The expert products of :func:`moe_deterministic` without the per-expert loop, for this rank's stacked
    (full-precision, not trained) experts. Fills y `[N, k, e_in]` and returns True, or False (nothing done)
    where it does not apply: MXFP4 or trained experts, weights narrower than the bmm floor, or an intermediate
    width off the elementwise vector grid (the activation's bits would then depend on the row count).

    Each expert's run has the bits of that expert's ``ops.linear`` (the loop's GEMMs): from MIN_TILE rows on a
    GEMM row does not depend on the GEMM's row count (tests/model/test_numerics_invariants.py), so

    * many active experts (``PADDED_MIN_ACTIVE``, decode-sized runs): every run zero-padded to one row tile R
      (``tile_rows`` of the longest run) and the span of active experts as two ``bmm``
      (`[R, e_in] x [e_in, 2I]`, then `[R, I] x [I, e_in]`, per entry);
    * otherwise (few experts, prefill runs): every run padded to at least MIN_TILE rows and the two grouped
      GEMMs (``grouped_experts``: one mm per run on the CPU, in C++, not a Python loop of tiles)."""
    c, ops = moe.cfg, moe.ops
    e0, e1 = moe.expert_ids.start, moe.expert_ids.stop
    local = counts[e0:e1]
    active = [i for i, n in enumerate(local) if n]
    if moe.stacked is None or not active:
        return moe.stacked is not None  # no local assignment: y stays zero
    if len(active) < min(PADDED_MIN_ACTIVE, len(local)):
        # few experts (decode-sized batches): the loop's one ops.linear per expert reads views of the stack; a
        # copy of their weights cost more than the GEMMs (bench preset, batch 1: 4 of 32). Decided before any
        # tensor op: a batch-1 step takes this exit in every MoE layer
        return False
    longest = max(local)
    inter, e_in = moe.stacked.w1.shape[1], moe.stacked.w1.shape[2]
    if min(inter, e_in) < BMM_MIN_OUT or inter % ELEMENTWISE_VEC:
        return False
    if ops.packs(z, inter, e_in) or ops.packs(z, e_in, inter):
        return False  # ops.linear runs these experts on the packed GEMM (model/packed_gemm.py): the loop
    act = (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
    k = ids.shape[1]
    if longest <= ops.tile and len(active) >= PADDED_MIN_ACTIVE:
        first, last = active[0], active[-1] + 1
        lo, hi = sum(counts[:e0 + first]), sum(counts[:e0 + last])
        mine = order[lo:hi]
        rows, slot = mine // k, mine % k
        run = counts_t[e0 + first: e0 + last]
        expert = ids.reshape(-1)[mine] - (e0 + first)
        pos = torch.arange(hi - lo, device=z.device) - (run.cumsum(0) - run)[expert]
        out = padded_experts(z[rows], expert, pos, tile_rows(longest, ops.tile), moe.stacked.span(first, last), *act)
    else:
        lo = sum(counts[:e0])
        mine = order[lo: lo + sum(local)]
        rows, slot = mine // k, mine % k
        # only the active experts (the CPU grouped GEMM issues one mm per group, empty ones included): their
        # weights gathered (an exact copy) unless all are active; run i of the padded buffer holds active expert
        # i's n_i rows, then zero rows up to MIN_TILE
        dev = z.device
        stacked = moe.stacked
        if len(active) < len(local):  # (at least PADDED_MIN_ACTIVE of them: the few-experts exit above)
            at = torch.tensor(active, device=dev)
            stacked = stacked.select(at)
        n_act = torch.tensor([local[i] for i in active], device=dev)
        slot_of = torch.zeros(len(local), dtype=torch.long, device=dev)
        slot_of[torch.tensor(active, device=dev)] = torch.arange(len(active), device=dev)
        padded = n_act.clamp(min=MIN_TILE)
        ends = padded.cumsum(0)
        expert = slot_of[ids.reshape(-1)[mine] - e0]  # active index of each assignment
        pos = torch.arange(mine.shape[0], device=dev) - (n_act.cumsum(0) - n_act)[expert]
        dest = (ends - padded)[expert] + pos
        buf = z.new_zeros(int(ends[-1]), z.shape[1])
        buf[dest] = z[rows]
        out = grouped_experts(buf, ends.to(torch.int32), stacked, *act)[dest]
    y[rows, slot] = out.float() * w[rows, slot].unsqueeze(-1)
    return True


def _finish_deterministic(moe: MoE, flat: torch.Tensor, y: torch.Tensor, shared_in: tuple) -> torch.Tensor:
    """Per-slot expert outputs y `[N, k, e_in]` -> the MoE output `[N, d]` (slot-ordered sum, shared experts;
    shared_in: their gate and up projections when stacked, else (None, None))."""
    c, ops = moe.cfg, moe.ops
    y = ops.reduce(y)
    u = y[:, 0].clone()
    for s in range(1, y.shape[1]):
        u += y[:, s]
    shared = moe.shared.reduced(flat, *shared_in) if moe.shared is not None else None
    if c.uses_latent_moe:
        routed = ops.linear(rms_norm(u.to(flat.dtype), moe.latent_norm, c.rms_norm_eps), moe.w_up)
    else:
        routed = u.to(flat.dtype)
    return routed if shared is None else routed + shared
