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
    assert mc.listen_any is False  # the example keeps the engine on its host


def test_listen_any_is_a_boolean_and_off_unless_set(tmp_path):
    """Off, the engine's listeners are kept on its host (transfer/mooncake/listeners.py); on, the operator
    firewalls them."""
    assert load_deploy(_write(tmp_path, "clusters: {transfer: mooncake}\n")).clusters.mooncake.listen_any is False
    with pytest.raises(DeployError, match="clusters.mooncake.listen_any must be true or false"):
        load_deploy(_write(tmp_path, "clusters: {transfer: mooncake, mooncake: {listen_any: 'yes'}}\n"))


def test_numerics_key(tmp_path):
    from k3serve.contracts.numerics import NumericsMode

    assert load_deploy(_write(tmp_path, "routers: 1\n")).numerics.mode is NumericsMode.DEFAULT
    assert load_deploy(_write(tmp_path, "numerics: deterministic\n")).numerics.deterministic
    with pytest.raises(DeployError, match=r"numerics must be one of \['default', 'deterministic'\]"):
        load_deploy(_write(tmp_path, "numerics: exact\n"))


def test_numerics_mapping_sets_the_packed_gemm_fields_and_names_unknown_keys(tmp_path):
    cfg = load_deploy(_write(tmp_path, "numerics: {mode: deterministic, packed_min_k: 0, packed_min_elements: 0}\n"))
    assert cfg.numerics.deterministic and not cfg.numerics.packs
    with pytest.raises(DeployError, match=r"numerics: unknown key 'packed_min'"):
        load_deploy(_write(tmp_path, "numerics: {mode: deterministic, packed_min: 0}\n"))
    with pytest.raises(DeployError, match=r"numerics.packed_min_k must be a non-negative integer"):
        load_deploy(_write(tmp_path, "numerics: {mode: deterministic, packed_min_k: -4}\n"))


def test_deterministic_numerics_with_speculative_decoding_is_accepted(tmp_path):
    cfg = load_deploy(_write(tmp_path, "numerics: deterministic\nclusters: {speculative: {method: ngram}}\n"))
    assert cfg.numerics.deterministic and cfg.clusters.speculative.method == "ngram"


def test_placement_parses_to_bundles_and_a_per_cluster_plane(tmp_path):
    cfg = load_deploy(_write(tmp_path, """
clusters:
  count: 2
  prefill_tp: 2
  decode_tp: 1
  mooncake: {listen_any: true}
  placement:
    - {clusters: [c0], front: {k3_node_a: 1}, prefill: {k3_node_a: 1}, decode: {k3_node_b: 0.5}, transfer: mooncake}
router_resources: {k3_node_a: 1}
"""))
    c0, c1 = cfg.clusters.placement_of("c0"), cfg.clusters.placement_of("c1")
    assert c0.bundles(0.01, 2, 1) == [{"CPU": 0.01, "k3_node_a": 1.0}] * 2 + [{"CPU": 0.01, "k3_node_b": 0.5}]
    assert c0.strategy == "PACK" and c1.strategy == "STRICT_PACK" and not c1.placed  # c1: one node, anywhere
    assert cfg.for_cluster("c0").clusters.transfer == "mooncake" and cfg.for_cluster("c1").clusters.transfer == "grpc"
    assert cfg.router_resources == (("k3_node_a", 1.0),)


@pytest.mark.parametrize("entry,match", [
    ("{clusters: [c9], decode: {b: 1}}", r"placement\[0\]\.clusters names unknown clusters \['c9'\]"),
    ("{clusters: [], decode: {b: 1}}", r"placement\[0\]\.clusters must name at least one"),
    ("{clusters: [c0], decode: {b: 0}}", r"placement\[0\]\.decode\.b must be a number > 0"),
    ("{clusters: [c0], decode: {CPU: 1}}", r"placement\[0\]\.decode: 'CPU' is not a custom resource"),
    ("{clusters: [c0], transfer: rdma}", r"placement\[0\]\.transfer must be one of"),
    ("{clusters: [c0], nodes: {b: 1}}", r"unknown key deploy\.clusters\.placement\[0\]\.nodes"),
])
def test_bad_placement_is_refused_naming_the_field(tmp_path, entry, match):
    with pytest.raises(DeployError, match=match):
        load_deploy(_write(tmp_path, f"clusters:\n  placement:\n    - {entry}\n"))


def test_a_cluster_placed_twice_is_refused(tmp_path):
    with pytest.raises(DeployError, match=r"placement\[1\]\.clusters: \['c0'\] already placed"):
        load_deploy(_write(tmp_path, "clusters:\n  placement:\n    - {clusters: [c0]}\n    - {clusters: [c0, c1]}\n"))


def test_kill_node_needs_a_node():
    from k3serve.cluster.drill import Fault

    assert Fault.parse("node:k3_node_b") == Fault("node", "k3_node_b")
    with pytest.raises(ValueError, match="--kill node needs a node"):
        Fault.parse("node")


def test_checkpoint_density_keys_reach_the_policy_and_bad_values_name_the_key(tmp_path):
    cfg = load_deploy(Path(__file__).resolve().parents[2] / "configs" / "shared-prefixes.yaml")
    policy = cfg.clusters.prefix_policy()
    assert (policy.checkpoint_every_blocks, policy.max_checkpoints_per_session) == (1, 4)
    assert policy.checkpoint_boundaries(6 * 512, 0) == [3 * 512, 4 * 512, 5 * 512, 6 * 512]  # every block end
    assert load_deploy(_write(tmp_path, "routers: 1\n")).clusters.prefix_policy().checkpoint_every_blocks == 8
    for key in ("checkpoint_every_blocks", "max_checkpoints_per_session"):
        with pytest.raises(DeployError, match=rf"^clusters\.{key} must be >= 1, got 0$"):
            load_deploy(_write(tmp_path, f"clusters: {{{key}: 0}}\n"))
    with pytest.raises(DeployError, match=r"^clusters\.prefix_scheme must be one of"):
        load_deploy(_write(tmp_path, "clusters: {prefix_scheme: dense}\n"))
