"""The control-plane build's pure parts: which modules to replace, with what, and the version stamp."""

from __future__ import annotations

import pytest
from rolloutfleet_testkit.controlplane.build import (
    Versions,
    required_version,
    staging_modules,
    staging_version,
    version_ldflags,
    wrapper_go_mod,
)

RELEASE_GO_MOD = """module k8s.io/kubernetes

go 1.25.0

require (
	go.etcd.io/etcd/client/v3 v3.6.5
	k8s.io/api v0.0.0
	k8s.io/client-go v0.0.0 // indirect
	k8s.io/kube-openapi v0.0.0-20250910181357-589584f1c912
	k8s.io/utils v0.0.0-20250820121507-0af2bda4dd1d
)

replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/client-go => ./staging/src/k8s.io/client-go
)
"""


def test_staging_modules_are_exactly_the_v0_0_0_requirements():
    # Pseudo-versions (v0.0.0-date-hash) are real published versions and must not be replaced.
    assert staging_modules(RELEASE_GO_MOD) == ["k8s.io/api", "k8s.io/client-go"]


def test_staging_version_and_required_version():
    assert staging_version("v1.35.4") == "v0.35.4"
    with pytest.raises(ValueError):
        staging_version("v2.0.0")
    assert required_version(RELEASE_GO_MOD, "go.etcd.io/etcd/client/v3") == "v3.6.5"
    assert required_version(RELEASE_GO_MOD, "example.com/none") is None


def test_wrapper_module_replaces_each_staging_module():
    versions = Versions(kubernetes="v1.35.4", staging="v0.35.4", etcd="v3.6.5", helm="v3.22.0")
    text = wrapper_go_mod(versions, ["k8s.io/api", "k8s.io/client-go"], "1.26")
    assert "require k8s.io/kubernetes v1.35.4" in text and "require go.etcd.io/etcd/server/v3 v3.6.5" in text
    assert "replace k8s.io/api => k8s.io/api v0.35.4" in text
    assert "replace k8s.io/client-go => k8s.io/client-go v0.35.4" in text
    assert text.count("replace ") == 2


def test_version_ldflags_stamp_both_version_packages():
    flags = version_ldflags("v1.35.4")
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {package}.gitVersion=v1.35.4" in flags
        assert f"-X {package}.gitMajor=1" in flags and f"-X {package}.gitMinor=35" in flags


def test_pki_issues_a_chain_the_api_server_and_clients_can_use(tmp_path):
    import ipaddress
    import json

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    from rolloutfleet_testkit.controlplane.pki import create_pki, kubeconfig

    pki = create_pki(tmp_path / "pki")
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(pki.path("apiserver.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    alt = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in alt.get_values_for_type(x509.IPAddress)
    assert "kubernetes.default.svc" in alt.get_values_for_type(x509.DNSName)
    admin = x509.load_pem_x509_certificate(pki.client("admin")[0].read_bytes())
    admin.verify_directly_issued_by(ca)
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    usage = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usage
    assert oct(pki.path("ca.key").stat().st_mode & 0o777) == "0o600"
    config = json.loads(kubeconfig("https://127.0.0.1:6443", pki, "scheduler"))
    assert config["users"][0]["user"]["client-certificate"].endswith("scheduler.crt")


def test_component_command_lines(tmp_path):
    from pathlib import Path

    from rolloutfleet_testkit.controlplane.cluster import component_args
    from rolloutfleet_testkit.controlplane.pki import Pki

    ports = {
        "etcd": 2379,
        "etcd-peer": 2380,
        "kube-apiserver": 6443,
        "kube-controller-manager": 10257,
        "kube-scheduler": 10259,
    }
    pki = Pki(tmp_path / "pki")
    apiserver = component_args("kube-apiserver", Path("/bin"), tmp_path, pki, ports)
    assert apiserver[0] == "/bin/kube-apiserver"
    assert "--etcd-servers=http://127.0.0.1:2379" in apiserver and "--authorization-mode=RBAC" in apiserver
    assert "--bind-address=127.0.0.1" in apiserver and "--endpoint-reconciler-type=none" in apiserver
    scheduler = component_args("kube-scheduler", Path("/bin"), tmp_path, pki, ports)
    assert "--leader-elect=false" in scheduler and "--secure-port=10259" in scheduler
    with pytest.raises(ValueError):
        component_args("kubelet", Path("/bin"), tmp_path, pki, ports)
