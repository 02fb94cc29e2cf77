"""Config keys the model reads as fixed facts: a value other than the one implemented is refused.

A public config.json carries keys that change what the model computes (router activation, renormalisation,
grouped top-k, tied embeddings, ...). k3serve implements one value of each; a checkpoint that asks for another
must fail to load with the key and value named, never load and compute something else without a word.

Keys that are bookkeeping (``architectures``, ``auto_map``, ``initializer_range``, ``use_cache``, ...) or that
the NoPE model has no use for (``rope_theta`` with ``rope_scaling: null``) are not checked.
"""

from __future__ import annotations

from typing import Any

# key -> the values the model implements (the first is what `ModelConfig.to_hf_dict` writes)
FIXED: dict[str, tuple[Any, ...]] = {
    "moe_router_activation_func": ("sigmoid",),  # MoE.route: sigmoid scores
    "moe_renormalize": (True,),  # MoE.route: chosen weights renormalised to sum 1
    "topk_method": ("noaux_tc",),  # selection on scores + e_score_correction_bias, weights unbiased
    "mla_use_nope": (True,),  # no rotary embedding anywhere
    "tie_word_embeddings": (False,),  # embed_tokens and lm_head are separate tensors
    "latent_moe_use_norm": (True,),  # routed_expert_norm on the reduced latent sum
    "rope_scaling": (None,),  # NoPE: a scaling rule would mean the checkpoint expects rotary positions
}


def check_implemented(text: dict[str, Any], top: dict[str, Any], error: type[ValueError],
                      text_prefix: str = "") -> None:
    """Raise `error` naming the first key (of `text`, the text backbone, or `top`, the outer K3 dict) whose
    value the model does not implement. text_prefix: how `text` is named in messages (``text_config.``)."""
    for where, d in ((text_prefix, text), ("", top)):
        for key, allowed in FIXED.items():
            if key in d and not _matches(d[key], allowed):
                raise error(f"{where}{key} = {d[key]!r} is not implemented (k3serve implements "
                            f"{' or '.join(repr(a) for a in allowed)})")
    _check_grouped_topk(text, error, text_prefix)


def _matches(value: Any, allowed: tuple[Any, ...]) -> bool:
    # bool before int: `1 == True` in Python, but a config saying `moe_renormalize: 1` is not ours to guess
    return any(type(value) is type(a) and value == a for a in allowed)


def _check_grouped_topk(t: dict[str, Any], error: type[ValueError], prefix: str) -> None:
    """Grouped top-k (DeepSeek-V3 style) restricts each token to `topk_group` of `num_expert_group` groups.

    It is a no-op when every group is kept (`topk_group == num_expert_group`, K3 and Kimi-Linear: 1/1), which
    is the only case implemented."""
    if not t.get("use_grouped_topk", False):
        return
    groups, keep = t.get("num_expert_group", 1), t.get("topk_group", 1)
    if groups is None and keep is None:
        return
    if groups != keep:
        raise error(f"{prefix}use_grouped_topk with num_expert_group = {groups!r}, topk_group = {keep!r} is "
                    "not implemented (only topk_group == num_expert_group, where grouping is a no-op)")
