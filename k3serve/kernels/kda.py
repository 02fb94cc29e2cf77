"""Public KDA entry points: ``chunk_kda`` (prefill) and ``recurrent_kda`` (decode).

Both compute, per (batch, head) and token t (MODEL.md section 2, step 6):
    S <- Diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale q_t)
and return ``(o, final_state)``. They differ only in the algorithm (and thus speed profile);
results agree to fp32 rounding.

Backends (see ``_dispatch``): CUDA tensors -> Triton; CPU -> for ``chunk_kda`` the fused numba kernel
(``kda_cpu``, "cpu") where numba imports, else the torch path; for ``recurrent_kda`` torch. ``backend=`` or the
K3SERVE_KERNEL_BACKEND env var forces "naive" | "torch" | "cpu" | "triton" ("cpu" is the torch path for
``recurrent_kda``, which has no fused kernel); :func:`chunk_backend` says which one ``chunk_kda`` runs.
When autograd needs gradients of ``chunk_kda``'s inputs (training), it runs ``kda_autograd`` (the same chunk
form, out-of-place) instead of the inference kernels, which are not differentiable.

State layout: [B, H, K, V] fp32, i.e. S is stored [K, V] (key dim first), as in fla.
"""

from __future__ import annotations

import torch

from .cpu import kda_cpu
from ._dispatch import resolve_backend
from .kda_autograd import chunk_kda_autograd
from .cpu.kda_cpu import chunk_kda_cpu
from .kda_naive import naive_recurrent_kda
from .kda_torch import chunk_kda_torch, recurrent_kda_torch

_DOC_ARGS = """
    Args:
        q: [B, T, H, K] queries (fp32 or bf16), NOT normalised here.
        k: [B, T, H, K] keys, NOT normalised here.
        v: [B, T, H, V] values.
        g: [B, T, H, K] log-decay (alpha = exp(g)), e.g. from ``gate.kda_gate``.
        beta: [B, T, H] write strength, already sigmoided.
        scale: multiplies q; default K**-0.5 (MODEL.md 2.3's factor on the L2-normalised q).
            Pass 1.0 if q already carries it.
        initial_state: [B, H, K, V] state before token 0, any strides (a view into a state
            pool is fine); never modified.
        output_final_state: also return the state after the last token.
        backend: "naive" | "torch" | "cpu" | "triton" or None (by device / env var).
    Returns:
        o: [B, T, H, V] in v's dtype (math in fp32).
        final_state: [B, H, K, V] fp32 (a new tensor), or None.
"""


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    which = chunk_backend(backend, q.device)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    if which == "naive":
        return naive_recurrent_kda(q, k, v, g, beta, **kw)
    if _needs_grad(q, k, v, g, beta, initial_state):
        # Training: the inference kernels (torch, cpu and Triton) are not differentiable; this path is.
        return chunk_kda_autograd(q, k, v, g, beta, **kw)
    if which == "cpu":
        return chunk_kda_cpu(q, k, v, g, beta, **kw)
    if which == "torch":
        return chunk_kda_torch(q, k, v, g, beta, **kw)
    from .kda_triton import chunk_kda_triton

    return chunk_kda_triton(q, k, v, g, beta, **kw)


def chunk_backend(backend: str | None = None, device: torch.device | str = "cpu") -> str:
    """The implementation ``chunk_kda`` runs for inputs on ``device`` (without autograd): "cpu" (the fused
    numba kernel) is the CPU default where numba imports (``kda_cpu.NUMBA_ERROR`` empty), else "torch";
    ``backend`` / K3SERVE_KERNEL_BACKEND force one (forcing "cpu" without numba raises RuntimeError)."""
    return resolve_backend(backend, torch.device(device), cpu_kernel_error=kda_cpu.NUMBA_ERROR)


def _needs_grad(*xs: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    inplace_state: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    which = resolve_backend(backend, q.device)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state or inplace_state)
    if which == "torch":
        return recurrent_kda_torch(q, k, v, g, beta, inplace_state=inplace_state, **kw)
    if which == "naive":
        o, final = naive_recurrent_kda(q, k, v, g, beta, **kw)
    else:
        from .kda_triton import recurrent_kda_triton

        o, final = recurrent_kda_triton(q, k, v, g, beta, **kw)
    if inplace_state:
        if initial_state is None or initial_state.dtype != torch.float32:
            raise ValueError("inplace_state needs an fp32 initial_state")
        initial_state.copy_(final)
        final = initial_state
    return o, final


chunk_kda.__doc__ = "Chunked KDA forward (prefill).\n" + _DOC_ARGS
recurrent_kda.__doc__ = ("Token-recurrent KDA forward (decode, short inputs).\n" + _DOC_ARGS
                         + "    inplace_state (recurrent_kda only): write the final state into initial_state (fp32)\n"
                         "        and return it; saves decode a copy of the state each way.\n")
