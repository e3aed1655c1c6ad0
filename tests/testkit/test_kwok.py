"""KWOK's build and simulated nodes (rolloutfleet_testkit.controlplane.kwok): the pinned `go install`,
the per-version cache, the stages and nodes handed to KWOK. The controller itself runs in
e2e/tests/test_kwok_scale.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rolloutfleet_testkit.controlplane import build, kwok


def test_kwok_is_go_installed_at_its_pinned_version_stripped_and_path_independent():
    args = build.go_install_args("sigs.k8s.io/kwok/cmd/kwok", build.KWOK_VERSION)
    assert args[0] == "install" and args[-1] == f"sigs.k8s.io/kwok/cmd/kwok@{build.KWOK_VERSION}"
    assert "-trimpath" in args and args[args.index("-ldflags") + 1] == "-s -w"
    assert "-tags" not in args
    tagged = build.go_install_args("example.com/cmd/x", "v1.0.0", tags="remove_all_sd")
    assert tagged[tagged.index("-tags") + 1] == "remove_all_sd"


def test_kwok_is_cached_per_version_and_a_cached_one_is_never_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUTFLEET_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "no-go-here"))  # building would need go
    cached = build.go_tool_path("kwok", "v0.8.0")
    assert cached == tmp_path / "controlplane" / "kwok-v0.8.0" / "bin" / "kwok"
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    assert build.ensure_kwok("v0.8.0") == cached
    with pytest.raises(RuntimeError, match="Go is needed to build kwok"):
        build.ensure_kwok("v0.7.0")  # another version: its own directory, built on first use


def by_name(stages: list[dict]) -> dict[str, dict]:
    return {stage["metadata"]["name"]: stage["spec"] for stage in stages}


def test_stages_make_nodes_and_pods_ready_and_remove_deleted_pods():
    stages = kwok.stages()
    assert {s["apiVersion"] for s in stages} == {"kwok.x-k8s.io/v1alpha1"}
    assert yaml.safe_load_all(yaml.safe_dump_all(stages)) is not None
    spec = by_name(stages)
    assert set(spec) == {"node-ready", "node-heartbeat", "pod-ready", "pod-delete"}
    pod_ready = spec["pod-ready"]
    assert pod_ready["resourceRef"] == {"apiGroup": "v1", "kind": "Pod"}
    keys = {e["key"]: e for e in pod_ready["selector"]["matchExpressions"]}
    assert keys[".metadata.deletionTimestamp"]["operator"] == "DoesNotExist"  # a deleted pod stays down
    assert keys[".status.phase"]["values"] == ["Pending"]
    template = pod_ready["next"]["statusTemplate"]
    for condition in ("Initialized", "ContainersReady", "Ready"):
        assert f'- type: {condition}\n  status: "True"' in template
    assert "phase: Running" in template and "podIP:" in template and "ready: true" in template
    assert spec["pod-delete"]["next"] == {"delete": True}
    node_ready = spec["node-ready"]["next"]["statusTemplate"]
    assert '- type: Ready\n  status: "True"' in node_ready
    assert '- type: MemoryPressure\n  status: "False"' in node_ready
    heartbeat = spec["node-heartbeat"]
    assert heartbeat["delay"]["durationMilliseconds"] == kwok.HEARTBEAT_MS
    assert "addresses" not in heartbeat["next"]["statusTemplate"]  # conditions only


def test_fake_nodes_are_managed_by_kwok_and_a_gpu_node_is_labelled_tainted_and_has_gpus():
    node = kwok.fake_node("n0")
    assert node["metadata"]["annotations"] == {kwok.MANAGED_ANNOTATION: kwok.MANAGED_VALUE}
    assert node["status"]["allocatable"]["pods"] == "250" and "taints" not in node["spec"]
    gpu = kwok.fake_node("g0", gpus=8)
    assert gpu["status"]["capacity"][kwok.GPU_RESOURCE] == "8"
    assert gpu["metadata"]["labels"][kwok.GPU_RESOURCE] == "true"
    assert gpu["spec"]["taints"] == [{"key": kwok.GPU_RESOURCE, "value": "true", "effect": "NoSchedule"}]


def test_the_controller_manages_the_annotated_nodes_with_leases_and_its_own_pod_addresses():
    args = kwok.kwok_args(Path("/bin/kwok"), "/k/admin.kubeconfig", Path("/k/stages.yaml"))
    assert args[0] == "/bin/kwok"
    assert "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake" in args
    assert "--config=/k/stages.yaml" in args and "--kubeconfig=/k/admin.kubeconfig" in args
    assert f"--node-lease-duration-seconds={kwok.LEASE_SECONDS}" in args
    assert f"--cidr={kwok.POD_CIDR}" in args


def test_ready_nodes_need_the_ready_condition_and_no_not_ready_taint():
    def node(name, ready, taints=()):
        return {
            "metadata": {"name": name},
            "spec": {"taints": [{"key": t} for t in taints]},
            "status": {"conditions": [{"type": "Ready", "status": ready}]},
        }

    listing = {
        "items": [
            node("a", "True"),
            node("b", "False"),
            node("c", "True", ["node.kubernetes.io/not-ready"]),
            {"metadata": {"name": "d"}, "spec": {}, "status": {}},
        ]
    }
    assert kwok.ready_nodes(listing) == ["a"]
