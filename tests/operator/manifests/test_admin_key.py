"""The generated admin-key Secret (manifests/admin_key.py)."""

from __future__ import annotations

from fleet_samples import GPU
from rolloutfleet_operator.manifests.admin_key import admin_key_secret


def test_admin_key_secret():
    secret = admin_key_secret(GPU, "s3cret")
    assert secret["metadata"]["name"] == "gpu-fleet-admin-key"
    assert secret["stringData"] == {"admin-key": "s3cret"}
