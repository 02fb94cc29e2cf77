"""The ``quantization_config`` of an MXFP4 checkpoint (compressed-tensors ``mxfp4-pack-quantized``), as K3 publishes it.

Written by :meth:`ModelConfig.to_hf_dict` for quantized configs and read back by ``from_hf_dict``. The weights
scheme is validated (4-bit float, group 32, symmetric, uint8 scales): a checkpoint asking for another is
refused with the field named. The PTQ scale rule (``ocp`` or ``round-up``, :mod:`k3serve.kernels.mxfp4`) is
recorded in ``config_groups.group_0.weights.observer_kwargs.scale_rule``, the scheme's free-form slot (K3's
published config leaves it empty, so its rule reads as ``""``: unrecorded).

Which tensors are quantized is decided by the tensors present (:mod:`k3serve.model.quant_check`), not by the
``ignore`` list alone: the published list leaves Linear modules targeted that K3 keeps in bf16 (the latent
projections ``routed_expert_{down,up}_proj``). :func:`config_targets` reads the list for ``inspect``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

MXFP4_FORMAT = "mxfp4-pack-quantized"

# The published K3 ignore list, verbatim (../shared/data/kimi_k3_config.json).
PUBLISHED_IGNORE = (
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*lm_head.*",
    r"re:.*vision_tower.*",
    r"re:.*mm_projector.*",
)
# Also full precision in k3serve's checkpoints (K3 keeps them in bf16 too; MODEL.md section 7), listed so a
# compressed-tensors reader does not expect them packed.
K3SERVE_IGNORE = (r"re:.*routed_expert_(down|up)_proj.*", r"re:.*_res_proj.*")

_WEIGHTS = {
    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
    "symmetric": True, "type": "float", "zp_dtype": None,
}
# weights-scheme fields whose value decides the arithmetic: anything else is refused
_REQUIRED = {"num_bits": 4, "group_size": 32, "type": "float", "symmetric": True, "strategy": "group"}


def mxfp4_quantization_config(scale_rule: str) -> dict[str, Any]:
    """The ``quantization_config`` dict k3serve writes (the published form plus the recorded scale rule)."""
    weights = copy.deepcopy(_WEIGHTS)
    if scale_rule:
        weights["observer_kwargs"] = {"scale_rule": scale_rule}
    return {
        "config_groups": {"group_0": {"format": MXFP4_FORMAT, "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": MXFP4_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(PUBLISHED_IGNORE + K3SERVE_IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def parse_quantization(text: dict[str, Any], top: dict[str, Any], error: type[ValueError]) -> tuple[str, str]:
    """(format, scale rule) a config declares: ("", "") for none; ``format`` may be one k3serve does not load
    (``ModelConfig.check_loadable`` refuses it) so such configs still inspect."""
    q = text.get("quantization_config", top.get("quantization_config"))
    if q is None:
        return "", ""
    if not isinstance(q, dict):
        raise error(f"quantization_config must be an object, got {q!r}")
    fmt = str(q.get("format") or q.get("quant_method") or "unknown")
    if fmt != MXFP4_FORMAT:
        return fmt, ""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise error("quantization_config.config_groups must be an object")
    rule = ""
    for gname, group in groups.items():
        where = f"quantization_config.config_groups.{gname}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise error(f"{where}.weights must be an object")
        if group.get("format", fmt) != MXFP4_FORMAT:
            raise error(f"{where}.format = {group.get('format')!r} is not implemented (only {MXFP4_FORMAT!r})")
        w = group["weights"]
        for key, want in _REQUIRED.items():
            if key in w and w[key] != want:
                raise error(f"{where}.weights.{key} = {w[key]!r} is not implemented ({MXFP4_FORMAT} is {want!r})")
        if group.get("input_activations") is not None:
            raise error(f"{where}.input_activations = {group['input_activations']!r} is not implemented "
                        "(weight-only MXFP4; MXFP8 activations are a kernel option, not a checkpoint scheme)")
        kwargs = w.get("observer_kwargs") or {}
        if isinstance(kwargs, dict) and kwargs.get("scale_rule"):
            rule = str(kwargs["scale_rule"])
    return fmt, rule


def config_targets(module: str, ignore: tuple[str, ...] = PUBLISHED_IGNORE) -> bool:
    """Whether a Linear module name (no ``.weight``) is quantized per the config's ignore list alone."""
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return False
        elif module == pattern:
            return False
    return True
