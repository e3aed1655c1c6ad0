"""The proxies' Services (manifests/proxy_services.py)."""

from __future__ import annotations

from fleet_samples import GPU, POD, SVC
from rolloutfleet_operator.fleet import labels
from rolloutfleet_operator.manifests.proxy_services import client_service, headless_service


def test_services_select_the_proxies_and_expose_the_port():
    headless = headless_service(GPU)
    client = client_service(GPU)
    assert headless["metadata"]["name"] == SVC == POD["spec"]["subdomain"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert client["spec"]["type"] == "ClusterIP"
    for service in (headless, client):
        assert service["spec"]["selector"] == labels(GPU, "proxy")
        assert all(POD["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
        assert service["spec"]["ports"] == [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
        ]
