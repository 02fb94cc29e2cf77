"""Speculative decoding on KDA: verify without writing the state, then commit the accepted prefix by replay.

```
 verify  (k+1 tokens x_0..x_k per request, state S_0 read once, never written):
     per token t:  S <- Diag(exp g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
     returns o (the layer output) and u (fp32): the records keep k_t, g_t, u_t and the raw conv inputs
 commit  (n = tokens that entered the state, 0 <= n <= k+1, per request; one pass, state written once):
     S_n = Diag(exp g_n) ( ... (Diag(exp g_1) S_0 + k_1 u_1^T) ... ) + k_n u_n^T
         = exp(G_n) S_0 + sum_{t<=n} exp(G_n - G_t) k_t u_t^T      (G_t = sum_{s<=t} g_s; same value)
     u_t already holds the state-dependent part (v - S^T k), so the replay needs no matvec; run serially it
     repeats plain decode's update S.mul_(a).addcmul_(k, u) operation for operation.
     conv windows: new window = the last W-1 rows of [old window | raw_1 .. raw_n] (slid by n)
```

Records: the layout of :mod:`k3serve.kernels.kda_records`.

Backends as every kernel here (``_dispatch``): "naive" (loops), "torch" (vectorised, CPU), "triton" (CUDA;
CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from ._dispatch import resolve_backend
from ._kda_common import check_kda_inputs
from .kda_records import record_floats


def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor, *, scale: float | None = None,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over the verify window from the committed state, which is read and never written.

    Args:
        q, k: [B, T, H, K] (q not yet scaled; k L2-normalised as the layer does); v: [B, T, H, V];
        g: [B, T, H, K] log-decay; beta: [B, T, H].
        initial_state: [B, H, K, V] fp32, any strides (a view of the pool): not modified.
        scale: multiplies q (default K**-0.5).
    Returns:
        o: [B, T, H, V] in v's dtype (row t equals plain decode's output for token t).
        u: [B, T, H, V] fp32, the delta-rule corrections beta_t (v_t - S_{t-1}'^T k_t) for the records.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state)
    which = resolve_backend(backend, q.device)
    if which == "naive":
        from .kda_spec_ref import naive_kda_verify

        return naive_kda_verify(q, k, v, g, beta, initial_state, scale=scale)
    if which == "torch":
        from .kda_spec_ref import kda_verify_torch

        return kda_verify_torch(q, k, v, g, beta, initial_state, scale=scale)
    from .kda_spec_triton import kda_verify_triton

    return kda_verify_triton(q, k, v, g, beta, initial_state, scale=scale)


def _check_commit(blocks: torch.Tensor, records: torch.Tensor, accepted: torch.Tensor, k: int, window: int) -> None:
    if blocks.dim() != 3 or blocks.dtype != torch.float32:
        raise ValueError(f"blocks must be fp32 [B, H, block_floats], got {blocks.dtype} {tuple(blocks.shape)}")
    b, h, f = blocks.shape
    if f != k * k + 3 * (window - 1) * k:
        raise ValueError(f"blocks have {f} floats per head; K={k}, W={window} needs {k * k + 3 * (window - 1) * k}")
    if records.dim() != 4 or tuple(records.shape[:2]) != (b, h) or records.shape[3] != record_floats(k):
        raise ValueError(f"records must be [B={b}, H={h}, T, {record_floats(k)}], got {tuple(records.shape)}")
    if tuple(accepted.shape) != (b,):
        raise ValueError(f"accepted must be [B={b}], got {tuple(accepted.shape)}")
    if b and (int(accepted.min()) < 0 or int(accepted.max()) > records.shape[2]):
        raise ValueError(f"accepted counts must be in [0, T={records.shape[2]}], got {accepted.tolist()}")


def kda_commit(blocks: torch.Tensor, records: torch.Tensor, accepted: torch.Tensor, k: int, window: int, *,
               backend: str | None = None) -> None:
    """Replay each request's first ``accepted[b]`` records into its state block, in place (written once).

    Args:
        blocks: [B, H, block_floats] fp32 (state layout of model/state.py: S [K, V] then the q, k, v conv
            windows [3, W-1, K]); updated in place.
        records: [B, H, T, record_floats(K)] from the verify of this step.
        accepted: [B] int64, 0 <= accepted[b] <= T: how many verified tokens entered the state.
        k: head dim K (= V); window: conv kernel width W.
    """
    _check_commit(blocks, records, accepted, k, window)
    which = resolve_backend(backend, blocks.device)
    if which == "naive":
        from .kda_spec_ref import naive_kda_commit

        naive_kda_commit(blocks, records, accepted, k, window)
    elif which == "torch":
        from .kda_spec_ref import kda_commit_torch

        kda_commit_torch(blocks, records, accepted, k, window)
    else:
        from .kda_spec_triton import kda_commit_triton

        kda_commit_triton(blocks, records, accepted, k, window)
