"""A throwaway CA with server and client certificates, for tests and trials only."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30
"""Short on purpose: these certificates are for tests, not for a fleet (docs/security.md)."""


def write_test_certificates(
    directory: Path, host: str, clients: Sequence[str], *, valid_days: int = VALID_DAYS
) -> dict[str, Path]:
    """Write `ca.crt`/`ca.key`, `server.crt`/`server.key` and `<client>.crt`/`<client>.key`.

    FOR TESTS ONLY: the CA's key sits next to the certificates it signs. The server certificate
    names `host` (as an IP address or DNS name), `localhost` and 127.0.0.1; each client
    certificate has its name as common name (for mosquitto's `use_identity_as_username`).
    Private keys get mode 0600.

    Returns:
        File name to path, for every file written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pfl-edge TEST CA (do not use in production)")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now, valid_days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca.crt": directory / "ca.crt", "ca.key": directory / "ca.key"}
    _write(files["ca.crt"], ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(files["ca.key"], _key_pem(ca_key), private=True)
    leaves = [("server", host, ExtendedKeyUsageOID.SERVER_AUTH)]
    leaves += [(client, client, ExtendedKeyUsageOID.CLIENT_AUTH) for client in clients]
    for file_stem, common_name, usage in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(_name(common_name), ca_name, key.public_key(), now, valid_days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if usage == ExtendedKeyUsageOID.SERVER_AUTH:
            builder = builder.add_extension(_server_names(host), critical=False)
        certificate = builder.sign(ca_key, hashes.SHA256())
        crt, pem = directory / f"{file_stem}.crt", directory / f"{file_stem}.key"
        _write(crt, certificate.public_bytes(serialization.Encoding.PEM), private=False)
        _write(pem, _key_pem(key), private=True)
        files[crt.name], files[pem.name] = crt, pem
    return files


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    valid_days: int,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
    )


def _server_names(host: str) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            names.append(x509.DNSName(host))
    else:
        if str(address) != "127.0.0.1":
            names.append(x509.IPAddress(address))
    return x509.SubjectAlternativeName(names)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, private: bool) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o600 if private else 0o644)
