"""The checkpoint's tensor inventory, derived from the config alone.

Each tensor gets a :class:`TensorSpec`: its public name, full shape, whether it is kept in fp32, and how a
tensor-parallel rank takes its part (:class:`Split`). This is the single source of truth for

* ``k3serve checkpoint make`` (which tensors to write, at which shapes),
* ``k3serve checkpoint inspect`` (counts without allocating weights),
* the loader (which slice each TP rank reads), and the model (local parameter shapes).

TP layout (T ranks, rank r):

```
 column-parallel  W[out, in]  ──rows split──▶  rank r holds rows [r*out/T, (r+1)*out/T)   (heads are head-major)
 row-parallel     W[out, in]  ──cols split──▶  rank r holds cols [r*in/T,  (r+1)*in/T)   (then all-reduce)
 routed expert e              ──whole──────▶  owned by rank e // (E/T)                  (expert parallel)
 everything else (norms, router, latent projections, MLA kv_a, embeddings, lm_head): replicated
```

Two forms of a routed expert weight ``...experts.{e}.w{1,2,3}`` (docs/mxfp4.md):

```
 full precision   .weight          [out, in]       cfg.torch_dtype
 MXFP4            .weight_packed   [out, in / 2]   uint8, two E2M1 codes per byte (even input in the low nibble)
                  .weight_scale    [out, in / 32]  uint8, E8M0 scale per 32 inputs
```
A config with ``quantization_config`` (``cfg.quantization``) lists the MXFP4 form; every other tensor keeps
its full-precision form in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from k3serve.model.config import ModelConfig


class SplitKind(Enum):
    REPLICATED = "replicated"
    SHARD = "shard"  # split `dim` evenly over ranks
    HEAD_PREFIX = "head_prefix"  # K3 A_log: first `count` entries are real (zero padded); shard those
    EXPERT = "expert"  # whole tensor on the rank that owns `expert`


@dataclass(frozen=True)
class Packing(Enum):
    """What a tensor holds: a plain weight, or one half of an MXFP4 pair."""

    NONE = "none"
    MXFP4_PACKED = "weight_packed"  # uint8 [out, in / 2]
    MXFP4_SCALE = "weight_scale"  # uint8 [out, in / 32]


MXFP4_GROUP = 32
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"


def mxfp4_names(weight_name: str) -> tuple[str, str]:
    """``...w1.weight`` -> (``...w1.weight_packed``, ``...w1.weight_scale``)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight name")
    base = weight_name[: -len(".weight")]
    return base + PACKED_SUFFIX, base + SCALE_SUFFIX


