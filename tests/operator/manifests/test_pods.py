"""What the pods of every component share (manifests/pods.py): placement from the spec reaches the
right pod templates, the operator's own labels cannot be overridden, proxies spread over nodes."""

from __future__ import annotations

import pytest
from fleet_samples import IMAGES, PLACEMENT, fleet_with, gpu_sample, pod_template
from rolloutfleet_operator.fleet import labels, parse_fleet
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.gateway import gateway_deployment
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod

BUILDERS = {
    "proxy": lambda fleet: proxy_pod(fleet, 0),
    "gateway": gateway_deployment,
    "engines": engine_deployment,
}
COMPONENT = {"proxy": "proxy", "gateway": "gateway", "engines": "engine"}


@pytest.mark.parametrize("component", BUILDERS)
def test_placement_reaches_the_pods_of_every_component(component):
    fleet = fleet_with(component, **PLACEMENT)
    metadata, spec = pod_template(BUILDERS[component](fleet))
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"] == PLACEMENT["tolerations"]
    assert spec["affinity"] == PLACEMENT["affinity"]
    assert spec["priorityClassName"] == "rollouts-high"
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    # Extra labels reach the pods beside the operator's own, which the selectors need intact.
    own = labels(fleet, COMPONENT[component])
    assert {**PLACEMENT["podLabels"], **own}.items() <= metadata["labels"].items()
    assert metadata["annotations"]["example.com/owner"] == "rl-team"


@pytest.mark.parametrize("component", BUILDERS)
def test_the_operators_labels_win_over_pod_labels(component):
    # The CRD refuses these keys (CEL); a stored object from before that rule still cannot break selectors.
    fleet = fleet_with(
        component, podLabels={"app.kubernetes.io/component": "x", "rolloutfleet.dev/fleet": "y"}
    )
    metadata, _ = pod_template(BUILDERS[component](fleet))
    assert {k: metadata["labels"][k] for k in labels(fleet, COMPONENT[component])} == labels(
        fleet, COMPONENT[component]
    )


def test_proxies_spread_softly_over_nodes_unless_the_spec_says_how():
    fleet = parse_fleet(gpu_sample(), IMAGES)
    _, spec = pod_template(proxy_pod(fleet, 0))
    assert spec["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": labels(fleet, "proxy")},
        }
    ]
    zones = [
        {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ]
    _, spec = pod_template(proxy_pod(fleet_with("proxy", topologySpreadConstraints=zones), 0))
    assert spec["topologySpreadConstraints"] == zones
    # Engines pack GPUs: no default spread.
    _, spec = pod_template(engine_deployment(fleet))
    assert "topologySpreadConstraints" not in spec
