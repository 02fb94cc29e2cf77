"""TLS for the internal channels (router -> cluster front, prefill -> decode receivers): a private CA and one
certificate per deployment, made at deploy time, and mutual TLS with them (gRPC's own credentials).

The CA signs one leaf certificate (server and client use) for the name ``SERVER_NAME``; the CA's key is thrown
away once it has signed, so nothing can issue another. Every internal server requires a client certificate from
that CA, and every internal client checks the server's against it, dialling by address with the name overridden
to ``SERVER_NAME`` (the certificate cannot name addresses that are only known once ports are bound). So a plain
text client, or one holding another CA's certificate, fails the handshake before any call reaches a handler; the
MAC of k3serve/auth.py still authenticates each call inside the channel.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

SERVER_NAME = "k3serve.internal"  # the SAN of the deployment certificate; clients override the target name to it
VALID_DAYS = 365


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of the deployment CA's certificate and of the one leaf certificate and its key."""

    ca_cert: bytes
    cert: bytes
    key: bytes = field(repr=False)


def generate(valid_days: int = VALID_DAYS) -> TlsMaterial:
    """A fresh private CA (ECDSA P-256) and a leaf certificate for ``SERVER_NAME`` it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days)  # 5 min: clock skew
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "k3serve deployment CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TlsMaterial(ca.public_bytes(pem), leaf.public_bytes(pem),
                       key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def add_port(server: grpc.Server, address: str, tls: TlsMaterial | None) -> int:
    """Bind `address` on `server`: mutual TLS under the deployment CA with `tls`, plain text without."""
    if tls is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca_cert,
                                        require_client_auth=True)
    return server.add_secure_port(address, creds)


def open_channel(endpoint: str, tls: TlsMaterial | None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to an internal server: mutual TLS (the server's certificate checked against the deployment CA
    under ``SERVER_NAME``) with `tls`, plain text without."""
    if tls is None:
        return grpc.insecure_channel(endpoint, options=list(options))
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca_cert, private_key=tls.key,
                                         certificate_chain=tls.cert)
    return grpc.secure_channel(endpoint, creds, options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)])
