"""Quantized checkpoints: which form each routed expert weight is in, decided by the tensors present, and
the sizes ``inspect`` reports.

A checkpoint is MXFP4 when its routed expert weights are stored as ``weight_packed`` + ``weight_scale`` uint8
pairs. The config must say the same: :func:`check_tensor_forms` refuses a checkpoint whose config and tensors
disagree, naming the first tensor that does (a full-precision ``.weight`` where the config declares MXFP4,
a packed pair under a config without ``quantization_config``, or a pair stored in another dtype than uint8).
"""

from __future__ import annotations

from typing import Any, Callable

from k3serve.model.config import ModelConfig
from k3serve.model.names import (PACKED_SUFFIX, SCALE_SUFFIX, Packing, TensorSpec, checkpoint_specs,
                                 mxfp4_names, weight_name_of)
from k3serve.model.quant_config import PUBLISHED_IGNORE, config_targets

# dtype tag (safetensors) of both halves of an MXFP4 pair
PAIR_DTYPE = "U8"


def check_tensor_forms(cfg: ModelConfig, names: set[str], dtype_of: Callable[[str], str],
                       error: type[ValueError]) -> None:
    """Raise `error` unless every tensor of the inventory is present in the form the config declares.

    names: the checkpoint's tensor names; dtype_of(name): its safetensors dtype tag (read from headers only).
    """
    declared = f"quantization_config.format = {cfg.quantization!r}" if cfg.quantization else \
        "no quantization_config"
    for spec in checkpoint_specs(cfg):
        if spec.packing is Packing.NONE:
            if spec.name in names:
                continue
            packed, _ = mxfp4_names(spec.name) if spec.name.endswith(".weight") else (None, None)
            if packed is not None and packed in names:
                raise error(f"config and tensors disagree: the config has {declared} but {packed!r} is an MXFP4 "
                            f"packed weight (the config expects full-precision {spec.name!r})")
            continue  # plainly missing: the reader's shape check names it
        if spec.name in names:
            tag = dtype_of(spec.name)
            if tag != PAIR_DTYPE:
                raise error(f"tensor {spec.name!r} is stored as {tag}; MXFP4 {spec.packing.value} must be uint8")
            continue
        full = weight_name_of(spec.name)
        if full in names:
            raise error(f"config and tensors disagree: the config has {declared} but {full!r} is stored in full "
                        f"precision ({dtype_of(full)}), expected {spec.name!r}")
    for name in names:  # a packed pair where the inventory has none (e.g. a packed shared expert)
        if name.endswith((PACKED_SUFFIX, SCALE_SUFFIX)) and not _is_expected_pair(cfg, name):
            raise error(f"tensor {name!r} is MXFP4 but {declared} does not quantize {weight_name_of(name)!r}")


def _is_expected_pair(cfg: ModelConfig, name: str) -> bool:
    return bool(cfg.quantization) and ".experts." in name


def spec_bytes(spec: TensorSpec, cfg: ModelConfig) -> int:
    """Bytes `spec` takes in a checkpoint of `cfg` (its storage dtype)."""
    from k3serve.model.init import storage_dtype  # init imports names only; kept local to stay a leaf

    return spec.numel * storage_dtype(spec, cfg).itemsize


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a full-precision weight is an nn.Linear weight in the public modelling code (2-D ``.weight``,
    not the embedding and not the MoE router, which is its own module)."""
    return (len(shape) == 2 and name.endswith(".weight") and not name.endswith("embed_tokens.weight")
            and not name.endswith("block_sparse_moe.gate.weight"))


def quant_summary(cfg: ModelConfig, specs: list[TensorSpec],
                  inventory: dict[str, tuple[str, tuple[int, ...]]] | None) -> dict[str, Any]:
    """Sizes of the checkpoint `cfg` describes (`specs` = its inventory), its MXFP4 part, and the same model
    with every weight in bf16 (fp32-kept tensors stay fp32).

    Keys: expected_weights_bytes, bf16_weights_bytes, mxfp4_weights (count of weights stored as pairs),
    mxfp4_params, mxfp4_bytes, routed_expert_bf16_bytes, quant_scale_rule; for quantized configs also the
    ignore list's reading (``ignore_list_targets`` / ``ignore_list_targets_kept_full_precision`` + a sample of
    name patterns); with weights present, mxfp4_tensors_present (uint8 halves found) and their bytes.
    """
    expected = bf16 = expert_bf16 = mx_params = mx_bytes = n_pairs = 0
    targets = kept = 0
    kept_patterns: set[str] = set()
    verdict: dict[str, bool] = {}  # name pattern -> targeted by the ignore list
    for s in specs:
        nbytes = spec_bytes(s, cfg)
        expected += nbytes
        if s.packing is Packing.MXFP4_SCALE:
            mx_bytes += nbytes
            continue
        fp_bytes = 4 * s.params if s.fp32 else 2 * s.params
        bf16 += fp_bytes
        if ".experts." in s.name:
            expert_bf16 += fp_bytes
        if s.packing is Packing.MXFP4_PACKED:
            n_pairs += 1
            mx_params += s.params
            mx_bytes += nbytes
        if cfg.quantization and _is_linear(weight_name_of(s.name), s.weight_shape):
            pat = _pattern(weight_name_of(s.name)[: -len(".weight")])
            hit = verdict.get(pat)
            if hit is None:
                hit = verdict[pat] = config_targets(pat, PUBLISHED_IGNORE)
            if hit:
                targets += 1
                if s.packing is Packing.NONE:
                    kept += 1
                    kept_patterns.add(pat + ".weight")
    info: dict[str, Any] = {
        "expected_weights_bytes": expected,
        "bf16_weights_bytes": bf16,
        "mxfp4_weights": n_pairs,
        "mxfp4_params": mx_params,
        "mxfp4_bytes": mx_bytes,
        "routed_expert_bf16_bytes": expert_bf16,
        "quant_scale_rule": cfg.quant_scale_rule or None,
    }
    if cfg.quantization:
        info["ignore_list_targets"] = targets
        info["ignore_list_targets_kept_full_precision"] = kept
        info["ignore_list_kept_sample"] = sorted(kept_patterns)[:6]
    if inventory is not None:
        present = [n for n, (tag, _) in inventory.items() if n.endswith((PACKED_SUFFIX, SCALE_SUFFIX)) and tag == PAIR_DTYPE]
        info["mxfp4_tensors_present"] = len(present)
        info["mxfp4_bytes_present"] = sum(_numel(inventory[n][1]) for n in present)
    return info


def _pattern(name: str) -> str:
    """A module name with its layer / expert numbers folded: model.layers.3.x -> model.layers.*.x."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
