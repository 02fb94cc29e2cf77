"""ModelConfig <-> config.json round trips for the presets and the public configs."""

import json
from pathlib import Path

import pytest

from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.presets import PRESETS

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trip(name, tmp_path):
    cfg = PRESETS[name]()
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    assert ModelConfig.from_json_file(tmp_path) == cfg
    assert ModelConfig.from_json_file(tmp_path / "config.json") == cfg


@pytest.mark.parametrize("fname", ["kimi_linear_48b_a3b_config.json", "kimi_k3_config.json"])
def test_public_config_round_trip(fname):
    cfg = ModelConfig.from_json_file(DATA / fname)
    again = ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


def test_public_layer_lists_are_zero_indexed():
    lin = ModelConfig.from_json_file(DATA / "kimi_linear_48b_a3b_config.json")
    assert lin.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert lin.to_hf_dict()["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
    k3 = ModelConfig.from_json_file(DATA / "kimi_k3_config.json")
    assert k3.is_k3 and k3.mla_layers[-2:] == (91, 92)
    assert k3.to_hf_dict()["text_config"]["linear_attn_config"]["full_attn_layers"][-2:] == [92, 93]


def test_bad_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path / "bad.json")
