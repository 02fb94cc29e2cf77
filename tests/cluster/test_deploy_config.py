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


def test_numerics_key(tmp_path):
    from k3serve.contracts.numerics import NumericsMode

    assert load_deploy(_write(tmp_path, "routers: 1\n")).numerics.mode is NumericsMode.DEFAULT
    assert load_deploy(_write(tmp_path, "numerics: deterministic\n")).numerics.deterministic
    with pytest.raises(DeployError, match=r"numerics must be one of \['default', 'deterministic'\]"):
        load_deploy(_write(tmp_path, "numerics: exact\n"))
