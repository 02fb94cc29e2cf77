"""What one transfer moves: the state geometry and the transfer's identity (frozen, validated at creation).

```
 KDA, per prefill rank p:  [kda_layers, kda_heads/P, kda_block_floats] fp32   (Handoff.kda[p])
 KDA, per decode rank r:   [kda_layers, kda_heads/D, kda_block_floats] fp32   (staging, then kda_store[slot])
 MLA, every rank:          [mla_layers, num_tokens, mla_dim] mla_dtype        (Handoff.mla, then pages)
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3serve.transfer.plan import PlanError, check_layout

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KDA_DTYPE = "float32"
MAX_ID_LEN = 128
_ID_RE = re.compile(r"[A-Za-z0-9._:/@+-]+")  # fullmatch: `$` lets a trailing newline by
_U32 = (1 << 32) - 1


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise PlanError(f"dtype {dtype} cannot be transferred (supported: {', '.join(DTYPES)})")


def elem_bytes(name: str) -> int:
    return torch.empty((), dtype=DTYPES[name]).element_size()


def check_id(field: str, value: str) -> None:
    """Transfer and request ids: 1..128 printable characters, no spaces (they go into metadata and logs)."""
    if not value or len(value) > MAX_ID_LEN or not _ID_RE.fullmatch(value):
        raise PlanError(f"{field} must be 1..{MAX_ID_LEN} characters of [A-Za-z0-9._:/@+-], got {value!r}")


@dataclass(frozen=True)
class StateGeometry:
    """Shapes of one request's state (see the module diagram)."""

    kda_layers: int
    kda_heads: int
    kda_block_floats: int
    mla_layers: int
    num_tokens: int
    mla_dim: int
    mla_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("kda_layers", "kda_heads", "kda_block_floats", "mla_layers", "num_tokens", "mla_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v <= _U32:
                raise PlanError(f"geometry.{name} must be an int in [0, 2^32), got {v!r}")
        if self.kda_heads <= 0 or self.kda_block_floats <= 0 or self.mla_dim <= 0:
            raise PlanError(f"geometry needs positive kda_heads, kda_block_floats and mla_dim: {self}")
        if self.mla_dtype not in DTYPES:
            raise PlanError(f"geometry.mla_dtype must be one of {', '.join(DTYPES)}, got {self.mla_dtype!r}")

    @property
    def kda_row_bytes(self) -> int:
        """One (layer, head) block."""
        return self.kda_block_floats * 4

    @property
    def mla_row_bytes(self) -> int:
        """One (layer, token) latent row."""
        return self.mla_dim * elem_bytes(self.mla_dtype)

    def kda_shape(self, tp: int) -> tuple[int, int, int]:
        return (self.kda_layers, self.kda_heads // tp, self.kda_block_floats)

    def mla_shape(self) -> tuple[int, int, int]:
        return (self.mla_layers, self.num_tokens, self.mla_dim)

    def rank_bytes(self, tp: int) -> int:
        """Bytes one rank of a TP=tp group holds (its KDA heads + all MLA rows)."""
        l, h, b = self.kda_shape(tp)
        return l * h * b * 4 + self.mla_layers * self.num_tokens * self.mla_row_bytes

    def without_tokens(self) -> tuple:
        """Everything but num_tokens: what a decode group's model fixes."""
        return (self.kda_layers, self.kda_heads, self.kda_block_floats, self.mla_layers, self.mla_dim,
                self.mla_dtype)

    @classmethod
    def of_state(cls, kda_parts: list[torch.Tensor] | tuple[torch.Tensor, ...], mla: torch.Tensor) -> "StateGeometry":
        """From a handoff's state: kda_parts P x `[L_kda, H/P, block]` fp32, mla `[L_mla, n, D]`."""
        if not kda_parts:
            raise PlanError("a transfer needs at least one prefill rank's KDA state")
        l, hp, b = kda_parts[0].shape
        for i, t in enumerate(kda_parts):
            if tuple(t.shape) != (l, hp, b) or t.dtype != torch.float32:
                raise PlanError(f"kda[{i}] is {tuple(t.shape)} {t.dtype}; expected {(l, hp, b)} float32")
        if mla.dim() != 3:
            raise PlanError(f"mla must be [L_mla, num_tokens, D], got shape {tuple(mla.shape)}")
        return cls(l, hp * len(kda_parts), b, mla.shape[0], mla.shape[1], mla.shape[2], dtype_name(mla.dtype))

    @classmethod
    def of_config(cls, cfg, num_tokens: int) -> "StateGeometry":
        """From a ModelConfig (k3serve.model.config) and a prompt length."""
        return cls(cfg.num_kda_layers, cfg.kda_num_heads, cfg.kda_head_block_floats, cfg.num_mla_layers,
                   num_tokens, cfg.mla_latent_dim, cfg.torch_dtype)


# A chunk's payload size (one gRPC message each). Chosen by CPU seconds per GB against the bare gRPC baseline at
# the same message size (docs/transfer.md): 4 MiB has a quarter of 1 MiB's per-message Python work on both ends.
# The receivers' StagingLimits.max_chunk_bytes (4 MiB by default) must be at least this.
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class TransferSpec:
    """One transfer: P prefill ranks -> D decode ranks of one request's state. Identical in every stream."""

    transfer_id: str
    request_id: str
    geometry: StateGeometry
    prefill_tp: int
    decode_tp: int
    page_tokens: int = 64
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        check_id("transfer_id", self.transfer_id)
        check_id("request_id", self.request_id)
        check_layout(self.geometry.kda_heads, self.prefill_tp, self.decode_tp)
        if not 0 < self.page_tokens <= 1 << 20:
            raise PlanError(f"page_tokens must be in [1, 2^20], got {self.page_tokens}")
        if not 4096 <= self.chunk_bytes <= 1 << 30:
            raise PlanError(f"chunk_bytes must be in [4 KiB, 1 GiB], got {self.chunk_bytes}")

    @property
    def pages(self) -> int:
        return -(-self.geometry.num_tokens // self.page_tokens)

    @property
    def pages_per_range(self) -> int:
        """MLA pages per round-robin range: as many as fit in one chunk (at least one)."""
        return max(1, self.chunk_bytes // (self.page_tokens * self.geometry.mla_row_bytes))
