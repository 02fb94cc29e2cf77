"""The drafter's tensors: stable names, shapes, the initialisation, and its safetensors checkpoint.

Names follow vLLM's MTP layout at layer index L = the target's layer count (MODEL.md §6), with EAGLE-3's
fusion matrix beside it; ``P = {target prefix}layers.{L}.``::

    P.fc.weight                    [d, 3d]  W_E3, bias-free, over [h_low | h_mid | h_high]; init [0 | 0 | I]
    P.enorm.weight                 [d]      RMSNorm of embed(next token)
    P.hnorm.weight                 [d]      RMSNorm of the fused feature (or, unrolled, the drafter's own output)
    P.eh_proj.weight               [d, 2d]  over [enorm(e) | hnorm(g)]
    P.input_layernorm.weight       [d]      } one decoder block without AttnRes: gated NoPE MLA attention
    P.self_attn.*                           } (the target's MLA tensor names) and a dense SiTU/SwiGLU MLP
    P.post_attention_layernorm.weight [d]   }
    P.mlp.{gate,up,down}_proj.weight        }
    P.shared_head.norm.weight      [d]      the drafter's final norm
    P.shared_head.head.weight      [V, d]   } frozen copies of the target's lm_head and embed_tokens (never
    P.embed_tokens.weight          [V, d]   } trained; a decode engine drafts without the target's files)

The copies follow vLLM's MTP layout (``shared_head.head``) and make the drafter checkpoint self-contained for
the decode side, which holds the target's weights only on its TP ranks; :func:`check_shared` verifies them
against a target.

Initialisation: ``fc`` selects h_high, so the fused input equals the high feature at init; ``eh_proj`` is
``[N(0, 1/sqrt(d)) | I]`` so the block first sees hnorm(h_high) plus a token signal; the block starts as a
copy of the target's last MLA layer (attention, norms) and its dense layer 0 (MLP); ``shared_head.norm``
starts as the target's final norm. Everything but the two copies is trained.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.eagle3.config import DrafterConfig
from k3serve.model.init import tensor_generator
from k3serve.model.names import TensorSpec, ffn_layer_specs, mla_layer_specs

WEIGHTS_FILE = "model.safetensors"
SHARED_HEAD = "shared_head.head.weight"
SHARED_EMBED = "embed_tokens.weight"


def drafter_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """Every drafter tensor (full shapes; the drafter runs unsharded on each decode rank)."""
    t, p, d = cfg.target, cfg.prefix, cfg.hidden_size
    return [
        TensorSpec(p + "fc.weight", (d, 3 * d)),
        TensorSpec(p + "enorm.weight", (d,)),
        TensorSpec(p + "hnorm.weight", (d,)),
        TensorSpec(p + "eh_proj.weight", (d, 2 * d)),
        TensorSpec(p + "input_layernorm.weight", (d,)),
        *mla_layer_specs(t, p + "self_attn."),
        TensorSpec(p + "post_attention_layernorm.weight", (d,)),
        *ffn_layer_specs(_dense(t), 0, p),
        TensorSpec(p + "shared_head.norm.weight", (d,)),
        TensorSpec(p + SHARED_HEAD, (t.vocab_size, d)),
        TensorSpec(p + SHARED_EMBED, (t.vocab_size, d)),
    ]


def is_frozen(cfg: DrafterConfig, name: str) -> bool:
    """The target's tensors the drafter carries (not trained)."""
    return name in (cfg.prefix + SHARED_HEAD, cfg.prefix + SHARED_EMBED)


