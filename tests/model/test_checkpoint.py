"""make_checkpoint / CheckpointReader / inspect_checkpoint on the tiny presets and the public configs."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3serve.model.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    inspect_checkpoint,
    load_config,
    make_checkpoint,
)
from k3serve.model.config import ConfigError
from k3serve.model.init import init_tensor, make_tensor, random_weights, tensor_generator
from k3serve.model.names import SplitKind, checkpoint_specs, spec_index
from k3serve.model.presets import tiny, tiny_linear

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    cfg = tiny()
    one = make_checkpoint(cfg, tmp_path_factory.mktemp("tiny1"), seed=7, shards=1)
    three = make_checkpoint(cfg, tmp_path_factory.mktemp("tiny3"), seed=7, shards=3)
    return cfg, one, three


@pytest.fixture(scope="module")
def linear_ckpt(tmp_path_factory):
    cfg = tiny_linear().replace(torch_dtype="bfloat16")
    return cfg, make_checkpoint(cfg, tmp_path_factory.mktemp("lin"), seed=1, shards=2)


# ------------------------------------------------------------------------------------------- inspect
def test_inspect_kimi_linear_config():
    info = inspect_checkpoint(DATA / "kimi_linear_48b_a3b_config.json")
    assert info["model_type"] == "kimi_linear"
    assert info["num_layers"] == 27
    assert (info["num_kda_layers"], info["num_mla_layers"]) == (20, 7)
    assert len(info["kda_layers"]) == 20 and len(info["mla_layers"]) == 7
    assert 3 not in info["kda_layers"] and 3 in info["mla_layers"]
    assert 26 in info["mla_layers"] and 0 in info["kda_layers"]
    assert info["num_tensors"] == 20_493
    assert info["weights_present"] is False
    # 20 layers x 32 heads x (128*128 + 3*3*128) floats x 4 B
    assert info["kda_state_bytes_per_request"] == 20 * 32 * (128 * 128 + 3 * 3 * 128) * 4
    assert info["mla_bytes_per_token"] == 7 * 576 * 2


def test_inspect_k3_config():
    info = inspect_checkpoint(DATA / "kimi_k3_config.json")
    assert info["model_type"] == "kimi_k3"
    assert (info["num_layers"], info["num_kda_layers"], info["num_mla_layers"]) == (93, 69, 24)
    assert 91 in info["mla_layers"] and 92 in info["mla_layers"] and 90 in info["kda_layers"]
    assert info["mla_bytes_per_token"] == 24 * 576 * 2 == 27_648
    assert info["kda_state_bytes_per_request"] == 69 * 96 * (128 * 128 + 9 * 128) * 4
    assert 2.7e12 < info["num_params"] < 2.9e12


def test_inspect_made_checkpoint(tiny_ckpts):
    cfg, one, three = tiny_ckpts
    for path, files in ((one, 1), (three, 3)):
        info = inspect_checkpoint(path)
        assert info["weights_present"] is True
        assert info["num_tensors"] == len(checkpoint_specs(cfg))
        assert (info["missing_tensors"], info["unexpected_tensors"], info["shape_mismatches"]) == (0, 0, 0)
        assert info["num_files"] == files
    # a bare config.json inside the dir: no weights looked at
    assert inspect_checkpoint(one / "config.json")["weights_present"] is False


def test_inspect_reports_missing_unexpected_and_mismatched(tiny_ckpts, tmp_path):
    cfg, one, _ = tiny_ckpts
    with CheckpointReader(one) as r:
        tensors = {n: r.read(n) for n in r.names()}
    names = sorted(tensors)
    del tensors[names[0]]
    tensors[names[1]] = torch.zeros(3)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    (tmp_path / "config.json").write_text((one / "config.json").read_text())
    info = inspect_checkpoint(tmp_path)
    assert (info["missing_tensors"], info["unexpected_tensors"], info["shape_mismatches"]) == (1, 1, 1)
    assert info["missing_sample"] == [names[0]]


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such"):
        load_config(tmp_path / "missing")
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)


# ---------------------------------------------------------------------------------------------- make
def test_make_layout(tiny_ckpts):
    cfg, one, three = tiny_ckpts
    assert (one / SINGLE_FILE).is_file() and not (one / INDEX_FILE).exists()
    assert load_config(one) == cfg and load_config(three) == cfg
    index = json.loads((three / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all((three / f).is_file() for f in files)
    specs = checkpoint_specs(cfg)
    expected_bytes = sum(s.numel * 4 for s in specs)  # tiny is float32
    assert index["metadata"]["total_size"] == expected_bytes


def test_make_names_shapes_dtypes_and_determinism(tiny_ckpts):
    cfg, one, three = tiny_ckpts
    specs = checkpoint_specs(cfg)
    r1, r3 = CheckpointReader(one), CheckpointReader(three)
    assert r1.names() == r3.names() == sorted(s.name for s in specs)
    for s in specs:
        a, b = r1.read(s.name), r3.read(s.name)
        assert tuple(a.shape) == s.shape, s.name
        assert a.dtype == torch.float32
        assert torch.equal(a, b), s.name
    # the same values in memory, and a different seed gives different values
    emb = specs[0]
    assert torch.equal(r1.read(emb.name), make_tensor(emb, cfg, seed=7))
    assert not torch.equal(r1.read(emb.name), make_tensor(emb, cfg, seed=8))


def test_bf16_checkpoint_keeps_fp32_specs(linear_ckpt):
    cfg, path = linear_ckpt
    r = CheckpointReader(path)
    for s in checkpoint_specs(cfg):
        assert r.dtype(s.name) == ("F32" if s.fp32 else "BF16"), s.name
    assert set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()) == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_remake_replaces_old_weight_files(tmp_path):
    cfg = tiny_linear()
    make_checkpoint(cfg, tmp_path, shards=2)
    make_checkpoint(cfg, tmp_path, shards=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE_FILE]


def test_k3_a_log_padding(tiny_ckpts):
    cfg, one, _ = tiny_ckpts
    name = f"{cfg.name_prefix}layers.0.self_attn.A_log"
    a = CheckpointReader(one).read(name)
    h = cfg.kda_num_heads
    assert a.shape == (max(cfg.kda_head_dim, h),) and a.dtype == torch.float32
    assert torch.all(a[h:] == 0)
    assert torch.all(a[:h] > 0) and torch.all(a[:h] < torch.log(torch.tensor(16.0)))


def test_init_values_are_sane():
    cfg = tiny_linear()
    w = random_weights(cfg, seed=0)
    a_log = w["model.layers.0.self_attn.A_log"]
    assert a_log.shape == (1, 1, cfg.kda_num_heads, 1) and torch.all(a_log >= 0)
    norm = w["model.norm.weight"]
    assert torch.allclose(norm, torch.ones_like(norm), atol=0.2) and norm.std() > 0
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - cfg.hidden_size ** -0.5) < 0.01
    assert abs(w["model.embed_tokens.weight"].std().item() - 1.0) < 0.05
    # values depend only on (seed, name)
    spec = spec_index(cfg)["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(init_tensor(spec, cfg, tensor_generator(0, spec.name)), q)


# ---------------------------------------------------------------------------------------------- read
def _local_case(cfg, path, name, rank=1, tp=2):
    spec = spec_index(cfg)[name]
    r = CheckpointReader(path)
    local = r.read_local(spec, rank, tp, num_experts=cfg.num_experts)
    full = r.read(name)
    assert tuple(local.shape) == spec.local_shape(tp)
    return spec, local, full


@pytest.mark.parametrize("shards", [1, 3])
def test_read_local_tp2_rank1(tiny_ckpts, shards):
    cfg, one, three = tiny_ckpts
    path = one if shards == 1 else three
    p = cfg.name_prefix
    # column-parallel: second half of the rows
    spec, local, full = _local_case(cfg, path, f"{p}layers.0.self_attn.q_proj.weight")
    assert spec.split.kind is SplitKind.SHARD and spec.split.dim == 0
    assert torch.equal(local, full[full.shape[0] // 2:])
    # row-parallel: second half of the columns
    spec, local, full = _local_case(cfg, path, f"{p}layers.0.self_attn.o_proj.weight")
    assert spec.split.dim == 1
    assert torch.equal(local, full[:, full.shape[1] // 2:])
    # head prefix (K3 A_log): heads H/2..H, never the padding
    spec, local, full = _local_case(cfg, path, f"{p}layers.0.self_attn.A_log")
    assert spec.split.kind is SplitKind.HEAD_PREFIX
    h = cfg.kda_num_heads
    assert torch.equal(local, full[h // 2:h]) and torch.all(local > 0)
    # expert owned by rank 1 (experts 8..15 of 16): whole tensor
    spec, local, full = _local_case(cfg, path, f"{p}layers.1.block_sparse_moe.experts.9.w1.weight")
    assert spec.split.kind is SplitKind.EXPERT
    assert torch.equal(local, full)
    # replicated
    spec, local, full = _local_case(cfg, path, f"{p}layers.1.block_sparse_moe.gate.weight")
    assert torch.equal(local, full)


def test_read_local_kimi_linear_a_log(linear_ckpt):
    cfg, path = linear_ckpt
    spec, local, full = _local_case(cfg, path, "model.layers.0.self_attn.A_log")
    assert torch.equal(local, full[:, :, cfg.kda_num_heads // 2:, :])


def test_read_local_rank0_and_tp4(tiny_ckpts):
    cfg, one, _ = tiny_ckpts
    spec = spec_index(cfg)[f"{cfg.name_prefix}layers.3.self_attn.kv_b_proj.weight"]
    r = CheckpointReader(one)
    full = r.read(spec.name)
    parts = [r.read_local(spec, k, 4) for k in range(4)]
    assert torch.equal(torch.cat(parts, 0), full)


def test_missing_and_wrong_shape_raise(tiny_ckpts):
    cfg, _, three = tiny_ckpts
    r = CheckpointReader(three)
    spec = spec_index(cfg)[f"{cfg.name_prefix}layers.0.self_attn.q_proj.weight"]
    ghost = dataclasses.replace(spec, name="language_model.model.layers.99.self_attn.q_proj.weight")
    with pytest.raises(CheckpointError, match="layers.99.self_attn.q_proj.weight"):
        r.read_local(ghost, 0, 1)
    with pytest.raises(CheckpointError, match="layers.99"):
        r.read(ghost.name)
    wrong = dataclasses.replace(spec, shape=(spec.shape[0] * 2, spec.shape[1]))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_proj\.weight.*shape"):
        r.read_local(wrong, 1, 2)
    assert issubclass(CheckpointError, ValueError)


def test_expert_on_wrong_rank_raises(tiny_ckpts):
    cfg, one, _ = tiny_ckpts
    spec = spec_index(cfg)[f"{cfg.name_prefix}layers.1.block_sparse_moe.experts.2.w2.weight"]
    with pytest.raises(CheckpointError, match="experts.2.w2"):
        CheckpointReader(one).read_local(spec, 1, 2, num_experts=cfg.num_experts)


def test_reader_errors(tmp_path, tiny_ckpts):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        CheckpointReader(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text("{oops")
    with pytest.raises(CheckpointError, match="index"):
        CheckpointReader(tmp_path)
    # index naming a shard that is not there
    cfg, _, three = tiny_ckpts
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / INDEX_FILE).write_text((three / INDEX_FILE).read_text())
    (broken / "config.json").write_text((three / "config.json").read_text())
    name = checkpoint_specs(cfg)[0].name
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointReader(broken).read(name)
    with pytest.raises(CheckpointError, match="missing"):
        inspect_checkpoint(broken)
