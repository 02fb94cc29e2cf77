"""Chunked KDA forward as one fused CPU kernel (numba): the CPU default of ``kda.chunk_kda`` (backend "cpu").

Same algorithm and decay factors as ``kda_torch.chunk_kda_torch`` (its module docstring has the chunked WY form),
but each (batch, head) sequence walks its chunks in order inside one thread and does a chunk's whole work while its
rows are in cache, instead of ~20 batched torch ops over all chunks followed by a 128-step Python loop of small
``baddbmm`` calls. Chunks of C = 16 tokens by default (one sub-chunk; the torch path's is 32): with the sequential
state step this cheap, the smaller chunk does ~13% less work per token and runs faster than 32 or 64 (the
sequential state step is cheap); any multiple of 16 runs::

    prange over runs of consecutive (batch, head) sequences, one run per thread (min(torch.get_num_threads(),
    numba's, B*H) threads); within a run, for each chunk c (rows t = c*C .. c*C + C - 1, zero rows past T)
    and each sequence (b, h) of the run, with its own state S (fp32 [Kp, Vp], a private copy):
        load_rows   q*scale, k, beta*v; G = cumulative g in fp64
        scores      Aqk, beta*Akk (sub-chunks of 16: earlier blocks, centred or pairwise diagonal blocks)
        gates       q e^G, beta k e^G, k e^(G_last - G), e^G_last
        solve       [W | U] = (I + L)^-1 [beta k e^G | beta v]
        state_step  Vn = U - W S;  O = q e^G S + Aqk Vn;  S = Diag(e^G_last) S + (k e^(G_last-G))^T Vn
    final state of (b, h) = its S

(numba code in ``kda_cpu_kernel``, the scratch layout in its docstring). The inner loops are 16-lane vector code
(``_simd``: register tiles of 8 rows x 16-32 columns, explicit FMAs), because LLVM's auto-vectorised loops
kept their accumulators in memory (``_simd``'s docstring). On CPUs without AVX-512 the sequential stages
take 4 x 16 tiles and the score tiles 2-row passes instead (:func:`narrow_tiles`), which fit AVX2's 16 registers:
the same FMAs per element in the same order, so the same bits.

Numerics (the contract the tests pin, tests/kernels/test_kda_cpu.py):
  * within fp32 rounding of the torch path and the naive oracle, for the bounded K3 gate and the unbounded
    Kimi-Linear gate alike: the fp64 cumulative gate, differences rounded once to fp32 before exp, decay
    factors below _TINY (1e-15) flushed to exact 0 (subnormal operands run 20-60x slower on x86), exp clamped
    below at log(_TINY) - 1, and the per-chunk centred / pairwise choice for the diagonal blocks, all as
    kda_torch; (I + L)^-1 is formed row by row with each row flushed (kda_cpu_kernel.solve says why);
  * a chunk's result depends only on its own rows and the state entering it: every loop has a fixed order and
    fixed trip counts given (C, K, V), and a sequence's arithmetic is the same whichever run or thread it is
    in, so one-shot and split prefill, one head alone or among many, 1 or n threads all give the same bits
    (the ``numerics: deterministic`` mode relies on it);
  * numba compiles without fast-math: no reassociation, no contraction except the FMAs written out, so the bits
    are the source's on any x86-64 (with any vector width); exp is a fixed polynomial (``_simd.vexp``);
  * K and V are zero-padded to multiples of 32 inside the kernel (and of 16 in the inputs): q = k = g = v = 0
    columns add exact zeros, so the real columns' bits do not depend on the padding.

``initial_state`` (any strides, e.g. a view into a state pool) is read once and never written; the output is
in v's dtype and the final state a new fp32 tensor, as chunk_kda_torch. Training (autograd) never gets here.

Compile time: ~20-40 s on the first call of a process without a cache (2 loaded cores); ``cache=True`` keeps
the machine code under ``k3serve/kernels/cpu/__pycache__`` and later processes load it in about a second;
``scripts/setup.sh`` compiles it once (:func:`warm_up`). Where numba cannot be imported, :data:`NUMBA_ERROR`
says why and ``chunk_kda`` runs the torch path (``kda.chunk_backend`` reports which).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F

from .._kda_common import check_kda_inputs, default_scale
from .kda_cpu_kernel import SUB, chunk_kda_kernel

try:  # a pinned dependency (pyproject.toml); without it the dispatch keeps the torch path
    import numba

    NUMBA_ERROR = ""
except ImportError as err:  # reported by kda.chunk_backend, not swallowed
    numba = None
    NUMBA_ERROR = f"numba could not be imported ({err})"

CHUNK = 16   # C: measured fastest (module docstring); bench kernels counts its FLOPs with this C
_LOCK = threading.Lock()   # numba's workqueue threading layer must not be entered by two threads at once


def _rows(x: torch.Tensor, n: int) -> np.ndarray:
    """fp32 C-contiguous [B*T*H, n] view of x [B, T, H, D] (zero-padded to n >= D columns; a copy only where
    the dtype, layout or width needs one). One layout, so one compiled signature."""
    x = x.detach().to(torch.float32)
    if n != x.shape[-1]:
        x = F.pad(x, (0, n - x.shape[-1]))
    return x.contiguous().view(-1, n).numpy()


def chunk_kda_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
    sub_chunk: int = SUB,
    narrow: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward, fused CPU kernel (module docstring). Not differentiable.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H] (CPU tensors, fp32 or
            bf16; computed in fp32).
        scale: multiplies q (default K**-0.5).
        initial_state: [B, H, K, V] (any strides; read only).
        output_final_state: also return the final state.
        chunk_size: C, a positive multiple of 16.
        sub_chunk: must be 16 (the kernel's tiles are built for it; the argument mirrors chunk_kda_torch's).
        narrow: the narrow register tiles (True: 4 x 16 and 2-row score passes) or the wide ones (False: 8 x 32,
            8-row passes); None: this CPU's (:func:`narrow_tiles`). The same bits either way
            (tests/kernels/test_kda_cpu.py).
    Returns:
        o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32 (a new tensor) or None.
    """
    if numba is None:
        raise RuntimeError(NUMBA_ERROR)
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    if sub_chunk != SUB:
        raise ValueError(f"sub_chunk must be {SUB} for the fused CPU kernel, got {sub_chunk}")
    if chunk_size <= 0 or chunk_size % SUB:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB}, got {chunk_size}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor for the fused CPU kernel, got {x.device}")
    scale = default_scale(scale, K)
    Ki, Vi = -(-K // 16) * 16, -(-V // 16) * 16
    final = torch.zeros(B, H, K, V)
    if initial_state is not None:
        final.copy_(initial_state.detach())   # the kernel updates its own copy; the caller's view is never written
    out = torch.empty(B, T, H, Vi)
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, B * H))
    args = (T, H, _rows(q, Ki), _rows(k, Ki), _rows(v, Vi), _rows(g, Ki),
            beta.detach().to(torch.float32).contiguous().view(-1).numpy(), np.float32(scale), final.numpy(),
            out.view(-1, Vi).numpy(), chunk_size, threads, narrow_tiles() if narrow is None else bool(narrow))
    torch_threads = torch.get_num_threads()
    with _LOCK if _serialise() else _NO_LOCK:
        numba.set_num_threads(threads)
        try:
            chunk_kda_kernel(*args)
        finally:
            # numba's "omp" layer shares the process's OpenMP runtime with torch, and starting its pool sets that
            # runtime's thread count to NUMBA_NUM_THREADS: torch.get_num_threads() then reads 2 on 2 cores after
            # a rank capped it at 1. Without this restore every later decode step ran two OpenMP threads, one
            # waiting at the other's barriers, and each process of a deployment took both cores.
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
    o = out if Vi == V else out[..., :V]
    return o.to(v.dtype).contiguous(), (final if output_final_state else None)


