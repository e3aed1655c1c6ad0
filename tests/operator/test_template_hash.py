"""The template hash: what rolls the proxies and what does not."""

from __future__ import annotations

import pytest
from fleet_samples import GPU, container, mutated, sample
from rolloutfleet_operator import manifests
from rolloutfleet_operator.fleet import TEMPLATE_HASH_ANNOTATION, parse_fleet
from rolloutfleet_proxy.settings import ENV


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
    before = manifests.template_hash(GPU)
    after = manifests.template_hash(parse_fleet(mutated(path, value)))
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
    assert manifests.template_hash(parse_fleet(mutated(path, value))) == manifests.template_hash(GPU)


def test_scaling_changes_the_batch_share_of_new_pods_without_rolling_the_others():
    admission = {"maxStaleness": 4, "consumerBatchSize": 10}
    fleets = {
        n: parse_fleet(mutated("proxy.replicas", n, mutated("proxy.admission", admission))) for n in (3, 4)
    }
    assert manifests.template_hash(fleets[3]) == manifests.template_hash(fleets[4])
    for replicas, share in ((3, "4"), (4, "3")):  # ceil(10 / replicas): the fleet admits a whole batch
        env = {e["name"]: e.get("value") for e in container(manifests.proxy_pod(fleets[replicas], 0))["env"]}
        assert env[ENV["max_staleness"]] == "4" and env[ENV["staleness_batch_share"]] == share


@pytest.mark.parametrize(
    ("replicas", "batch", "share"), [(1, 1, 1), (4, 2, 1), (4, 8, 2), (3, 10, 4), (0, 5, 5)]
)
def test_batch_share_is_rounded_up_and_at_least_one(replicas, batch, share):
    spec = {"maxStaleness": 0, "consumerBatchSize": batch}
    assert parse_fleet(mutated("proxy.admission", spec)).proxy.admission.batch_share(replicas) == share


def test_memory_soft_limit_and_export_ttl_reach_the_proxy():
    fleet = parse_fleet(
        mutated("proxy.exportTtlSeconds", 90, mutated("proxy.memory.refuseNewSessionsPercent", 80))
    )
    env = {e["name"]: e.get("value") for e in container(manifests.proxy_pod(fleet, 0))["env"]}
    assert env[ENV["rss_soft_limit_bytes"]] == str(6442450944 * 80 // 100)
    assert env[ENV["export_ttl_s"]] == "90"
    off = parse_fleet(mutated("proxy.memory.refuseNewSessionsPercent", 0))
    assert ENV["rss_soft_limit_bytes"] not in {
        e["name"] for e in container(manifests.proxy_pod(off, 0))["env"]
    }
    assert env[ENV["max_staleness"]] == "2" and env[ENV["max_concurrent_sessions"]] == "512"
    unbounded = parse_fleet(mutated("proxy.admission", {}))
    names = {e["name"] for e in container(manifests.proxy_pod(unbounded, 0))["env"]}
    assert not names & {ENV["max_staleness"], ENV["staleness_batch_share"], ENV["max_concurrent_sessions"]}


def test_template_hash_is_on_every_pod_and_independent_of_the_ordinal():
    current = manifests.template_hash(GPU)
    assert len(current) >= 8
    hashes = {
        manifests.proxy_pod(GPU, i)["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] for i in range(4)
    }
    assert hashes == {current}
    # Stable across separately parsed copies of the same object (no randomness, no identity).
    assert manifests.template_hash(parse_fleet(sample("gpu", uid="other", generation=9))) == current
