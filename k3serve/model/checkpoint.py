"""Checkpoints on disk: make random ones, read real ones lazily (per TP rank), inspect without loading.

Layout (Hugging Face convention, the public names from :mod:`k3serve.model.names`)::

    out_dir/
      config.json                          cfg.to_hf_dict()
      model.safetensors                    shards == 1
      model-00001-of-0000N.safetensors     shards == N > 1, contiguous runs of tensors in spec order,
      ...                                  balanced by bytes
      model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: file}}

Tensors are stored in ``cfg.torch_dtype`` except specs marked fp32 (A_log, dt_bias, conv weights, router bias).

Reading never loads a whole file: :class:`CheckpointReader` opens shards with ``safe_open`` (mmap) on first
use and :meth:`CheckpointReader.read_local` reads only the rows/columns a rank owns. :func:`inspect_checkpoint`
reads nothing but the JSON headers of the weight files.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.config_file import CONFIG_FILE, load_config  # noqa: F401 - re-exported: callers read it here
from k3serve.model.init import make_tensor, storage_dtype
from k3serve.model.names import SplitKind, TensorSpec, checkpoint_specs
from k3serve.model.quant_check import quant_summary

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # fullmatch: `$` lets a trailing newline by
MLA_CACHE_BYTES = 2  # MLA latent cache is kept in bf16

# safetensors dtype tags -> bytes per element
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "U16": 2, "U32": 4, "U64": 8}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the config says: missing files or tensors, wrong shapes."""


def shard_file_name(i: int, n: int) -> str:
    """Name of shard `i` (0-based) of `n`: ``model-00001-of-00003.safetensors``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# ----------------------------------------------------------------------------------------------- make
def _assign_shards(specs: list[TensorSpec], sizes: list[int], shards: int) -> list[int]:
    """Shard index per spec: contiguous, non-decreasing, every shard non-empty, balanced by bytes."""
    total = sum(sizes) or 1
    n = len(specs)
    out: list[int] = []
    start = 0
    prev = 0
    for i, size in enumerate(sizes):
        ideal = min(shards - 1, (start + size // 2) * shards // total)  # shard holding the tensor's midpoint
        lo = max(prev, shards - (n - i))  # leave at least one tensor for each remaining shard
        hi = 0 if i == 0 else min(prev + 1, shards - 1)
        s = min(max(ideal, lo), hi)
        out.append(s)
        prev = s
        start += size
    return out


def _bytes_of(spec: TensorSpec, cfg: ModelConfig) -> int:
    return spec.numel * torch.empty((), dtype=storage_dtype(spec, cfg)).element_size()


def _remove_old_weights(out_dir: Path) -> None:
    for p in out_dir.iterdir():
        if p.is_file() and (p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(p.name)):
            p.unlink()


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates 0600 files; checkpoints are meant to be shared
    os.replace(tmp, path)


def make_checkpoint(cfg: ModelConfig, out_dir: str | Path, *, seed: int = 0, shards: int = 1) -> Path:
    """Write a random checkpoint of `cfg` (config.json + safetensors) to `out_dir` and return its path.

    Tensor values depend only on (seed, name) (see :mod:`k3serve.model.init`), so the shard count changes
    the files, never the values. Weight files of an earlier checkpoint in `out_dir` are replaced.
    Memory use is one shard's tensors at a time.
    """
    cfg.check_loadable()
    specs = checkpoint_specs(cfg)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > len(specs):
        raise ValueError(f"shards = {shards} exceeds the number of tensors ({len(specs)})")
    for spec in specs:  # fail before writing anything on a dtype we cannot store
        storage_dtype(spec, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(out)

    sizes = [_bytes_of(s, cfg) for s in specs]
    if shards == 1:
        _save_atomic({s.name: make_tensor(s, cfg, seed) for s in specs}, out / SINGLE_FILE)
    else:
        assign = _assign_shards(specs, sizes, shards)
        weight_map: dict[str, str] = {}
        for k in range(shards):
            fname = shard_file_name(k, shards)
            part = {s.name: make_tensor(s, cfg, seed) for s, a in zip(specs, assign) if a == k}
            _save_atomic(part, out / fname)
            weight_map.update(dict.fromkeys(part, fname))
            del part
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return out


def save_checkpoint(cfg: ModelConfig, tensors: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write given tensors (full shapes, e.g. trained weights) as a one-file checkpoint of `cfg` in `out_dir`.

    Every spec of `cfg` must be present with its full shape; each is stored in its storage dtype, so the result
    reads exactly like a :func:`make_checkpoint` one. Earlier weight files in `out_dir` are replaced.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {}
    for spec in checkpoint_specs(cfg):
        t = tensors.get(spec.name)
        if t is None:
            raise CheckpointError(f"save_checkpoint: tensor {spec.name!r} is missing")
        if tuple(t.shape) != tuple(spec.shape):
            raise CheckpointError(f"save_checkpoint: {spec.name!r} has shape {list(t.shape)}, "
                                  f"expected {list(spec.shape)}")
        data[spec.name] = t.detach().to("cpu", storage_dtype(spec, cfg)).contiguous()
    _save_atomic(data, out / SINGLE_FILE)  # replaces an earlier single file atomically (resumable runs)
    for p in out.iterdir():  # an earlier sharded checkpoint would shadow the new file
        if p.is_file() and (p.name == INDEX_FILE or _SHARD_RE.fullmatch(p.name)):
            p.unlink()
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------------------------- read
def _check_shard_name(index: Path, name: str, fname: object) -> None:
    """A shard named by an index is a relative path inside the checkpoint dir: never absolute, never through
    '..' (an index from elsewhere must not make the loader open any file it can reach). Checked on the name, so
    symlinked shards (a Hugging Face cache snapshot) still load."""
    if not isinstance(fname, str) or not fname:
        raise CheckpointError(f"{index}: weight_map[{name!r}] must be a file name, got {fname!r}")
    parts = PurePosixPath(fname.replace("\\", "/")).parts
    if PurePosixPath(fname).is_absolute() or PureWindowsPath(fname).is_absolute() or PureWindowsPath(fname).drive \
            or ".." in parts:
        raise CheckpointError(f"{index}: weight_map[{name!r}] = {fname!r} leaves the checkpoint directory")


def _weight_map(ckpt_dir: Path) -> dict[str, str] | None:
    """name -> file for a checkpoint dir from its index (or the single file's header); None if no weights."""
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
            wm = raw["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        for name, fname in wm.items():
            _check_shard_name(index, str(name), fname)
        return {str(k): str(v) for k, v in wm.items()}
    single = ckpt_dir / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE)
    return None


def read_safetensors_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype tag, shape)}`` from a .safetensors file's JSON header, reading no tensor data."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 1024 * 1024:
                raise CheckpointError(f"{path} is not a safetensors file (header length {n})")
            raw = f.read(n)
    except FileNotFoundError as e:
        raise CheckpointError(f"weight file {path} is missing") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


