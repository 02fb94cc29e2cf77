"""MXFP4 checkpoints: the published K3 config's size, make / quantize / dequantize, the config-vs-tensors check,
TP ranks reading only their experts' bytes, and the model on packed weights."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve.kernels.mxfp4 import dequantize_mxfp4
from k3serve.model import checkpoint as ckpt_mod
from k3serve.model.checkpoint import CheckpointError, inspect_checkpoint, load_config, make_checkpoint
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.loader import load_model, load_weights
from k3serve.model.names import Packing, checkpoint_specs
from k3serve.model.presets import tiny
from k3serve.model.quant_config import MXFP4_FORMAT
from k3serve.model.quantize import dequantize_checkpoint, quantize_checkpoint
from k3serve.model.reference import reference_generate
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.tp import TPGroup

DATA = Path(__file__).resolve().parents[1] / "data"
PUBLISHED_K3_BYTES = 1.56e12


def _q(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(quantization=MXFP4_FORMAT, quant_scale_rule="ocp")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(full-precision tiny, `make --quant mxfp4` tiny) with the same seed."""
    full = make_checkpoint(tiny(), tmp_path_factory.mktemp("full"), seed=3)
    quant = make_checkpoint(_q(tiny()), tmp_path_factory.mktemp("mx"), seed=3)
    return full, quant


def test_inspect_k3_config_reports_mxfp4_experts_and_the_published_size():
    info = inspect_checkpoint(DATA / "kimi_k3_config.json")
    cfg = load_config(DATA / "kimi_k3_config.json")
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert info["quantization"] == MXFP4_FORMAT
    assert info["mxfp4_weights"] == moe_layers * 896 * 3
    assert abs(info["expected_weights_bytes"] / PUBLISHED_K3_BYTES - 1) < 0.05
    assert 0.97 < info["mxfp4_params"] / info["num_params"] < 0.99  # "98% of 2.78T parameters"
    assert 3.3 < info["bf16_weights_bytes"] / info["expected_weights_bytes"] < 3.8  # about 3.6x, not 4x
    # the ignore list alone would also quantize the latent projections, which K3 (and k3serve) keep in bf16
    assert info["ignore_list_targets_kept_full_precision"] > 0
    assert any("routed_expert_down_proj" in n for n in info["ignore_list_kept_sample"])


