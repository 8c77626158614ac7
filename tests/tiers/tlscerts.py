"""Throwaway certificates for TLS tests: a CA, a server certificate for
127.0.0.1 signed by it, a client certificate signed by it, and a second CA
that signed nothing the server holds (EC P-256 keys: fast to make).
Written as PEM files into a directory of the test's own."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signs the server's and the client's certificates
    server_cert: Path  # names only IP 127.0.0.1 (not "localhost")
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey, passphrase: bytes | None = None) -> bytes:
    enc = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, san=None, usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if san is not None:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_pki(dir_: Path) -> Pki:
    import ipaddress

    dir_.mkdir(parents=True, exist_ok=True)
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvtier test CA", ca_key, "kvtier test CA", ca_key, ca=True)
    other = _cert("another CA", other_key, "another CA", other_key, ca=True)
    srv_key, cli_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    srv = _cert("127.0.0.1", srv_key, "kvtier test CA", ca_key, ca=False,
                san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])  # cluster bus: both
    cli = _cert("kvtier", cli_key, "kvtier test CA", ca_key, ca=False, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    files = {
        "ca": ("ca.pem", _pem(ca)), "server_cert": ("server.pem", _pem(srv)), "server_key": ("server.key", _key_pem(srv_key)),
        "client_cert": ("client.pem", _pem(cli)), "client_key": ("client.key", _key_pem(cli_key)),
        "other_ca": ("other-ca.pem", _pem(other)),
    }
    paths = {}
    for field_name, (fname, data) in files.items():
        p = dir_ / fname
        p.write_bytes(data)
        p.chmod(0o600)
        paths[field_name] = p
    return Pki(**paths)


def encrypted_copy(key_file: Path, out: Path, passphrase: bytes = b"pass") -> Path:
    """``key_file``'s key, protected by ``passphrase``."""
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    out.write_bytes(_key_pem(key, passphrase))  # type: ignore[arg-type]
    return out
