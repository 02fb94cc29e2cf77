"""The per-token records of a speculative KDA verify, which its commit replays (:mod:`k3serve.kernels.kda_spec`).

Record layout, per (request, KDA layer, head, verified token), ``R = record_floats(K) = 6K`` fp32 values here
(the state layout has V = K)::

    ┌── k_t: K ──┬── g_t: K ──┬── u_t: V ──┬─ raw q_t: K ─┬─ raw k_t: K ─┬─ raw v_t: K ─┐
    0            K            2K           2K+V           3K+V           4K+V            5K+V = R

k_t is the L2-normalised key, g_t the log-decay, u_t the delta-rule correction, raw x_t the pre-conv
projections (what the conv window keeps). Stored fp32 here (this model computes k, g in fp32), 6K x 4 B =
768 B per head per token at K = 32, 3 KiB at K = 128. With bf16 activations (K3 serving) k, g and the raw
inputs are bf16 and u fp32: 5K x 2 + 4K = 14K B = 1792 B at K = 128, against a 64 KiB state + 4.5 KiB windows
per head that a snapshot per draft would copy (docs/speculative.md).
"""

from __future__ import annotations


def record_floats(k: int) -> int:
    """Floats per (head, token) record for head dim K (= V)."""
    return 6 * k


def record_offsets(k: int) -> dict[str, int]:
    """Start of each field inside a record (see the layout above)."""
    return {"k": 0, "g": k, "u": 2 * k, "raw": 3 * k}
