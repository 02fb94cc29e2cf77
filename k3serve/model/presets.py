"""Built-in model presets: tiny ones for CI and a larger one for measurements.

``tiny`` is a K3-flavoured model (bounded KDA gate, full-rank output gate, q-LoRA and gated MLA, Block
Attention Residuals, Stable LatentMoE with SiTU-GLU); ``tiny-linear`` the Kimi-Linear flavour (softplus gate,
low-rank output gate, plain MLA and MoE). Both use the byte tokenizer's vocabulary (256 bytes + BOS/EOS/PAD).
``tiny-trained`` is ``tiny`` with narrower experts and trained weights shipped as package data (``k3serve/assets/tiny-trained``,
made by ``k3serve train target``; its ``train_log.json`` has the settings and seed): :func:`write_preset_checkpoint` copies it,
every other preset is made from random values. Layer pattern for the 9-layer presets: ``[KDA x3, MLA] x2 + MLA`` (0-indexed MLA layers 3, 7, 8), the same
shape as K3's tail where the last two layers are both MLA.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from k3serve.model.config import ModelConfig
from k3serve.tokenizer import BYTE_VOCAB_SIZE, BOS_ID, EOS_ID, PAD_ID

_NINE_LAYER_KDA = (0, 1, 2, 4, 5, 6)
_NINE_LAYER_MLA = (3, 7, 8)


def _tiny_common() -> dict:
    return dict(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=9,
        kda_layers=_NINE_LAYER_KDA,
        mla_layers=_NINE_LAYER_MLA,
        kda_num_heads=4,
        kda_head_dim=32,
        num_attention_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=65536,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )


def tiny() -> ModelConfig:
    return ModelConfig(
        model_type="kimi_k3",
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
        q_lora_rank=96,
        mla_use_output_gate=True,
        routed_expert_hidden_size=128,
        num_shared_experts=2,
        hidden_act="situ",
        attn_res_block_size=3,
        routed_scaling_factor=1.0,
        **{k: v for k, v in _tiny_common().items() if k != "num_shared_experts"},
    )


def tiny_trained() -> ModelConfig:
    """``tiny`` with narrower experts (16 x 32 wide over a 64-wide latent, shared 2 x 32), so the trained fp32
    checkpoint ships in 14 MB and trains faster on two cores; everything else as ``tiny``."""
    return tiny().replace(moe_intermediate_size=32, routed_expert_hidden_size=64)


def tiny_linear() -> ModelConfig:
    return ModelConfig(model_type="kimi_linear", routed_scaling_factor=2.446, **_tiny_common())


def bench() -> ModelConfig:
    """Real per-head geometry (K = 128, MLA rank 512 + 64) at a width a 2-core CPU can still run."""
    return ModelConfig(
        model_type="kimi_k3",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=1024,
        num_hidden_layers=9,
        kda_layers=_NINE_LAYER_KDA,
        mla_layers=_NINE_LAYER_MLA,
        kda_num_heads=8,
        kda_head_dim=128,
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
        num_attention_heads=8,
        q_lora_rank=384,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_output_gate=True,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_token=4,
        num_shared_experts=2,
        routed_expert_hidden_size=512,
        hidden_act="situ",
        attn_res_block_size=3,
        max_position_embeddings=1 << 20,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )


# presets whose weights are shipped: name -> directory under k3serve/assets
TRAINED = {"tiny-trained": "tiny-trained"}


def trained_dir(name: str) -> Path:
    """The shipped checkpoint directory of a trained preset (works for editable and normal installs)."""
    path = Path(str(resources.files("k3serve.assets") / TRAINED[name]))
    if not (path / "config.json").is_file():
        raise ValueError(f"preset {name!r}: its shipped checkpoint {path} is missing (package data not installed?)")
    return path


PRESETS = {"tiny": tiny, "tiny-linear": tiny_linear, "bench": bench, "tiny-trained": tiny_trained}


def preset(name: str) -> ModelConfig:
    try:
        make = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return make()


def write_preset_checkpoint(name: str, out_dir: str | Path, *, seed: int = 0, shards: int = 1) -> Path:
    """A checkpoint of preset `name` in `out_dir`: the shipped weights for a trained preset (`seed` and `shards`
    must stay at their defaults there), else random values from (seed, tensor name)."""
    from safetensors.torch import load_file

    from k3serve.model.checkpoint import make_checkpoint, save_checkpoint

    if name not in TRAINED:
        return make_checkpoint(preset(name), out_dir, seed=seed, shards=shards)
    if seed != 0 or shards != 1:
        raise ValueError(f"preset {name!r} is a trained checkpoint: --seed and --shards do not apply")
    src, cfg = trained_dir(name), preset(name)
    shipped = ModelConfig.from_json_file(src / "config.json")
    if shipped.to_hf_dict() != cfg.to_hf_dict():
        raise ValueError(f"preset {name!r}: the shipped checkpoint {src} does not match the preset's config")
    return save_checkpoint(cfg, load_file(str(src / "model.safetensors")), out_dir)
