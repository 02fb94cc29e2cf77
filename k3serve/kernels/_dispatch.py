"""Backend selection shared by every kernel entry point in ``k3serve.kernels``.

Three implementations exist for each kernel:

* ``"naive"``  - plain loops, the oracle the others are tested against;
* ``"torch"``  - vectorised torch, the CPU path;
* ``"triton"`` - Triton kernels, the CUDA path (also runnable on CPU tensors under
  ``TRITON_INTERPRET=1``, which is how the tests exercise them without a GPU).

Resolution order: explicit ``backend=`` keyword, then the ``K3SERVE_KERNEL_BACKEND``
environment variable, then the device of the inputs (CUDA -> triton, else torch).

Triton modules are imported lazily (only when the triton backend is chosen) because
``triton.jit`` reads ``TRITON_INTERPRET`` at decoration time, i.e. at module import:
importing them eagerly from here would freeze the interpreter decision before a test
conftest had a chance to set the variable.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("naive", "torch", "triton")
ENV_VAR = "K3SERVE_KERNEL_BACKEND"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Pick the implementation to run for inputs living on ``device``."""
    choice = backend or os.environ.get(ENV_VAR) or None
    if choice is None:
        return "triton" if device.type == "cuda" else "torch"
    choice = choice.lower()
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS}")
    if choice == "triton" and device.type != "cuda" and not _interpret_enabled():
        raise RuntimeError(
            "backend='triton' on non-CUDA tensors needs TRITON_INTERPRET=1 set before any "
            "k3serve.kernels.*_triton module is imported"
        )
    return choice


def _interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum) (Triton block sizes must be powers of 2)."""
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()