@functools.lru_cache(maxsize=1)
def narrow_tiles() -> bool:
    """Whether this CPU runs the kernel's narrow register tiles (kda_cpu_kernel.py: 4 x 16 in the sequential
    stages, 2-row passes in the score tiles): yes without AVX-512. The wide tiles hold 16 accumulators of 16 lanes,
    16 of AVX-512's 32 vector registers; on AVX2 each takes two of its 16, more than it has before an operand is
    loaded: on AVX2 the narrow tiles run 1.65-1.85x faster, on AVX-512 the wide ones are faster."""
    try:
        from llvmlite import binding
        return not binding.get_host_cpu_features().get("avx512f", False)
    except (ImportError, RuntimeError):  # no feature map: the tiles that fit any x86-64's 16 registers
        return True


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()


def _serialise() -> bool:
    """Whether calls must not overlap: until the first parallel call has picked numba's threading layer, and
    afterwards if it picked "workqueue" (not thread safe; "omp" and "tbb" are)."""
    try:
        return numba.threading_layer() not in ("omp", "tbb")
    except ValueError:   # no parallel region has run yet
        return True


def warm_up() -> None:
    """Compile (or load from the cache) the kernel's one signature on tiny inputs, so that the first prefill of a
    fresh checkout, or several rank processes starting together, do not each spend seconds compiling it
    (``scripts/setup.sh`` runs this once)."""
    if numba is None:
        raise RuntimeError(NUMBA_ERROR)
    x = torch.zeros(1, 1, 1, 16)
    chunk_kda_cpu(x, x, x, x, torch.zeros(1, 1, 1), output_final_state=True)