def test_config_round_trip_writes_the_published_scheme():
    cfg = _q(tiny())
    d = cfg.to_hf_dict()["text_config"]["quantization_config"]
    published = json.loads((DATA / "kimi_k3_config.json").read_text())["text_config"]["quantization_config"]
    assert d["format"] == published["format"] and d["quant_method"] == published["quant_method"]
    assert set(published["ignore"]) <= set(d["ignore"])
    w, pw = d["config_groups"]["group_0"]["weights"], published["config_groups"]["group_0"]["weights"]
    assert {k: v for k, v in w.items() if k != "observer_kwargs"} == \
        {k: v for k, v in pw.items() if k != "observer_kwargs"}
    assert w["observer_kwargs"] == {"scale_rule": "ocp"}
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    bad = cfg.to_hf_dict()
    bad["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ConfigError, match=r"config_groups\.group_0\.weights\.group_size = 16"):
        ModelConfig.from_hf_dict(bad)


def test_make_quant_is_ptq_of_make_and_dequantize_round_trips(pair, tmp_path):
    full, quant = pair
    ptq = quantize_checkpoint(full, tmp_path / "ptq", "ocp")
    a, b = load_file(str(quant / "model.safetensors")), load_file(str(ptq / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    info = inspect_checkpoint(quant)
    n_pairs = sum(s.packing is Packing.MXFP4_PACKED for s in checkpoint_specs(_q(tiny())))
    assert info["mxfp4_tensors_present"] == 2 * n_pairs == 2 * info["mxfp4_weights"]
    assert (info["missing_tensors"], info["unexpected_tensors"], info["shape_mismatches"]) == (0, 0, 0)
    assert info["weights_bytes"] < inspect_checkpoint(full)["weights_bytes"]
    deq = dequantize_checkpoint(quant, tmp_path / "deq")
    d = load_file(str(deq / "model.safetensors"))
    name = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"
    assert torch.equal(d[name + ".weight"], dequantize_mxfp4(a[name + ".weight_packed"], a[name + ".weight_scale"]))
    assert load_config(deq).quantization == ""
    again = quantize_checkpoint(deq, tmp_path / "again", "ocp")
    c = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(quant, tmp_path / "twice")


def _rewrite(src: Path, dst: Path, cfg_dict: dict, tensors: dict) -> Path:
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg_dict))
    return dst


def test_config_and_tensors_disagreeing_is_refused_naming_the_tensor(pair, tmp_path):
    full, quant = pair
    fw, qw = load_file(str(full / "model.safetensors")), load_file(str(quant / "model.safetensors"))
    # config says MXFP4, tensors are full precision
    bad = _rewrite(full, tmp_path / "a", _q(tiny()).to_hf_dict(), fw)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight' is stored in full precision"):
        load_weights(bad)
    # config says full precision, tensors are packed
    bad = _rewrite(quant, tmp_path / "b", tiny().to_hf_dict(), qw)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight_packed' is an MXFP4 packed weight"):
        load_weights(bad)
    # packed bytes stored in another dtype
    name = "language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight_scale"
    bad = _rewrite(quant, tmp_path / "c", _q(tiny()).to_hf_dict(), {**qw, name: qw[name].to(torch.int16)})
    with pytest.raises(CheckpointError, match=f"{name}' is stored as I16"):
        load_weights(bad)
    # a packed shared expert: the config quantizes routed experts only
    extra = "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight_packed"
    bad = _rewrite(quant, tmp_path / "d", _q(tiny()).to_hf_dict(), {**qw, extra: torch.zeros(4, 4, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match="shared_experts.up_proj.weight_packed' is MXFP4"):
        load_weights(bad)


def test_tp_rank_reads_only_its_experts_packed_bytes(pair, monkeypatch):
    _, quant = pair
    read = []
    real = ckpt_mod.CheckpointReader.read

    def spy(self, name):
        read.append(name)
        return real(self, name)

    monkeypatch.setattr(ckpt_mod.CheckpointReader, "read", spy)
    w = load_weights(quant, TPGroup(rank=1, world=2))
    experts = [n for n in read if ".experts." in n]
    assert experts and all(8 <= int(n.split(".experts.")[1].split(".")[0]) < 16 for n in experts)
    assert all(n.endswith((".weight_packed", ".weight_scale")) for n in experts)
    assert all(w[n].dtype == torch.uint8 for n in experts)


def test_model_on_packed_weights_equals_model_on_dequantized_weights(pair, tmp_path, monkeypatch):
    """The fused MXFP4 kernel (moe_mxfp4.py) sums in its own fixed order: the same tokens and logits within fp32
    rounding of the model on the dequantised weights; the unfused path (numba missing) is F.linear on the same
    weights, bit for bit."""
    from k3serve.model.layers import moe_mxfp4

    _, quant = pair
    deq = dequantize_checkpoint(quant, tmp_path / "deq")
    params = SamplingParams(max_tokens=6)
    prompt = [5, 17, 99, 3, 250, 41]
    mq, md = load_model(quant), load_model(deq)
    fused = [layer.ffn.fused for layer in mq.layers if hasattr(layer.ffn, "fused")]
    assert fused and all(f is not None for f in fused)
    a = reference_generate(mq, prompt, params, keep_logits=True)
    b = reference_generate(md, prompt, params, keep_logits=True)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert not all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))  # the fused kernel ran
    monkeypatch.setattr(moe_mxfp4, "fused_kernel_error", lambda: "switched off by the test")
    with pytest.warns(UserWarning, match="unfused CPU path"):
        mu = load_model(quant)
    c = reference_generate(mu, prompt, params, keep_logits=True)
    assert c.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in zip(c.logits, b.logits))