class CheckpointReader:
    """Lazy reader of a checkpoint dir (``model.safetensors`` or an index with shards).

    Shard files are opened (mmap, header only) on first access to one of their tensors; tensor data is
    read only by :meth:`read` (whole tensor) and :meth:`read_local` (one TP rank's slice).
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_file() and path.name == CONFIG_FILE:
            path = path.parent
        if not path.exists():
            raise CheckpointError(f"no such checkpoint: {path}")
        if path.is_file():  # a bare .safetensors file
            self.dir = path.parent
            self._map = dict.fromkeys(read_safetensors_header(path), path.name)
        else:
            self.dir = path
            wm = _weight_map(path)
            if wm is None:
                raise CheckpointError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}")
            self._map = wm
        self._handles: dict[str, Any] = {}

    # -- lookup
    def names(self) -> list[str]:
        return sorted(self._map)

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def __len__(self) -> int:
        return len(self._map)

    def file_of(self, name: str) -> str:
        try:
            return self._map[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {self.dir}") from None

    def _handle(self, name: str):
        fname = self.file_of(name)
        h = self._handles.get(fname)
        if h is None:
            fpath = self.dir / fname
            if not fpath.is_file():
                raise CheckpointError(f"weight file {fpath} (holding {name!r}) is missing")
            try:
                h = safe_open(str(fpath), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"cannot open {fpath}: {e}") from e
            self._handles[fname] = h
        return h

    def _slice(self, name: str):
        try:
            return self._handle(name).get_slice(name)
        except CheckpointError:
            raise
        except Exception as e:  # listed in the index but not in the shard
            raise CheckpointError(f"tensor {name!r} is missing from {self.dir / self.file_of(name)}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors dtype tag (``F32``, ``BF16``, ``U8`` ...)."""
        return self._slice(name).get_dtype()

    # -- data
    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, as stored."""
        self._slice(name)  # clear error if missing
        return self._handle(name).get_tensor(name)

    def check(self, spec: TensorSpec) -> None:
        """Raise CheckpointError unless `spec.name` exists with `spec.shape`."""
        got = self.shape(spec.name)
        if got != tuple(spec.shape):
            raise CheckpointError(
                f"tensor {spec.name!r} has shape {list(got)} in {self.dir}, expected {list(spec.shape)}")

    def read_local(self, spec: TensorSpec, rank: int, tp: int, *, num_experts: int | None = None) -> torch.Tensor:
        """Rank `rank`'s part of `spec` under tensor parallelism `tp`, reading only that part from disk.

        Shape is ``spec.local_shape(tp)``. Expert tensors are returned whole; pass `num_experts` to also
        check that `rank` owns the expert.
        """
        if tp < 1 or not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not in 0..{tp - 1}")
        self.check(spec)
        kind = spec.split.kind
        if kind is SplitKind.SHARD and spec.shape[spec.split.dim] % tp:
            raise CheckpointError(f"tensor {spec.name!r}: dim {spec.split.dim} of shape {list(spec.shape)} "
                                  f"does not split over {tp} ranks")
        if kind is SplitKind.HEAD_PREFIX and spec.split.count % tp:
            raise CheckpointError(f"tensor {spec.name!r}: {spec.split.count} heads do not split over {tp} ranks")
        if kind is SplitKind.EXPERT and num_experts is not None and not spec.owned_by(rank, tp, num_experts):
            raise CheckpointError(f"tensor {spec.name!r} belongs to another rank than {rank} of {tp}")
        if kind in (SplitKind.REPLICATED, SplitKind.EXPERT):
            return self.read(spec.name)
        part = self._slice(spec.name)[spec.local_index(rank, tp)]
        return part.contiguous()

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -------------------------------------------------------------------------------------------- inspect
def serving_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Per-request serving state: the fixed KDA state (fp32) and MLA cache bytes per token (bf16)."""
    return {
        "kda_state_bytes_per_request": cfg.num_kda_layers * cfg.kda_num_heads * cfg.kda_head_block_floats * 4,
        "mla_bytes_per_token": cfg.num_mla_layers * cfg.mla_latent_dim * MLA_CACHE_BYTES,
    }


