"""The training text: a directory or a file, split deterministically into train and held-out parts.

Default: the running interpreter's standard library sources (``sysconfig.get_paths()['stdlib']``), every
``*.py`` outside the test suites and site-packages, so every fresh machine has it. A directory is split by
file: a file is held out when the xxh64 hash of its relative path falls in the held-out fraction (stable
under added or removed files). A single text file is split by bytes: its last fraction is held out (cut at
a line start). Tokens are the byte tokenizer's: each document is ``[BOS] + its UTF-8 bytes``.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from k3serve.tokenizer import BOS_ID

HELDOUT_PERCENT = 3  # of the files (directory) or bytes (single file)
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_SNIFF = 8192


class CorpusError(ValueError):
    """A corpus path that yields no usable text; the message names it."""


@dataclass(frozen=True)
class Corpus:
    """Where the text came from and its two parts as token streams (int16 `[n]`, BOS before each document)."""

    source: str
    train: torch.Tensor
    heldout: torch.Tensor
    train_docs: int
    heldout_docs: int


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    head = path.read_bytes()[:_SNIFF]
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte char cut at the sniff boundary is still text
        return e.start >= len(head) - 3
    return True


def corpus_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """Text files under `root`, sorted by relative path; test suites and installed packages are skipped."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]) or not p.is_file():
            continue
        if (suffixes is None or p.suffix in suffixes) and _is_text(p):
            out.append(p)
    return out


def is_heldout(rel_path: str, percent: int = HELDOUT_PERCENT) -> bool:
    return xxhash.xxh64_intdigest(rel_path.encode("utf-8")) % 100 < percent


def _stream(docs: list[bytes]) -> torch.Tensor:
    parts = []
    for d in docs:
        if not d:
            continue  # an empty file (e.g. a bare __init__.py) is no document
        parts.append(torch.tensor([BOS_ID], dtype=torch.int16))
        parts.append(torch.frombuffer(bytearray(d), dtype=torch.uint8).to(torch.int16))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int16)


def load_corpus(path: str | Path | None = None, percent: int = HELDOUT_PERCENT) -> Corpus:
    """Read and split a corpus. `path` None: the stdlib's ``*.py``; a directory: its text files; a file."""
    root = stdlib_dir() if path is None else Path(path)
    if not root.exists():
        raise CorpusError(f"--corpus {root}: no such file or directory")
    if root.is_file():
        data = root.read_bytes()
        cut = data.rfind(b"\n", 0, len(data) * (100 - percent) // 100) + 1
        if cut <= 0 or cut >= len(data):
            raise CorpusError(f"--corpus {root}: too short to split into train and held-out text")
        return Corpus(str(root), _stream([data[:cut]]), _stream([data[cut:]]), 1, 1)
    files = corpus_files(root, (".py",) if path is None else None)
    train, held = [], []
    for f in files:
        (held if is_heldout(f.relative_to(root).as_posix(), percent) else train).append(f.read_bytes())
    if not train or not held:
        raise CorpusError(f"--corpus {root}: {len(files)} text file(s); need at least one train and one "
                          f"held-out file (held out: xxh64(path) % 100 < {percent})")
    return Corpus(str(root), _stream(train), _stream(held), len(train), len(held))


def unigram_entropy_bits(stream: torch.Tensor) -> float:
    """Entropy of the byte distribution of a token stream (BOS excluded), in bits per byte."""
    b = stream[stream < 256].long()
    counts = torch.bincount(b, minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum() / math.log(2))


def sample_windows(stream: torch.Tensor, batch: int, length: int, seed: int, step: int) -> torch.Tensor:
    """`batch` random windows of `length` tokens `[batch, length]` int64, a function of (seed, step) only,
    so a resumed run draws exactly the batches the uninterrupted one would have."""
    if stream.numel() <= length:
        raise CorpusError(f"training text has {stream.numel()} tokens; need more than the context ({length})")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(length)[None, :]
    return stream[idx].long()


def eval_windows(stream: torch.Tensor, length: int, max_tokens: int) -> torch.Tensor:
    """About `max_tokens` tokens of `stream` as non-overlapping windows `[n, length]` int64, spread evenly over
    the whole stream (every held-out file is sampled, not just the first), deterministic; at least one window."""
    total = stream.numel() // length
    if total == 0:
        raise CorpusError(f"held-out text has {stream.numel()} tokens; need at least {length}")
    n = min(total, max(1, max_tokens // length))
    picks = torch.arange(n) * total // n  # window indices, evenly spaced
    return stream[: total * length].long().view(total, length)[picks]
