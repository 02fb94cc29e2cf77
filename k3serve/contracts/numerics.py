"""The numerics mode: one frozen value, read from the deploy file (`numerics:`) or `--deterministic`, passed down.

``default``: every path computes the reference's maths in its own rounding order (GEMM shapes that follow the
batch, chunk boundaries, TP sums, the absorbed MLA decode): logits agree with the reference to ~1e-5 and tokens
are equal except at near-ties (tests/exactness.py states the rule).

``deterministic``: logits and tokens are bit-identical to the reference generator's on every path at any
divisible (prefill TP, decode TP), because every operation is computed in shapes and orders that do not depend
on batching, chunking, cache hits or TP (docs/numerics.md):

* linear layers and expert matmuls with each row's bits those of a fixed row tile (one GEMM of at least 16 rows,
  measured to give a row the bits of its 16 .. ``row_tile``-row tile; reductions of at least ``packed_min_k``
  on oneDNN's packed GEMM, whose rows keep their bits from 2 rows on), split into the ``shard_units`` column /
  reduction units of the largest supported TP; partial sums of row-parallel layers are gathered and added in
  unit order on every TP (including 1);
* MLA attention over fixed ``key_block``-key blocks at absolute positions, one softmax order for prefill and
  decode (the absorbed form on both: scores against the cached latent rows);
* prefill chunk ends (budgets, cache checkpoints) on the ``grid`` of absolute positions, a multiple of the KDA
  chunk size, so the chunked KDA kernel sees the same chunks as one-shot prefill;
* ``threads`` intra-op threads during every forward (a GEMM of a fixed shape still rounds by thread count);
* generated tokens are replayed through decode steps on any resume (failover), never re-prefilled;
* a speculative verify runs the same operators, so its rows and the committed state are plain decode's bits.

This module is plain data: the operators live in ``model/deterministic.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class NumericsError(ValueError):
    """A bad numerics setting; the message names the field."""


class NumericsMode(str, Enum):
    DEFAULT = "default"
    DETERMINISTIC = "deterministic"


class GemmLibrary(str, Enum):
    """The default mode's fp32 CPU GEMM (model/cpu_gemm.py): ``auto`` oneDNN's packed GEMM for calls of 2 rows and
    more, and for one row unless the CPU is GenuineIntel (MKL's GEMV is faster there); ``onednn`` every call;
    ``mkl`` ``F.linear`` everywhere (no packed weight copies)."""

    AUTO = "auto"
    ONEDNN = "onednn"
    MKL = "mkl"


@dataclass(frozen=True)
class Numerics:
    mode: NumericsMode = NumericsMode.DEFAULT
    row_tile: int = 16  # most rows per GEMM tile in deterministic mode (>= 16; the last zero-padded)
    key_block: int = 64  # MLA keys per attention block, at absolute positions 0, key_block, ...
    grid: int = 64  # prefill chunk ends lie on multiples of this (a multiple of the KDA chunk size, 32)
    threads: int = 1  # torch intra-op threads during a deterministic forward
    # linears whose reduction (K, or K / units of a row-parallel unit) is at least this long run on oneDNN's
    # packed GEMM, whose rows keep their bits from 2 rows on (model/packed_gemm.py); 0: every linear on MKL tiles
    packed_min_k: int = 1024
    # and weights whose GEMM shape does not change with TP (routed experts, replicated projections, row-parallel
    # units) of at least this many elements
    packed_min_elements: int = 1 << 16
    # numerics default: the fp32 CPU GEMM library (GemmLibrary; "auto", "onednn", "mkl")
    default_gemm: GemmLibrary = GemmLibrary.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.mode, NumericsMode):
            raise NumericsError(f"numerics: mode must be one of {[m.value for m in NumericsMode]}, "
                                f"got {self.mode!r}")
        if not isinstance(self.default_gemm, GemmLibrary):
            try:
                object.__setattr__(self, "default_gemm", GemmLibrary(self.default_gemm))
            except ValueError:
                raise NumericsError(f"numerics.default_gemm must be one of {[g.value for g in GemmLibrary]}, "
                                    f"got {self.default_gemm!r}") from None
        for name in ("row_tile", "key_block", "grid", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise NumericsError(f"numerics.{name} must be a positive integer, got {v!r}")
        for name in ("packed_min_k", "packed_min_elements"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise NumericsError(f"numerics.{name} must be a non-negative integer (0: off), got {v!r}")
        if self.row_tile % 16:  # model/deterministic.MIN_TILE: fewer rows take another GEMM kernel on some CPUs
            raise NumericsError(f"numerics.row_tile must be a multiple of 16, got {self.row_tile}")
        if self.grid % 32:
            raise NumericsError(f"numerics.grid must be a multiple of the KDA chunk size 32, got {self.grid}")

    @property
    def deterministic(self) -> bool:
        return self.mode is NumericsMode.DETERMINISTIC

    @property
    def packs(self) -> bool:
        """Whether some linears run on oneDNN's packed GEMM (model/packed_gemm.py)."""
        return bool(self.packed_min_k or self.packed_min_elements)

    @property
    def chunk_grid(self) -> int:
        """Prefill chunk ends must be multiples of this (1: anywhere)."""
        return self.grid if self.deterministic else 1

    @classmethod
    def parse(cls, value: object) -> "Numerics":
        """From the deploy file's `numerics:` value: "default" | "deterministic", or a mapping with ``mode`` and
        any of the fields (``{mode: deterministic, packed_min_k: 0}``); an unknown key is refused by name."""
        if isinstance(value, dict):
            fields = {f for f in cls.__dataclass_fields__ if f != "mode"}
            unknown = sorted(set(value) - fields - {"mode"})
            if unknown:
                raise NumericsError(f"numerics: unknown key {unknown[0]!r} (known: mode, {', '.join(sorted(fields))})")
            rest = {k: v for k, v in value.items() if k != "mode"}
            return cls(cls.parse(value.get("mode", NumericsMode.DEFAULT.value)).mode, **rest)
        try:
            return cls(NumericsMode(value))
        except ValueError:
            raise NumericsError(f"numerics must be one of {[m.value for m in NumericsMode]}, got {value!r}") from None


DEFAULT_NUMERICS = Numerics()
DETERMINISTIC = Numerics(NumericsMode.DETERMINISTIC)