def check_shared(cfg: DrafterConfig, weights: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    """Refuse a drafter whose head/embedding copies differ from `target`'s (it was trained for other weights)."""
    t = cfg.target
    for mine, theirs in ((SHARED_HEAD, t.lm_head_name), (SHARED_EMBED, t.name_prefix + "embed_tokens.weight")):
        if not torch.equal(weights[cfg.prefix + mine].float(), target[theirs].float()):
            raise ConfigError(f"drafter {cfg.prefix + mine} differs from the target's {theirs}: "
                              "it was trained for another target checkpoint")


def _dense(t: ModelConfig) -> ModelConfig:
    """The target's config with layer 0 dense (so ffn_layer_specs gives the dense MLP's names)."""
    return t if t.first_k_dense_replace >= 1 else t.replace(first_k_dense_replace=1)


def _last_mla_layer(t: ModelConfig) -> int:
    return max(i for i in range(t.num_hidden_layers) if not t.is_kda_layer(i))


def init_drafter_weights(cfg: DrafterConfig, target: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 drafter tensors at their initial values (module docstring); `target` holds the target's full tensors."""
    t, p, d = cfg.target, cfg.prefix, cfg.hidden_size
    src_attn = f"{t.name_prefix}layers.{_last_mla_layer(t)}."
    out: dict[str, torch.Tensor] = {}
    for spec in drafter_specs(cfg):
        n = spec.name[len(p):]
        if n == "fc.weight":
            w = torch.zeros(d, 3 * d)
            w[:, 2 * d:] = torch.eye(d)
        elif n in ("enorm.weight", "hnorm.weight"):
            w = torch.ones(d)
        elif n == "eh_proj.weight":
            w = torch.cat([torch.randn(d, d, generator=tensor_generator(seed, spec.name)) / d ** 0.5, torch.eye(d)], 1)
        elif n == "shared_head.norm.weight":
            w = target[t.name_prefix + "norm.weight"]
        elif n == SHARED_HEAD:
            w = target[t.lm_head_name]
        elif n == SHARED_EMBED:
            w = target[t.name_prefix + "embed_tokens.weight"]
        elif n.startswith("mlp."):
            w = _dense_mlp_source(t, target, n)
        else:  # input/post norms and self_attn.*: the last MLA layer of the target
            w = target[src_attn + n]
        if tuple(w.shape) != spec.shape:
            raise ConfigError(f"drafter init: {spec.name} would be {tuple(w.shape)}, expected {spec.shape}")
        out[spec.name] = w.detach().float().clone()
    return out


def _dense_mlp_source(t: ModelConfig, target: dict[str, torch.Tensor], n: str) -> torch.Tensor:
    name = f"{t.name_prefix}layers.0.{n}"
    if name in target:
        return target[name]
    # a target without a dense layer: a seeded random MLP of the intermediate size
    i, d = t.intermediate_size, t.hidden_size
    shape = (d, i) if n.endswith("down_proj.weight") else (i, d)
    return torch.randn(shape, generator=tensor_generator(0, name)) / shape[1] ** 0.5


def save_drafter(cfg: DrafterConfig, weights: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors (fp32, the names above, nothing else) atomically per file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in drafter_specs(cfg)]
    missing = [n for n in names if n not in weights]
    if missing:
        raise ConfigError(f"save_drafter: missing tensors {missing[:3]}")
    tensors = {n: weights[n].detach().float().contiguous().cpu() for n in names}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "architecture": "K3Eagle3Drafter"})
    tmp.replace(out / WEIGHTS_FILE)
    cfg.save(out)
    return out


def load_drafter_weights(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, fp32 tensors) of a drafter checkpoint directory; shapes checked against the config."""
    path = Path(path)
    cfg = DrafterConfig.load(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise ConfigError(f"drafter checkpoint {path} has no {WEIGHTS_FILE}")
    raw = load_file(str(path / WEIGHTS_FILE))
    out = {}
    for spec in drafter_specs(cfg):
        if spec.name not in raw:
            raise ConfigError(f"drafter checkpoint {path}: missing tensor {spec.name}")
        if tuple(raw[spec.name].shape) != spec.shape:
            raise ConfigError(f"drafter checkpoint {path}: {spec.name} has shape {tuple(raw[spec.name].shape)}, "
                              f"expected {spec.shape}")
        out[spec.name] = raw[spec.name].float()
    return cfg, out
