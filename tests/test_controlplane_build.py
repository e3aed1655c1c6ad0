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
