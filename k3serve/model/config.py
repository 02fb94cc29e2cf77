"""Model configuration for the Kimi-Linear / Kimi K3 family.

One frozen dataclass describes both model types. It is parsed from a Hugging Face style
``config.json`` (``kimi_linear`` at the top level, ``kimi_k3`` with the text backbone under
``text_config``) and written back in the same form, so a checkpoint made by k3serve loads in
any engine that reads the public configs.

Layer lists are stored **0-indexed** here; the public configs list them 1-indexed
(``linear_attn_config.kda_layers`` / ``full_attn_layers``), and the conversion happens only in
:func:`ModelConfig.from_hf_dict` / :meth:`ModelConfig.to_hf_dict`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.model import config_keys
from k3serve.model.quant_config import MXFP4_FORMAT, mxfp4_quantization_config, parse_quantization

MODEL_TYPES = ("kimi_linear", "kimi_k3")


class ConfigError(ValueError):
    """A config.json that k3serve cannot serve, with the offending field named."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    kda_layers: tuple[int, ...]  # 0-indexed
    mla_layers: tuple[int, ...]  # 0-indexed
    # --- KDA ---
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # K3: -5.0 (bounded sigmoid gate); None: Kimi-Linear softplus gate
    use_full_rank_gate: bool = False  # K3: output gate g_proj is full rank
    # --- MLA (NoPE) ---
    num_attention_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = False
    # --- FFN / MoE ---
    intermediate_size: int = 1024  # dense layers (the first `first_k_dense_replace`)
    moe_intermediate_size: int = 256
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    routed_expert_hidden_size: int | None = None  # K3 Stable LatentMoE latent width (d/2); None: plain MoE
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "situ" (K3 SiTU-GLU)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # --- Block Attention Residuals (K3) ---
    attn_res_block_size: int | None = None
    # --- misc ---
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1 << 20
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    torch_dtype: str = "float32"
    quantization: str = ""  # weight quantization format the config declares (K3: "mxfp4-pack-quantized")
    quant_scale_rule: str = ""  # PTQ scale rule recorded with an MXFP4 checkpoint ("ocp", "round-up"; "" unknown)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def kda_key_dim(self) -> int:
        """Width of each of q, k, v in a KDA layer (H * K, head-major channels)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def kda_gate_rank(self) -> int:
        """Low rank of f_a/f_b (decay) and g_a/g_b (output gate) projections: head_dim in the public models."""
        return self.kda_head_dim

    @property
    def conv_window(self) -> int:
        """Raw pre-conv tokens kept per channel between steps (kernel - 1)."""
        return self.short_conv_kernel_size - 1

    @property
    def kda_head_block_floats(self) -> int:
        """fp32 values in one head's state block: S (K x V) then q, k, v conv windows (3 x (W-1) x K).

        ```
        head block h:  [ S_h : K*V | conv_q_h : (W-1)*K | conv_k_h : (W-1)*K | conv_v_h : (W-1)*K ]
        ```
        """
        k = self.kda_head_dim
        return k * k + 3 * self.conv_window * k

    @property
    def mla_latent_dim(self) -> int:
        """Width of one cached MLA row: [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    @property
    def uses_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Shared experts are stored fused as one MLP of this width."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def expert_input_size(self) -> int:
        """Width routed experts see: the latent for Stable LatentMoE, else the model width."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def name_prefix(self) -> str:
        """Checkpoint prefix of the decoder stack (``model.`` / ``language_model.model.``)."""
        return "language_model.model." if self.is_k3 else "model."

    @property
    def lm_head_name(self) -> str:
        return "language_model.lm_head.weight" if self.is_k3 else "lm_head.weight"

    def is_kda_layer(self, layer: int) -> bool:
        return layer in self._kda_set

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def kda_index(self, layer: int) -> int:
        """Position of a KDA layer among KDA layers (its index in the state pool)."""
        return self.kda_layers.index(layer)

    def mla_index(self, layer: int) -> int:
        """Position of an MLA layer among MLA layers (its index in the page pool)."""
        return self.mla_layers.index(layer)

    @property
    def _kda_set(self) -> frozenset[int]:
        return frozenset(self.kda_layers)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        n = self.num_hidden_layers
        kda, mla = set(self.kda_layers), set(self.mla_layers)
        if len(kda) != len(self.kda_layers) or len(mla) != len(self.mla_layers):
            raise ConfigError("linear_attn_config: kda_layers / full_attn_layers contain duplicates")
        if kda & mla or (kda | mla) != set(range(n)):
            raise ConfigError(
                "linear_attn_config: kda_layers and full_attn_layers must partition layers "
                f"1..{n} (1-indexed); got {sorted(x + 1 for x in kda)} and {sorted(x + 1 for x in mla)}"
            )
        if self.hidden_act not in ("silu", "situ"):
            raise ConfigError(f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError("num_experts_per_token exceeds num_experts")
        if self.short_conv_kernel_size < 2:
            raise ConfigError("short_conv_kernel_size must be >= 2")
        for name in ("vocab_size", "hidden_size", "kda_num_heads", "kda_head_dim", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise ConfigError("attn_res_block_size must be positive when set")

    def check_loadable(self) -> None:
        """Raise ConfigError unless k3serve can hold this model's weights (make, load)."""
        if self.quantization and self.quantization != MXFP4_FORMAT:
            raise ConfigError(f"quantization_config.format = {self.quantization!r} is not implemented: k3serve "
                              f"loads full-precision or {MXFP4_FORMAT!r} weights (the config still inspects)")
        if self.quantization:
            for what, width in (("expert input width", self.expert_input_size),
                                ("moe_intermediate_size", self.moe_intermediate_size)):
                if width % 32:
                    raise ConfigError(f"{MXFP4_FORMAT}: {what} = {width} is not a multiple of the group size 32")

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless the model can be split over `tp` ranks."""
        if tp <= 0:
            raise ConfigError(f"tensor-parallel degree must be positive, got {tp}")
        checks = {
            "linear_attn_config.num_heads (KDA heads)": self.kda_num_heads,
            "num_attention_heads (MLA heads)": self.num_attention_heads,
            "num_experts": self.num_experts,
            "intermediate_size": self.intermediate_size,
            "shared expert width": self.shared_expert_intermediate_size,
        }
        for what, value in checks.items():
            if value % tp:
                raise ConfigError(f"{what} = {value} is not divisible by tensor-parallel degree {tp}")

    # -------------------------------------------------------------- HF format io
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a public-style config.json dict (kimi_linear, or kimi_k3 with text_config)."""
        top_type = raw.get("model_type")
        if top_type == "kimi_k3":
            if "text_config" not in raw:
                raise ConfigError("kimi_k3 config has no text_config")
            t = dict(raw["text_config"])
            model_type = "kimi_k3"
        elif top_type == "kimi_linear":
            t = dict(raw)
            model_type = "kimi_linear"
        else:
            raise ConfigError(f"unsupported model_type {top_type!r}; expected one of {MODEL_TYPES}")
        lac = t.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ConfigError("config has no linear_attn_config")
        for key in ("kda_layers", "full_attn_layers", "num_heads", "head_dim"):
            if key not in lac:
                raise ConfigError(f"linear_attn_config.{key} is missing")

        # keys whose other values would make the model compute something else: refused, named
        config_keys.check_implemented(t, raw if model_type == "kimi_k3" else {}, ConfigError,
                                      "text_config." if model_type == "kimi_k3" else "")

        quant = parse_quantization(t, raw, ConfigError)

        def req(key: str) -> Any:
            if key not in t:
                raise ConfigError(f"config field {key!r} is missing")
            return t[key]

        return cls(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            kda_layers=tuple(sorted(int(i) - 1 for i in lac["kda_layers"])),
            mla_layers=tuple(sorted(int(i) - 1 for i in lac["full_attn_layers"])),
            kda_num_heads=int(lac["num_heads"]),
            kda_head_dim=int(lac["head_dim"]),
            short_conv_kernel_size=int(lac.get("short_conv_kernel_size", 4)),
            gate_lower_bound=_opt_float(lac.get("gate_lower_bound")),
            use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            num_attention_heads=int(req("num_attention_heads")),
            q_lora_rank=_opt_int(t.get("q_lora_rank")),
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(t.get("qk_rope_head_dim", 0)),
            v_head_dim=int(req("v_head_dim")),
            mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
            intermediate_size=int(req("intermediate_size")),
            moe_intermediate_size=int(req("moe_intermediate_size")),
            num_experts=int(req("num_experts")),
            num_experts_per_token=int(req("num_experts_per_token")),
            num_shared_experts=int(t.get("num_shared_experts", 0)),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(t.get("first_k_dense_replace", 1)),
            moe_layer_freq=int(t.get("moe_layer_freq", 1)),
            routed_expert_hidden_size=_opt_int(t.get("routed_expert_hidden_size")),
            hidden_act=str(t.get("hidden_act", "silu")),
            activation_situ_beta=float(t.get("activation_situ_beta", 4.0)),
            activation_situ_linear_beta=float(t.get("activation_situ_linear_beta", 25.0)),
            attn_res_block_size=_opt_int(t.get("attn_res_block_size")) or None,
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(t.get("model_max_length", t.get("max_position_embeddings", 1 << 20))),
            bos_token_id=int(t.get("bos_token_id", raw.get("bos_token_id", 0)) or 0),
            eos_token_id=int(_first(t.get("eos_token_id", raw.get("eos_token_id", 1)))),
            pad_token_id=int(t.get("pad_token_id", raw.get("pad_token_id", 2)) or 0),
            torch_dtype=_dtype(t, raw),
            quantization=quant[0],
            quant_scale_rule=quant[1],
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict (inverse of from_hf_dict)."""
        text = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                **({"gate_lower_bound": self.gate_lower_bound} if self.gate_lower_bound is not None else {}),
                **({"use_full_rank_gate": True} if self.use_full_rank_gate else {}),
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": self.mla_use_output_gate,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True,
            "topk_method": "noaux_tc",
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "model_max_length": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
        }
        if self.quantization == MXFP4_FORMAT:
            text["quantization_config"] = mxfp4_quantization_config(self.quant_scale_rule)
        elif self.quantization:
            text["quantization_config"] = {"format": self.quantization}
        if self.routed_expert_hidden_size is not None:
            text["routed_expert_hidden_size"] = self.routed_expert_hidden_size
            text["latent_moe_use_norm"] = True
        if self.hidden_act == "situ":
            text["activation_situ_beta"] = self.activation_situ_beta
            text["activation_situ_linear_beta"] = self.activation_situ_linear_beta
        if self.attn_res_block_size:
            text["attn_res_block_size"] = self.attn_res_block_size
        if self.is_k3:
            return {
                "model_type": "kimi_k3",
                "architectures": ["KimiK3ForConditionalGeneration"],
                "torch_dtype": self.torch_dtype,
                "text_config": text,
            }
        return text

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(raw)


def _dtype(text: dict[str, Any], top: dict[str, Any]) -> str:
    """The weights' dtype: `torch_dtype` (older transformers) or `dtype` (newer; the published K3 config),
    in the text backbone first, then at the top level of a K3 config."""
    for d in (text, top):
        for key in ("torch_dtype", "dtype"):
            if d.get(key):
                return str(d[key])
    return "float32"


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, (list, tuple)) else v
