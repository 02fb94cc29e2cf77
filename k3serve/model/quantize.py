"""Checkpoint conversions: full precision -> MXFP4 routed experts (PTQ) and back (``checkpoint quantize`` /
``checkpoint dequantize``).

Only the routed experts change form; every other tensor is copied (cast to the output dtype when one is
given). PTQ quantises each expert weight from its stored values with the chosen scale rule
(:mod:`k3serve.kernels.mxfp4`) and records the rule in the output config. Dequantisation writes the exact
E2M1 x E8M0 values (exact in fp32 and bf16, whose exponent range covers E8M0's): quantize -> dequantize ->
quantize gives the same bytes.

Both build the output in memory and write one safetensors file (the models k3serve trains are small; a
sharded streaming writer would be the change for large ones).
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.kernels.mxfp4 import SCALE_RULES, dequantize_mxfp4, quantize_mxfp4
from k3serve.model.checkpoint import CheckpointError, CheckpointReader, load_config, save_checkpoint
from k3serve.model.config import ModelConfig
from k3serve.model.names import Packing, checkpoint_specs, mxfp4_names, weight_name_of
from k3serve.model.quant_check import check_tensor_forms
from k3serve.model.quant_config import MXFP4_FORMAT


def _open(path: str | Path) -> tuple[ModelConfig, CheckpointReader]:
    cfg = load_config(path)
    cfg.check_loadable()
    reader = CheckpointReader(path)
    check_tensor_forms(cfg, set(reader.names()), reader.dtype, CheckpointError)
    for spec in checkpoint_specs(cfg):
        reader.check(spec)
    return cfg, reader


def quantize_checkpoint(src: str | Path, out: str | Path, rule: str = "ocp", dtype: str | None = None) -> Path:
    """PTQ: write `src` (full precision) to `out` with MXFP4 routed experts; `dtype` casts the other tensors."""
    if rule not in SCALE_RULES:
        raise ValueError(f"--scale-rule must be one of {SCALE_RULES}, got {rule!r}")
    cfg, reader = _open(src)
    if cfg.quantization:
        raise CheckpointError(f"{src} is already quantized ({cfg.quantization})")
    out_cfg = cfg.replace(quantization=MXFP4_FORMAT, quant_scale_rule=rule, torch_dtype=dtype or cfg.torch_dtype)
    out_cfg.check_loadable()
    tensors: dict[str, torch.Tensor] = {}
    with reader:
        for spec in checkpoint_specs(out_cfg):
            if spec.packing is Packing.MXFP4_SCALE:
                continue  # written with its packed half
            if spec.packing is Packing.MXFP4_PACKED:
                name = weight_name_of(spec.name)
                packed, scales = quantize_mxfp4(reader.read(name), rule)
                p_name, s_name = mxfp4_names(name)
                tensors[p_name], tensors[s_name] = packed, scales
            else:
                tensors[spec.name] = reader.read(spec.name)
    return save_checkpoint(out_cfg, tensors, out)


def dequantize_checkpoint(src: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write MXFP4 checkpoint `src` to `out` with full-precision routed experts (the exact dequantised values)."""
    cfg, reader = _open(src)
    if not cfg.quantization:
        raise CheckpointError(f"{src} is not quantized (its config has no quantization_config)")
    out_cfg = cfg.replace(quantization="", quant_scale_rule="", torch_dtype=dtype or cfg.torch_dtype)
    tensors: dict[str, torch.Tensor] = {}
    with reader:
        for spec in checkpoint_specs(cfg):
            if spec.packing is Packing.MXFP4_SCALE:
                continue
            if spec.packing is Packing.MXFP4_PACKED:
                name = weight_name_of(spec.name)
                p_name, s_name = mxfp4_names(name)
                tensors[name] = dequantize_mxfp4(reader.read(p_name), reader.read(s_name), torch.float32)
            else:
                tensors[spec.name] = reader.read(spec.name)
    return save_checkpoint(out_cfg, tensors, out)


def cast_checkpoint(src: str | Path, out: str | Path, dtype: str) -> Path:
    """Copy checkpoint `src` to `out` with its full-precision tensors stored in `dtype` (MXFP4 pairs unchanged)."""
    cfg, reader = _open(src)
    out_cfg = cfg.replace(torch_dtype=dtype)
    with reader:
        tensors = {s.name: reader.read(s.name) for s in checkpoint_specs(cfg)}
    return save_checkpoint(out_cfg, tensors, out)
