"""Backend selection shared by every kernel entry point in ``k3serve.kernels``.

Implementations of each kernel:

* ``"naive"``  - plain loops, the oracle the others are tested against;
* ``"torch"``  - vectorised torch, the CPU path;
* ``"cpu"``    - a fused CPU kernel (numba) where the kernel has one (chunked KDA: ``kda_cpu``); for the
  others "cpu" means their torch path;
* ``"triton"`` - Triton kernels, the CUDA path (also runnable on CPU tensors under
  ``TRITON_INTERPRET=1``, which is how the tests exercise them without a GPU).

Resolution order: explicit ``backend=`` keyword, then the ``K3SERVE_KERNEL_BACKEND``
environment variable, then the device of the inputs (CUDA -> triton; else the kernel's fused CPU kernel
where it has one and it loads, else torch).

Triton modules are imported lazily (only when the triton backend is chosen) because
``triton.jit`` reads ``TRITON_INTERPRET`` at decoration time, i.e. at module import:
importing them eagerly from here would freeze the interpreter decision before a test
conftest had a chance to set the variable.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("naive", "torch", "cpu", "triton")
ENV_VAR = "K3SERVE_KERNEL_BACKEND"


def resolve_backend(backend: str | None, device: torch.device, *, cpu_kernel_error: str | None = None) -> str:
    """Pick the implementation to run for inputs living on ``device``.

    ``cpu_kernel_error``: None for a kernel without a fused CPU kernel ("cpu" then resolves to "torch");
    for one with it, "" where it loads (it is then the CPU default) or why it does not (the CPU default is
    then "torch", and forcing "cpu" raises RuntimeError with the reason).
    """
    choice = backend or os.environ.get(ENV_VAR) or None
    if choice is None:
        if device.type == "cuda":
            return "triton"
        return "cpu" if cpu_kernel_error == "" else "torch"
    choice = choice.lower()
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS}")
    if choice == "cpu":
        if cpu_kernel_error is None:
            return "torch"
        if cpu_kernel_error:
            raise RuntimeError(f"backend='cpu': the fused CPU kernel cannot run here: {cpu_kernel_error}")
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