def _header_inventory(ckpt_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    wm = _weight_map(ckpt_dir)
    if wm is None:
        return None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fname in sorted(set(wm.values())):
        header = read_safetensors_header(ckpt_dir / fname)
        for name, entry in header.items():
            if wm.get(name) == fname:
                out[name] = entry
    # names in the index but absent from their shard count as missing: they are not in `out`
    return out


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """Summary of a checkpoint dir or a bare config.json, without loading or allocating any weights.

    Keys: model_type, num_layers, kda_layers / mla_layers (0-indexed), num_kda_layers, num_mla_layers,
    num_tensors and num_params (expected by the config; an MXFP4 byte is 2 params), the per-request serving
    sizes, the sizes of :func:`k3serve.model.quant_check.quant_summary` and weights_present;
    when weights are present also missing_tensors, unexpected_tensors, shape_mismatches (counts),
    missing_sample (a few names), num_files and weights_bytes.
    """
    path = Path(path)
    cfg = load_config(path)
    specs = checkpoint_specs(cfg)
    info: dict[str, Any] = {
        "path": str(path),
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "num_kda_layers": cfg.num_kda_layers,
        "num_mla_layers": cfg.num_mla_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_experts": cfg.num_experts,
        "torch_dtype": cfg.torch_dtype,
        "quantization": cfg.quantization or None,
        "num_tensors": len(specs),
        "num_params": sum(s.params for s in specs),
        **serving_sizes(cfg),
    }
    inventory = _header_inventory(path) if path.is_dir() else None
    info.update(quant_summary(cfg, specs, inventory))
    info["weights_present"] = inventory is not None
    if inventory is not None:
        expected = {s.name: tuple(s.shape) for s in specs}
        missing = [n for n in expected if n not in inventory]
        info["missing_tensors"] = len(missing)
        info["unexpected_tensors"] = sum(1 for n in inventory if n not in expected)
        info["shape_mismatches"] = sum(1 for n, (_, shp) in inventory.items()
                                       if n in expected and shp != expected[n])
        info["missing_sample"] = missing[:5]
        files = sorted({p for p in path.iterdir() if p.name == SINGLE_FILE or _SHARD_RE.fullmatch(p.name)})
        info["num_files"] = len(files)
        info["weights_bytes"] = sum(p.stat().st_size for p in files)
    return info
