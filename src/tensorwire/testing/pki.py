"""A throwaway certificate authority for tests and benchmarks: ``make_pki(directory, names)``.

Certificates are made at run time (nothing secret is committed): one CA, then one key and certificate per name,
each valid for the name, ``localhost``, 127.0.0.1 and ::1 (plus ``extra_sans``), usable as a server and a client
certificate (mTLS), EC P-256, valid for two days. Uses the ``cryptography`` package when it is installed,
else the ``openssl`` command line tool; ``PkiUnavailable`` when neither is there (tests skip on it).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class PkiUnavailable(RuntimeError):
    """Neither the ``cryptography`` package nor the ``openssl`` tool is available."""


@dataclass(frozen=True)
class Identity:
    name: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    ca_key: Path
    identities: dict[str, Identity]

    def __getitem__(self, name: str) -> Identity:
        return self.identities[name]


def make_pki(
    directory: str | Path, names: Sequence[str], *, extra_sans: Sequence[str] = (), ca_name: str = "tensorwire-test-ca"
) -> Pki:
    """A CA plus one identity per name under ``directory`` (created); files are PEM, keys mode 0600."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            raise PkiUnavailable(
                "making test certificates needs the 'cryptography' package or the openssl tool"
            ) from None
        return _with_openssl(out, names, extra_sans, ca_name)
    return _with_cryptography(out, names, extra_sans, ca_name)


def _sans(name: str, extra: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([name, "localhost", "127.0.0.1", "::1", *extra]))


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=60)


def _with_openssl(out: Path, names: Sequence[str], extra_sans: Sequence[str], ca_name: str) -> Pki:
    ca, ca_key = out / "ca.pem", out / "ca.key"
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _run(
        "openssl", "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", f"/CN={ca_name}"
    )
    ids = {}
    for name in names:
        key, csr, cert, ext = (out / f"{name}.key", out / f"{name}.csr", out / f"{name}.pem", out / f"{name}.ext")
        _run("openssl", "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        sans = ",".join(f"IP:{s}" if _is_ip(s) else f"DNS:{s}" for s in _sans(name, extra_sans))
        ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
        _run(
            "openssl",
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
        key.chmod(0o600)
        ids[name] = Identity(name, cert, key)
    ca_key.chmod(0o600)
    return Pki(ca, ca_key, ids)


def _with_cryptography(out: Path, names: Sequence[str], extra_sans: Sequence[str], ca_name: str) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca, ca_key_path = out / "ca.pem", out / "ca.key"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_key(ca_key_path, ca_key)
    ids = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [
            x509.IPAddress(ipaddress.ip_address(s)) if _is_ip(s) else x509.DNSName(s) for s in _sans(name, extra_sans)
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key_path, key)
        ids[name] = Identity(name, cert_path, key_path)
    return Pki(ca, ca_key_path, ids)


__all__ = ["Identity", "Pki", "PkiUnavailable", "make_pki"]
