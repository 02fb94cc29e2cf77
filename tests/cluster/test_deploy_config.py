"""The deploy file parser: strict keys, clear errors, the engine knobs reach the prefill config."""

from pathlib import Path

import pytest

from k3serve.cluster.deploy import DeployError, load_deploy


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "deploy.yaml"
    p.write_text(text)
    return str(p)


def test_local_yaml_loads_with_its_step_budgets():
    cfg = load_deploy(Path(__file__).resolve().parents[2] / "configs" / "local.yaml")
    assert cfg.clusters.step_token_budget == 2048
    assert 0 < cfg.clusters.long_step_tokens <= cfg.clusters.step_token_budget


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(DeployError, match=r"unknown key deploy\.clusters\.step_tokens"):
        load_deploy(_write(tmp_path, "clusters: {step_tokens: 5}\n"))


def test_negative_long_step_tokens_is_refused(tmp_path):
    with pytest.raises(DeployError, match="long_step_tokens"):
        load_deploy(_write(tmp_path, "clusters: {long_step_tokens: -1}\n"))


def test_long_step_tokens_defaults_to_the_step_budget(tmp_path):
    cfg = load_deploy(_write(tmp_path, "clusters: {step_token_budget: 512}\n"))
    assert cfg.clusters.long_step_tokens == 0  # 0: the prefill engine uses step_token_budget for long prompts


def test_short_secret_is_refused(tmp_path):
    with pytest.raises(DeployError, match="secret must be at least 16"):
        load_deploy(_write(tmp_path, "secret: short\n"))


def test_speculative_section_builds_the_decode_spec_config(tmp_path):
    cfg = load_deploy(_write(tmp_path, "clusters:\n  speculative: {method: ngram, num_draft_tokens: 5, classes: [long]}\n"))
    spec = cfg.clusters.speculative.spec_config(cfg.request_classes)
    assert spec.method == "ngram" and spec.num_draft_tokens == 5
    assert not spec.enabled_for(100) and spec.enabled_for(5000)  # short (<= 4096 uncached) off, long on
    assert load_deploy(None).clusters.speculative.spec_config(cfg.request_classes) is None  # default: off


@pytest.mark.parametrize("text,needle", [
    ("clusters: {speculative: {method: medusa}}\n", "clusters.speculative.method"),
    ("clusters: {speculative: {method: ngram, num_draft_tokens: 0}}\n", "clusters.speculative.num_draft_tokens"),
    ("clusters: {speculative: {method: ngram, classes: [tiny]}}\n", "unknown request classes"),
    ("clusters: {speculative: {method: ngram, ngram_min: 4, ngram_max: 2}}\n", "min_n"),
    ("clusters: {speculative: {k: 3}}\n", r"unknown key deploy\.clusters\.speculative\.k"),
])
def test_bad_speculative_section_is_named(tmp_path, text, needle):
    with pytest.raises(DeployError, match=needle):
        load_deploy(_write(tmp_path, text))


def test_transfer_planes_and_the_mooncake_section(tmp_path):
    cfg = load_deploy(Path(__file__).resolve().parents[2] / "configs" / "mooncake.yaml")
    assert cfg.clusters.transfer == "mooncake"
    mc = cfg.clusters.mooncake.config()
    assert (mc.protocol, mc.metadata, mc.staging_bytes) == ("tcp", "P2PHANDSHAKE", 64 << 20)
    with pytest.raises(DeployError, match="clusters.transfer must be one of grpc, mooncake, object_store"):
        load_deploy(_write(tmp_path, "clusters: {transfer: nixl}\n"))
    with pytest.raises(DeployError, match="mooncake.protocol"):
        load_deploy(_write(tmp_path, "clusters: {transfer: mooncake, mooncake: {protocol: udp}}\n"))
    with pytest.raises(DeployError, match=r"unknown key deploy\.clusters\.mooncake\.region"):
        load_deploy(_write(tmp_path, "clusters: {mooncake: {region: 5}}\n"))


def test_numerics_key(tmp_path):
    from k3serve.contracts.numerics import NumericsMode

    assert load_deploy(_write(tmp_path, "routers: 1\n")).numerics.mode is NumericsMode.DEFAULT
    assert load_deploy(_write(tmp_path, "numerics: deterministic\n")).numerics.deterministic
    with pytest.raises(DeployError, match=r"numerics must be one of \['default', 'deterministic'\]"):
        load_deploy(_write(tmp_path, "numerics: exact\n"))


def test_deterministic_numerics_with_speculative_decoding_is_accepted(tmp_path):
    cfg = load_deploy(_write(tmp_path, "numerics: deterministic\nclusters: {speculative: {method: ngram}}\n"))
    assert cfg.numerics.deterministic and cfg.clusters.speculative.method == "ngram"
