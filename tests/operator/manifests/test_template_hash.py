"""The template hash (manifests/proxy_pod.py): what rolls the proxies and what does not."""

from __future__ import annotations

import pytest
from fleet_samples import GPU, IMAGES, PLACEMENT, fleet_with, gpu_sample, mutated, sample
from rolloutfleet_operator.fleet import TEMPLATE_HASH_ANNOTATION, parse_fleet
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod, template_hash


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("proxy.image", "rolloutfleet-proxy:0.2.0"),
        ("proxy.imagePullPolicy", "Always"),
        ("proxy.port", 8001),
        ("proxy.resources", {"limits": {"memory": "16Gi"}}),
        ("proxy.tokenizer.path", "/other"),
        ("proxy.tokenizer.volume", {"hostPath": {"path": "/tok"}}),
        ("proxy.staleSessionTimeoutSeconds", 600),
        ("proxy.cleanupIntervalSeconds", 10),
        ("proxy.drainGraceSeconds", 40),
        ("proxy.terminationGracePeriodSeconds", 120),
        ("proxy.dump.path", "/dumps"),
        ("proxy.dump.persistentVolumeClaim", {"claimName": "other"}),
        ("proxy.env", [{"name": "X", "value": "1"}]),
        ("proxy.adminKeySecret", {"name": "s", "key": "k"}),
        ("proxy.exportTtlSeconds", 60),
        ("proxy.admission", {"maxStaleness": 2, "consumerBatchSize": 8}),
        ("proxy.admission.maxConcurrentSessions", 4),
        ("proxy.toolCallParser", "llama3"),
        ("proxy.toolCallParser", None),
        ("proxy.reasoningParser", "qwen3-thinking"),
        ("proxy.reasoningParser", None),
        ("proxy.chatTemplateKwargs", {"enable_thinking": False}),
        ("gateway.port", 31000),
    ],
)
def test_template_hash_changes_with_the_pod_template(path, value):
    before = template_hash(GPU)
    after = template_hash(parse_fleet(mutated(path, value)))
    assert after != before


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("proxy.replicas", 7),
        ("proxy.memory", {"rssBudgetBytes": 1}),
        ("proxy.memory.rssBudgetBytes", 2 * 2**30),
        ("proxy.memory.refuseNewSessionsPercent", 50),
        ("gateway.assignmentMode", "random"),
        ("gateway.image", "router:2"),
        ("gateway.policy", "random"),
        ("engines.replicas", 5),
        ("engines.image", "sglang:2"),
    ],
)
def test_template_hash_ignores_what_is_not_in_the_pod(path, value):
    assert template_hash(parse_fleet(mutated(path, value))) == template_hash(GPU)


def test_template_hash_is_on_every_pod_and_independent_of_the_ordinal():
    current = template_hash(GPU)
    assert len(current) >= 8
    hashes = {proxy_pod(GPU, i)["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] for i in range(4)}
    assert hashes == {current}
    # Stable across separately parsed copies of the same object (no randomness, no identity).
    assert template_hash(parse_fleet(sample("gpu", uid="other", generation=9))) == current


def test_placement_and_pod_annotations_roll_the_proxies_and_replicas_do_not():
    base = parse_fleet(gpu_sample(), IMAGES)
    rolled = [
        fleet_with("proxy", podAnnotations={"a": "b"}),
        fleet_with("proxy", priorityClassName="p"),
        fleet_with("proxy", affinity=PLACEMENT["affinity"]),
        fleet_with("proxy", serviceAccountName="dumps-writer"),
    ]
    for fleet in rolled:
        assert template_hash(fleet) != template_hash(base)
    assert template_hash(fleet_with("proxy", replicas=9)) == template_hash(base)
    annotations = proxy_pod(rolled[0], 0)["metadata"]["annotations"]
    assert annotations["a"] == "b" and annotations[TEMPLATE_HASH_ANNOTATION]
