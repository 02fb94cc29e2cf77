"""Config keys the model does not implement are refused by name; the published configs still load."""

import json
from pathlib import Path

import pytest

from k3serve.model.checkpoint import inspect_checkpoint, make_checkpoint
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.presets import preset

DATA = Path(__file__).resolve().parents[1] / "data"
# the published files sit in ../shared/data next to a clone (worktrees: one level further up)
_ROOT = Path(__file__).resolve().parents[2]
SHARED = next((p for p in (_ROOT.parent / "shared" / "data", _ROOT.parent.parent / "shared" / "data")
               if p.is_dir()), _ROOT.parent / "shared" / "data")


def _k3() -> dict:
    return json.loads((DATA / "kimi_k3_config.json").read_text())


def _linear() -> dict:
    return json.loads((DATA / "kimi_linear_48b_a3b_config.json").read_text())


def test_test_data_are_the_published_configs():
    if not SHARED.is_dir():
        pytest.skip("no ../shared/data here")
    assert _k3() == json.loads((SHARED / "kimi_k3_config.json").read_text())
    assert _linear() == json.loads((SHARED / "kimi_linear_48b_config.json").read_text())


def test_published_k3_values_and_dtype_key():
    k3 = ModelConfig.from_hf_dict(_k3())
    assert k3.num_attention_heads == 96 and k3.intermediate_size == 33792 and k3.eos_token_id == 163586
    assert k3.torch_dtype == "bfloat16"  # from the newer `dtype` key at the top level
    assert k3.quantization == "mxfp4-pack-quantized"
    lin = ModelConfig.from_hf_dict(_linear())
    assert lin.torch_dtype == "bfloat16" and lin.quantization == ""
    info = inspect_checkpoint(DATA / "kimi_k3_config.json")
    assert info["torch_dtype"] == "bfloat16" and info["quantization"] == "mxfp4-pack-quantized"


@pytest.mark.parametrize("key,value", [
    ("moe_renormalize", False),
    ("moe_renormalize", 1),  # not a bool: not ours to guess
    ("moe_router_activation_func", "softmax"),
    ("mla_use_nope", False),
    ("tie_word_embeddings", True),
    ("topk_method", "greedy"),
    ("latent_moe_use_norm", False),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}),
])
def test_unimplemented_values_are_refused_by_name(key, value):
    raw = _linear()
    raw[key] = value
    with pytest.raises(ConfigError, match=f"{key} = {value!r}".replace("(", r"\(").replace("[", r"\[")
                       .replace("{", r"\{")):
        ModelConfig.from_hf_dict(raw)
    k3 = _k3()
    k3["text_config"][key] = value
    with pytest.raises(ConfigError, match=f"text_config.{key}"):
        ModelConfig.from_hf_dict(k3)


def test_k3_top_level_tie_word_embeddings_is_checked():
    raw = _k3()
    raw["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match="tie_word_embeddings = True"):
        ModelConfig.from_hf_dict(raw)


def test_grouped_topk_only_as_a_no_op():
    raw = _linear()
    raw.update(num_expert_group=8, topk_group=4)
    with pytest.raises(ConfigError, match="num_expert_group = 8, topk_group = 4"):
        ModelConfig.from_hf_dict(raw)
    raw.update(num_expert_group=8, topk_group=8)  # every group kept: plain top-k
    ModelConfig.from_hf_dict(raw)
    raw.update(use_grouped_topk=False, num_expert_group=8, topk_group=4)  # grouping off: the groups do not matter
    ModelConfig.from_hf_dict(raw)


def test_unknown_quantization_formats_inspect_but_do_not_make_or_load(tmp_path):
    cfg = preset("tiny").replace(quantization="nvfp4-pack-quantized")
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ConfigError, match="quantization_config.format = 'nvfp4-pack-quantized' is not implemented"):
        make_checkpoint(cfg, tmp_path / "q")
    mx = preset("tiny").replace(quantization="mxfp4-pack-quantized")
    assert ModelConfig.from_hf_dict(mx.to_hf_dict()) == mx  # MXFP4 makes and loads (tests/model/test_mxfp4_*)


def test_written_configs_name_the_implemented_values():
    d = preset("tiny").to_hf_dict()
    d = d.get("text_config", d)
    assert (d["moe_renormalize"], d["moe_router_activation_func"], d["mla_use_nope"], d["topk_method"],
            d["tie_word_embeddings"]) == (True, "sigmoid", True, "noaux_tc", False)
