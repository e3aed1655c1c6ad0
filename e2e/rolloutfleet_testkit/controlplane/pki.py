"""Certificates and keys for the local control plane: a CA, the API server's serving certificate,
client certificates per component, and the service-account signing key pair (all ECDSA P-256)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)

# Client identities: (file stem, common name = user, organization = group).
CLIENTS = {
    "admin": ("kubernetes-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    # The API server's identity towards kubelets (logs, exec, port-forward).
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
    # kube-proxy's user, bound by default to the system:node-proxier role.
    "kube-proxy": ("system:kube-proxy", None),
}


def node_client(node: str) -> tuple[str, str]:
    """A kubelet's identity: the user and group RBAC's system:node role is bound to here."""
    return f"system:node:{node}", "system:nodes"


@dataclass(frozen=True)
class Pki:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def ca_cert(self) -> Path:
        return self.path("ca.crt")

    def client(self, stem: str) -> tuple[Path, Path]:
        return self.path(f"{stem}.crt"), self.path(f"{stem}.key")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server_names: list[str] | None = None,
    server_ips: list[str] | None = None,
    usage=None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if server_names or server_ips:
        alt = [x509.DNSName(n) for n in server_names or []]
        alt += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips or []]
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def create_pki(
    directory: Path,
    service_ip: str = "10.0.0.1",
    server_ips: tuple[str, ...] = (),
    nodes: tuple[str, ...] = (),
    node_ips: tuple[str, ...] | None = None,
) -> Pki:
    """Write ca.{crt,key}, apiserver.{crt,key}, <client>.{crt,key} and sa.{key,pub} into directory;
    `server_ips` are further addresses the API server is reached at (e.g. where pods reach it), and
    each of `nodes` gets a kubelet client certificate `node-<name>.{crt,key}` and a serving
    certificate `node-<name>-serving.{crt,key}` for `node_ips` (default: `server_ips`), which the API
    server checks when it calls the kubelet (logs, exec)."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    ca_key = _key()
    ca_name = _name("rolloutfleet-local-ca")
    ca = _issue(ca_name, ca_key, ca_name, ca_key, ca=True)
    _write_key(pki.path("ca.key"), ca_key)
    _write_cert(pki.ca_cert, ca)

    server_key = _key()
    names = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    server = _issue(
        _name("kube-apiserver"),
        server_key,
        ca_name,
        ca_key,
        server_names=names,
        server_ips=["127.0.0.1", service_ip, *server_ips],
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
    )
    _write_key(pki.path("apiserver.key"), server_key)
    _write_cert(pki.path("apiserver.crt"), server)

    identities = {**CLIENTS, **{f"node-{node}": node_client(node) for node in nodes}}
    for stem, (user, group) in identities.items():
        key = _key()
        cert = _issue(_name(user, group), key, ca_name, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
        crt_path, key_path = pki.client(stem)
        _write_key(key_path, key)
        _write_cert(crt_path, cert)

    for node in nodes:
        key = _key()
        cert = _issue(
            _name(f"system:node:{node}", "system:nodes"),
            key,
            ca_name,
            ca_key,
            server_names=[node],
            server_ips=list(server_ips if node_ips is None else node_ips) or ["127.0.0.1"],
            usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        )
        crt_path, key_path = pki.client(f"node-{node}-serving")
        _write_key(key_path, key)
        _write_cert(crt_path, cert)

    sa_key = _key()
    _write_key(pki.path("sa.key"), sa_key)
    pki.path("sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def kubeconfig(server: str, pki: Pki, client: str, cluster_name: str = "rolloutfleet-local") -> str:
    """A kubeconfig (YAML is a superset of JSON) using a client certificate."""
    import json

    crt, key = pki.client(client)
    return (
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": cluster_name,
                "clusters": [
                    {
                        "name": cluster_name,
                        "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)},
                    }
                ],
                "users": [{"name": client, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
                "contexts": [
                    {
                        "name": cluster_name,
                        "context": {"cluster": cluster_name, "user": client, "namespace": "default"},
                    }
                ],
            },
            indent=2,
        )
        + "\n"
    )