def weight_name_of(name: str) -> str:
    """The full-precision name of a tensor (``...w1.weight_packed`` / ``_scale`` -> ``...w1.weight``)."""
    for suffix in (PACKED_SUFFIX, SCALE_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


@dataclass(frozen=True)
class Split:
    kind: SplitKind
    dim: int = 0
    count: int = 0  # HEAD_PREFIX: number of real entries
    expert: int = -1  # EXPERT: expert id


REPLICATED = Split(SplitKind.REPLICATED)


def shard(dim: int) -> Split:
    return Split(SplitKind.SHARD, dim=dim)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    split: Split = REPLICATED
    fp32: bool = False  # kept in fp32 whatever the checkpoint dtype (A_log, dt_bias, conv weights, norms of KDA)
    packing: Packing = Packing.NONE

    @property
    def numel(self) -> int:
        """Stored elements (bytes, for the uint8 halves of an MXFP4 pair)."""
        return math.prod(self.shape)

    @property
    def params(self) -> int:
        """Model parameters the tensor encodes: 2 per packed byte, none for scales."""
        if self.packing is Packing.MXFP4_PACKED:
            return 2 * self.numel
        return 0 if self.packing is Packing.MXFP4_SCALE else self.numel

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the full-precision weight this tensor encodes (its own shape when not packed)."""
        out, cols = self.shape[0], self.shape[-1]
        if self.packing is Packing.MXFP4_PACKED:
            return (out, cols * 2)
        if self.packing is Packing.MXFP4_SCALE:
            return (out, cols * MXFP4_GROUP)
        return self.shape

    def owned_by(self, rank: int, tp: int, num_experts: int) -> bool:
        if self.split.kind is not SplitKind.EXPERT:
            return True
        return self.split.expert // (num_experts // tp) == rank

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of the part one rank holds (for owned tensors)."""
        s = list(self.shape)
        if self.split.kind is SplitKind.SHARD:
            s[self.split.dim] //= tp
        elif self.split.kind is SplitKind.HEAD_PREFIX:
            s = [self.split.count // tp]
        return tuple(s)

    def local_index(self, rank: int, tp: int) -> tuple[slice, ...]:
        """Index into the full tensor selecting rank's part."""
        full = [slice(None)] * len(self.shape)
        if self.split.kind is SplitKind.SHARD:
            n = self.shape[self.split.dim] // tp
            full[self.split.dim] = slice(rank * n, (rank + 1) * n)
        elif self.split.kind is SplitKind.HEAD_PREFIX:
            n = self.split.count // tp
            full[0] = slice(rank * n, (rank + 1) * n)
        return tuple(full)


def kda_layer_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    """KDA attention tensors of one layer; `p` ends with 'self_attn.'."""
    hk, d, r, h = cfg.kda_key_dim, cfg.hidden_size, cfg.kda_gate_rank, cfg.kda_num_heads
    w = cfg.short_conv_kernel_size
    specs = [TensorSpec(f"{p}{x}_proj.weight", (hk, d), shard(0)) for x in "qkv"]
    specs += [TensorSpec(f"{p}{x}_conv1d.weight", (hk, 1, w), shard(0), fp32=True) for x in "qkv"]
    if cfg.is_k3:
        # K3 stores A_log as [head_dim] with only the first H entries real.
        n = max(cfg.kda_head_dim, h)
        specs.append(TensorSpec(f"{p}A_log", (n,), Split(SplitKind.HEAD_PREFIX, count=h), fp32=True))
    else:
        specs.append(TensorSpec(f"{p}A_log", (1, 1, h, 1), shard(2), fp32=True))
    specs += [
        TensorSpec(f"{p}dt_bias", (hk,), shard(0), fp32=True),
        TensorSpec(f"{p}f_a_proj.weight", (r, d)),
        TensorSpec(f"{p}f_b_proj.weight", (hk, r), shard(0)),
        TensorSpec(f"{p}b_proj.weight", (h, d), shard(0)),
    ]
    if cfg.use_full_rank_gate:
        specs.append(TensorSpec(f"{p}g_proj.weight", (hk, d), shard(0)))
    else:
        specs += [TensorSpec(f"{p}g_a_proj.weight", (r, d)), TensorSpec(f"{p}g_b_proj.weight", (hk, r), shard(0))]
    specs += [
        TensorSpec(f"{p}o_norm.weight", (cfg.kda_head_dim,), fp32=True),
        TensorSpec(f"{p}o_proj.weight", (d, hk), shard(1)),
    ]
    return specs


def mla_layer_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    """MLA attention tensors of one layer; `p` ends with 'self_attn.'."""
    d, hm = cfg.hidden_size, cfg.num_attention_heads
    specs: list[TensorSpec] = []
    if cfg.q_lora_rank:
        specs += [
            TensorSpec(f"{p}q_a_proj.weight", (cfg.q_lora_rank, d)),
            TensorSpec(f"{p}q_a_layernorm.weight", (cfg.q_lora_rank,)),
            TensorSpec(f"{p}q_b_proj.weight", (hm * cfg.qk_head_dim, cfg.q_lora_rank), shard(0)),
        ]
    else:
        specs.append(TensorSpec(f"{p}q_proj.weight", (hm * cfg.qk_head_dim, d), shard(0)))
    specs += [
        TensorSpec(f"{p}kv_a_proj_with_mqa.weight", (cfg.mla_latent_dim, d)),
        TensorSpec(f"{p}kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        TensorSpec(f"{p}kv_b_proj.weight", (hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                   shard(0)),
    ]
    if cfg.mla_use_output_gate:
        specs.append(TensorSpec(f"{p}g_proj.weight", (hm * cfg.v_head_dim, d), shard(0)))
    specs.append(TensorSpec(f"{p}o_proj.weight", (d, hm * cfg.v_head_dim), shard(1)))
    return specs


def routed_weight_specs(cfg: ModelConfig, name: str, shape: tuple[int, int], split: Split) -> list[TensorSpec]:
    """One routed expert weight in the checkpoint's form: ``name`` itself, or its MXFP4 pair when the config
    is quantized (packed bytes first, then scales)."""
    if not cfg.quantization:
        return [TensorSpec(name, shape, split)]
    out, cols = shape
    packed, scale = mxfp4_names(name)
    return [TensorSpec(packed, (out, cols // 2), split, packing=Packing.MXFP4_PACKED),
            TensorSpec(scale, (out, cols // MXFP4_GROUP), split, packing=Packing.MXFP4_SCALE)]


def ffn_layer_specs(cfg: ModelConfig, layer: int, p: str) -> list[TensorSpec]:
    """Dense MLP or MoE tensors of one layer; `p` is the layer prefix ending with '.'."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        i = cfg.intermediate_size
        return [
            TensorSpec(f"{p}mlp.gate_proj.weight", (i, d), shard(0)),
            TensorSpec(f"{p}mlp.up_proj.weight", (i, d), shard(0)),
            TensorSpec(f"{p}mlp.down_proj.weight", (d, i), shard(1)),
        ]
    m = f"{p}block_sparse_moe."
    e_in, mi, e = cfg.expert_input_size, cfg.moe_intermediate_size, cfg.num_experts
    specs = [
        TensorSpec(f"{m}gate.weight", (e, d)),
        TensorSpec(f"{m}gate.e_score_correction_bias", (e,), fp32=True),
    ]
    for x in range(e):
        ex = Split(SplitKind.EXPERT, expert=x)
        for w, shape in (("w1", (mi, e_in)), ("w2", (e_in, mi)), ("w3", (mi, e_in))):
            specs += routed_weight_specs(cfg, f"{m}experts.{x}.{w}.weight", shape, ex)
    if cfg.num_shared_experts:
        si = cfg.shared_expert_intermediate_size
        specs += [
            TensorSpec(f"{m}shared_experts.gate_proj.weight", (si, d), shard(0)),
            TensorSpec(f"{m}shared_experts.up_proj.weight", (si, d), shard(0)),
            TensorSpec(f"{m}shared_experts.down_proj.weight", (d, si), shard(1)),
        ]
    if cfg.uses_latent_moe:
        lat = cfg.expert_input_size
        specs += [
            TensorSpec(f"{m}routed_expert_down_proj.weight", (lat, d)),
            TensorSpec(f"{m}routed_expert_norm.weight", (lat,)),
            TensorSpec(f"{m}routed_expert_up_proj.weight", (d, lat)),
        ]
    return specs


def layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    p = f"{cfg.name_prefix}layers.{layer}."
    d = cfg.hidden_size
    attn = kda_layer_specs(cfg, p + "self_attn.") if cfg.is_kda_layer(layer) else mla_layer_specs(cfg, p + "self_attn.")
    specs = [TensorSpec(f"{p}input_layernorm.weight", (d,)), *attn,
             TensorSpec(f"{p}post_attention_layernorm.weight", (d,))]
    if cfg.attn_res_block_size:
        specs += [
            TensorSpec(f"{p}self_attention_res_proj.weight", (1, d)),
            TensorSpec(f"{p}self_attention_res_norm.weight", (d,)),
            TensorSpec(f"{p}mlp_res_proj.weight", (1, d)),
            TensorSpec(f"{p}mlp_res_norm.weight", (d,)),
        ]
    return specs + ffn_layer_specs(cfg, layer, p)


def checkpoint_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a checkpoint of this config, in a stable order."""
    p, d, v = cfg.name_prefix, cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec(f"{p}embed_tokens.weight", (v, d))]
    for layer in range(cfg.num_hidden_layers):
        specs += layer_specs(cfg, layer)
    specs.append(TensorSpec(f"{p}norm.weight", (d,)))
    if cfg.attn_res_block_size:
        specs += [TensorSpec(f"{p}output_attn_res_proj.weight", (1, d)),
                  TensorSpec(f"{p}output_attn_res_norm.weight", (d,))]
    specs.append(TensorSpec(cfg.lm_head_name, (v, d)))
    return specs


def spec_index(cfg: ModelConfig) -> dict[str, TensorSpec]:
    return {s.name: s for s in checkpoint_specs(cfg)}
