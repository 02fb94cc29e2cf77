"""Deterministic random initialisation of checkpoint tensors.

Every tensor's values depend only on ``(seed, name)``: the generator for a tensor is seeded with
``xxh64(name, seed)``. So a checkpoint made with 1 shard or 7, a tensor made alone in a test, and a rank's
slice cut from the full tensor all agree bit for bit.

Scales are chosen so a tiny random model is numerically tame and still produces varied next tokens:

==============================================  =========================================================
tensor (by name)                                values
==============================================  =========================================================
``embed_tokens.weight``                         N(0, 1)
lm_head                                         N(0, 1/sqrt(d))
``*norm.weight`` (all RMSNorm weights)          1 + N(0, 0.02)
``A_log``                                       log(U(1, 16)) for the H real heads; K3's ``[head_dim]``
                                                vector is zero past the first H entries
``dt_bias``                                     N(0, 0.1)
``*_conv1d.weight``                             N(0, 0.5)
``gate.e_score_correction_bias``                N(0, 0.01)
``*_res_proj.weight`` (AttnRes pseudo-queries)  N(0, 0.05)
any other weight (linear ``[out, in]``)         N(0, 1/sqrt(in))   (in = last dim)
==============================================  =========================================================

Values are drawn in fp32; :func:`storage_dtype` gives the dtype a checkpoint stores them in. The MXFP4 pair of a
quantized routed expert (``weight_packed``, ``weight_scale``) is the PTQ (OCP scale rule) of the full-precision
weight drawn under the ``.weight`` name, so a random MXFP4 checkpoint is the quantisation of the random
full-precision one with the same seed.
"""

from __future__ import annotations

import math

import torch
import xxhash

from k3serve.model.config import ModelConfig
from k3serve.model.names import Packing, SplitKind, TensorSpec, checkpoint_specs, weight_name_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

NORM_NOISE = 0.02
A_LOG_RANGE = (1.0, 16.0)


def tensor_seed(seed: int, name: str) -> int:
    """64-bit generator seed for one tensor: xxh64 of the name, keyed by the checkpoint seed."""
    return xxhash.xxh64_intdigest(name.encode("utf-8"), seed=seed & 0xFFFF_FFFF_FFFF_FFFF)


def tensor_generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(tensor_seed(seed, name))
    return g


def torch_dtype(name: str) -> torch.dtype:
    """``config.json`` dtype string -> torch dtype (float32, bfloat16, float16)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported torch_dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def storage_dtype(spec: TensorSpec, cfg: ModelConfig) -> torch.dtype:
    """The dtype a checkpoint of `cfg` stores `spec` in: uint8 for MXFP4 halves, fp32 for fp32 specs, else
    cfg.torch_dtype."""
    if spec.packing is not Packing.NONE:
        return torch.uint8
    return torch.float32 if spec.fp32 else torch_dtype(cfg.torch_dtype)


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)
    return x.add_(mean) if mean else x


def init_tensor(spec: TensorSpec, cfg: ModelConfig, generator: torch.Generator | None = None, *,
                seed: int = 0) -> torch.Tensor:
    """Random fp32 values for one checkpoint tensor, at the spec's full shape.

    Pass `generator` to draw from it, or leave it out to use ``tensor_generator(seed, spec.name)``
    (what :func:`k3serve.model.checkpoint.make_checkpoint` does).
    """
    g = generator if generator is not None else tensor_generator(seed, spec.name)
    name, shape = spec.name, spec.shape
    if name.endswith("A_log"):
        if spec.split.kind is SplitKind.HEAD_PREFIX:  # K3: [head_dim], first H entries real, zero padding
            out = torch.zeros(shape, dtype=torch.float32)
            h = spec.split.count
            out[:h] = _log_uniform_decay(h, g)
            return out
        return _log_uniform_decay(math.prod(shape), g).reshape(shape)  # Kimi-Linear: [1, 1, H, 1]
    if name.endswith("dt_bias"):
        return _normal(shape, 0.1, g)
    if name.endswith("conv1d.weight"):
        return _normal(shape, 0.5, g)
    if name.endswith("e_score_correction_bias"):
        return _normal(shape, 0.01, g)
    if name.endswith("_res_proj.weight"):
        return _normal(shape, 0.05, g)
    if name.endswith("norm.weight"):
        return _normal(shape, NORM_NOISE, g, mean=1.0)
    if name.endswith("embed_tokens.weight"):
        return _normal(shape, 1.0, g)
    if name == cfg.lm_head_name:
        return _normal(shape, 1.0 / math.sqrt(cfg.hidden_size), g)
    if len(shape) >= 2:  # linear [out, in]
        return _normal(shape, 1.0 / math.sqrt(shape[-1]), g)
    return _normal(shape, 0.02, g)  # an unclassified vector (none today): small bias-like values


def _log_uniform_decay(n: int, g: torch.Generator) -> torch.Tensor:
    lo, hi = A_LOG_RANGE
    return torch.empty(n, dtype=torch.float32).uniform_(lo, hi, generator=g).log_()


def make_tensor(spec: TensorSpec, cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    """The tensor exactly as a checkpoint made with `seed` stores it (values and dtype)."""
    if spec.packing is not Packing.NONE:
        from k3serve.kernels.mxfp4 import quantize_mxfp4

        full = TensorSpec(weight_name_of(spec.name), spec.weight_shape, spec.split)
        # the full-precision weight as the unquantized checkpoint stores it, then quantised
        w = init_tensor(full, cfg, seed=seed).to(torch_dtype(cfg.torch_dtype))
        packed, scales = quantize_mxfp4(w, "ocp")
        return packed if spec.packing is Packing.MXFP4_PACKED else scales
    return init_tensor(spec, cfg, seed=seed).to(storage_dtype(spec, cfg))


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """All tensors of a random checkpoint in memory, identical to what ``make_checkpoint`` writes."""
    return {spec.name: make_tensor(spec, cfg, seed) for spec in checkpoint_specs(cfg)}
