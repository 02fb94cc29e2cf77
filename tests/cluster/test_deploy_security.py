"""Issue 44 items 3, 4, 9: no open-by-default on a network, api_keys as a list of non-empty strings, separate
public and internal hosts, and a deploy config whose repr holds no secret."""

import dataclasses

import pytest

from k3serve.cluster.deploy import DeployConfig, DeployError, is_loopback, load_deploy


def _load(tmp_path, text: str):
    p = tmp_path / "deploy.yaml"
    p.write_text(text)
    return load_deploy(str(p))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node-a.example"])
def test_a_network_bind_without_api_keys_is_refused_unless_anonymous_is_allowed(tmp_path, host):
    with pytest.raises(DeployError, match=r"bind_host .* api_keys .* allow_anonymous: true"):
        _load(tmp_path, f"bind_host: '{host}'\n")
    assert _load(tmp_path, f"bind_host: '{host}'\nallow_anonymous: true\n").allow_anonymous
    assert _load(tmp_path, f"bind_host: '{host}'\napi_keys: [k1]\n").api_keys == ("k1",)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "localhost"])
def test_a_loopback_bind_may_be_anonymous(tmp_path, host):
    assert is_loopback(host)
    assert _load(tmp_path, f"bind_host: '{host}'\n").api_keys == ()


def test_public_and_internal_hosts_are_separate(tmp_path):
    cfg = _load(tmp_path, "bind_host: 0.0.0.0\napi_keys: [k1]\ninternal_host: 10.0.0.7\n")
    assert (cfg.bind_host, cfg.internal_bind) == ("0.0.0.0", "10.0.0.7")
    assert _load(tmp_path, "bind_host: 127.0.0.1\n").internal_bind == "127.0.0.1"  # default: the bind host


@pytest.mark.parametrize("text,field", [
    ("api_keys: sk-live-abcdef\n", "deploy.api_keys must be a list"),  # was 14 one-character keys
    ("api_keys: ['', k]\n", r"deploy.api_keys\[0\] must be a non-empty string"),
    ("api_keys: [k, null]\n", r"deploy.api_keys\[1\] must be a non-empty string"),
    ("api_keys: [k, 5]\n", r"deploy.api_keys\[1\] must be a non-empty string"),
])
def test_api_keys_must_be_a_list_of_non_empty_strings(tmp_path, text, field):
    with pytest.raises(DeployError, match=field):
        _load(tmp_path, text)


def test_api_keys_built_in_code_are_checked_too():
    with pytest.raises(DeployError, match="api_keys must be a list"):
        DeployConfig(api_keys="sk-live-abcdef").validate()


def test_key_quota_must_not_be_negative(tmp_path):
    with pytest.raises(DeployError, match="key_max_streams"):
        _load(tmp_path, "key_max_streams: -1\n")
    assert _load(tmp_path, "key_max_streams: 3\nkey_max_queued: 1\n").key_max_queued == 1


def test_the_configs_repr_holds_no_secret_key_or_redis_credential():
    cfg = DeployConfig(secret="s3cr3t-deployment-0123456789", api_keys=("sk-live-abcdef",))
    cfg = dataclasses.replace(cfg, control=dataclasses.replace(cfg.control, redis_url="redis://:hunter2@h:6379"))
    text = repr(cfg) + str(cfg)
    for secret in ("s3cr3t-deployment", "sk-live-abcdef", "hunter2"):
        assert secret not in text


def test_internal_tls_is_on_off_loopback_and_its_certificates_are_made_not_read(tmp_path):
    """Issue 44, internal TLS: `internal_tls` unset is on exactly when the internal host is not loopback;
    with_secret() makes the deployment's CA and certificate then (never read from the file, never in a repr)."""
    from cryptography import x509

    from k3serve.tls import SERVER_NAME

    local = _load(tmp_path, "bind_host: 127.0.0.1\n")
    assert not local.tls_on and local.with_secret().tls is None
    assert _load(tmp_path, "internal_tls: true\n").with_secret().tls is not None
    net = _load(tmp_path, "bind_host: 0.0.0.0\napi_keys: [k1]\n")
    assert net.tls_on and not _load(tmp_path, "bind_host: 0.0.0.0\napi_keys: [k1]\ninternal_tls: false\n").tls_on
    assert _load(tmp_path, "bind_host: 0.0.0.0\napi_keys: [k1]\ninternal_host: 127.0.0.1\n").tls_on is False
    made = net.with_secret()
    assert made.with_secret().tls is made.tls  # made once per deployment
    leaf = x509.load_pem_x509_certificate(made.tls.cert)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [SERVER_NAME]
    assert made.tls.key not in repr(made).encode() and b"PRIVATE KEY" in made.tls.key
    with pytest.raises(DeployError, match="unknown key deploy.tls"):
        _load(tmp_path, "tls: {cert: x}\n")
    with pytest.raises(DeployError, match="internal_tls must be true or false"):
        _load(tmp_path, "internal_tls: maybe\n")
