"""The process kubelet's pure parts, without a cluster: expansion, env, images, status, nodes, probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rolloutfleet_testkit.kubelet import container, images, nodes, probes, process, status, volumes
from rolloutfleet_testkit.kubelet.addresses import AddressPool
from rolloutfleet_testkit.kubelet.credentials import ApiServer, pod_kubeconfig
from rolloutfleet_testkit.kubelet.env import PodFacts, field_value, resolve_env
from rolloutfleet_testkit.kubelet.errors import ContainerStartError
from rolloutfleet_testkit.kubelet.expansion import expand

# ---- $(VAR) expansion ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--bind $(POD_IP)", "--bind 127.0.1.7"),
        ("$(POD_IP):$(PORT)", "127.0.1.7:8080"),
        ("$(MISSING)", "$(MISSING)"),  # undefined references stay verbatim
        ("$$(POD_IP)", "$(POD_IP)"),  # escaped
        ("$$$(PORT)", "$8080"),  # escaped $ then a reference
        ("cost: 5$", "cost: 5$"),  # trailing operator
        ("$PORT ${PORT}", "$PORT ${PORT}"),  # shell syntax is not Kubernetes syntax
        ("$(PORT", "$(PORT"),  # unclosed
        ("$(EMPTY)x", "x"),
        ("", ""),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert expand(text, {"POD_IP": "127.0.1.7", "PORT": "8080", "EMPTY": ""}) == expected


# ---- environment ----------------------------------------------------------------------------------

POD = {
    "metadata": {
        "name": "proxy-0",
        "namespace": "fleet",
        "uid": "u-1",
        "labels": {"app": "proxy", "rolloutfleet.dev/index": "0"},
        "annotations": {"note": "hi"},
    },
    "spec": {"nodeName": "rf-cpu-node", "serviceAccountName": "router", "containers": [{"name": "c"}]},
}
FACTS = PodFacts(pod_ip="127.0.1.9", allocatable={"cpu": "8", "memory": "32Gi"})


class FakeLookups:
    def __init__(self, config_maps: dict | None = None, secrets: dict | None = None):
        self.config_maps = config_maps or {}
        self.secrets = secrets or {}

    def config_map(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.config_maps.get((namespace, name))

    def secret(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.secrets.get((namespace, name))


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("metadata.name", "proxy-0"),
        ("metadata.namespace", "fleet"),
        ("metadata.uid", "u-1"),
        ("metadata.labels['rolloutfleet.dev/index']", "0"),
        ("metadata.annotations['note']", "hi"),
        ("metadata.labels['absent']", ""),
        ("spec.nodeName", "rf-cpu-node"),
        ("spec.serviceAccountName", "router"),
        ("status.podIP", "127.0.1.9"),
        ("status.hostIP", "127.0.0.1"),
    ],
)
def test_field_refs(path: str, expected: str) -> None:
    assert field_value(POD, path, FACTS) == expected


def test_unsupported_field_ref_is_a_config_error() -> None:
    with pytest.raises(ContainerStartError) as info:
        field_value(POD, "spec.containers[0].name", FACTS)
    assert info.value.reason == "CreateContainerConfigError"


def test_env_order_expansion_and_sources() -> None:
    lookups = FakeLookups(
        config_maps={("fleet", "settings"): {"MODE": "fast", "LEVEL": "1", "bad=key": "x"}},
        secrets={("fleet", "creds"): {"token": "s3cret"}},
    )
    container_spec = {
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "RF_"}],
        "env": [
            {"name": "EARLY", "value": "$(LATE)-$(RF_MODE)"},  # LATE is not defined yet
            {"name": "LATE", "value": "late"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(IP):8000"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "LEVEL"}}},
            {"name": "RF_MODE", "value": "overridden"},
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        ],
    }
    env = resolve_env(container_spec, POD, FACTS, lookups)
    assert env["EARLY"] == "$(LATE)-fast"
    assert env["URL"] == "http://127.0.1.9:8000"
    assert env["TOKEN"] == "s3cret" and env["LEVEL"] == "1"
    assert env["RF_MODE"] == "overridden" and env["RF_LEVEL"] == "1"
    assert "RF_bad=key" not in env and "OPT" not in env
    assert env["CPUS"] == "8"  # no limit: node allocatable
    assert list(env)[:2] == ["RF_MODE", "RF_LEVEL"]


@pytest.mark.parametrize(
    "var",
    [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "missing"}}},
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k"}}},
    ],
)
def test_missing_required_reference_blocks_the_container(var: dict) -> None:
    lookups = FakeLookups(secrets={("fleet", "creds"): {"token": "t"}})
    with pytest.raises(ContainerStartError) as info:
        resolve_env({"env": [var]}, POD, FACTS, lookups)
    assert info.value.reason == "CreateContainerConfigError"


def test_resource_field_ref_with_divisor() -> None:
    spec = {
        "resources": {"limits": {"memory": "2Gi", "cpu": "1500m"}},
        "env": [
            {
                "name": "MEM_MI",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
    }
    env = resolve_env(spec, POD, FACTS, FakeLookups())
    assert env == {"MEM_MI": "2048", "CPU": "2"}


# ---- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "repository"),
    [
        ("python:3.11", "python"),
        ("docker.io/library/busybox:1.36", "busybox"),
        ("ghcr.io/acme/rolloutfleet-proxy:v1@sha256:abc", "acme/rolloutfleet-proxy"),
        ("localhost:5000/rolloutfleet-operator", "rolloutfleet-operator"),
        ("lmsysorg/sglang:v0.5.4-cu126", "lmsysorg/sglang"),
    ],
)
def test_repository(image: str, repository: str) -> None:
    assert images.repository(image) == repository


def test_proxy_image_runs_the_proxy_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTFLEET_PROXY_PYTHON", "/envs/proxy/bin/python")
    expected = ["/envs/proxy/bin/python", "-m", "rolloutfleet_proxy", "--port", "8000"]
    assert images.local_command("ghcr.io/x/rolloutfleet-proxy:1", None, ["--port", "8000"]) == expected
    assert (
        images.local_command("rolloutfleet-proxy:dev", ["rolloutfleet-proxy"], ["--port", "8000"]) == expected
    )
    python_m = ["python3", "-m", "rolloutfleet_proxy", "--port"]
    assert images.local_command("rolloutfleet-proxy", python_m, ["8000"]) == expected
    # A shell command in the proxy image runs as written.
    assert images.local_command("rolloutfleet-proxy", ["sh", "-c", "true"], None) == ["sh", "-c", "true"]


def test_operator_image() -> None:
    argv = images.local_command("example.com/rolloutfleet-operator:0.1", None, ["--verbose"])
    assert argv == [sys.executable, "-m", "rolloutfleet_operator", "--verbose"]


def test_sglang_launch_server_becomes_the_reference_engine() -> None:
    command = ["python3", "-m", "sglang.launch_server"]
    args = [
        "--model-path", "/models/tok", "--host", "127.0.1.4", "--port", "30000", "--tp-size", "4",
        "--trust-remote-code", "--mem-fraction-static=0.8", "--served-model-name", "qwen",
        "--random-seed", "7",
    ]  # fmt: skip
    argv = images.local_command("lmsysorg/sglang:latest", command, args)
    assert argv[:3] == [sys.executable, "-m", "rolloutfleet_testkit.sglang_emulator.server"]
    translated = argv[3:]
    pairs = dict(zip(translated[::2], translated[1::2], strict=True))
    assert pairs == {
        "--tokenizer-path": "/models/tok",
        "--host": "127.0.1.4",
        "--port": "30000",
        "--model-name": "qwen",
        "--seed": "7",
    }


def test_engine_translation_prefers_an_explicit_tokenizer_path() -> None:
    translated = images.translate_engine_args(["--tokenizer-path", "/tok", "--model-path", "/weights"])
    assert translated == ["--tokenizer-path", "/tok"]


def test_router_images() -> None:
    router_args = ["--service-discovery", "--selector", "app=engine", "--port", "30000"]
    expected = [sys.executable, "-m", "sglang_router.launch_router", *router_args]
    launch = ["python3", "-m", "sglang_router.launch_router"]
    assert images.local_command("lmsysorg/sglang-router:v0.3.2", launch, router_args) == expected
    assert images.local_command("lmsysorg/sglang-router:v0.3.2", None, router_args) == expected
    assert images.local_command("lmsysorg/sglang:latest", launch, router_args) == expected


def test_generic_images_run_their_command_and_unknown_ones_fail() -> None:
    assert images.local_command("busybox", ["sh", "-c", "exit 3"], None) == ["sh", "-c", "exit 3"]
    assert images.local_command("python:3.11", ["python3"], ["-c", "print(1)"]) == [
        "python3",
        "-c",
        "print(1)",
    ]
    with pytest.raises(ContainerStartError) as info:
        images.local_command("nginx:1.27", None, ["-g", "daemon off;"])
    assert info.value.reason == "ImageNotRunnable"
    with pytest.raises(ContainerStartError):
        images.local_command("lmsysorg/sglang:latest", None, None)


# ---- pod status ------------------------------------------------------------------------------------

NOW = "2030-01-01T00:00:10Z"
EARLIER = "2030-01-01T00:00:00Z"


def view(name: str = "c", state: dict | None = None, **kwargs) -> status.ContainerView:
    return status.ContainerView(name, "img", state or status.running(EARLIER), **kwargs)


def done(code: int) -> dict:
    return status.terminated(code, EARLIER, NOW)


@pytest.mark.parametrize(
    ("policy", "states", "expected"),
    [
        ("Always", [status.waiting("ContainerCreating")], "Pending"),
        ("Always", [status.running(EARLIER)], "Running"),
        ("Always", [status.running(EARLIER), status.waiting("ContainerCreating")], "Pending"),
        ("Always", [done(0)], "Running"),  # about to be restarted
        ("Never", [done(0), done(0)], "Succeeded"),
        ("Never", [done(0), done(1)], "Failed"),
        ("Never", [done(1), status.running(EARLIER)], "Running"),
        ("OnFailure", [done(0)], "Succeeded"),
        ("OnFailure", [done(2)], "Running"),
    ],
)
def test_phase(policy: str, states: list[dict], expected: str) -> None:
    views = [view(f"c{i}", s) for i, s in enumerate(states)]
    assert status.pod_phase(policy, views) == expected


def test_phase_of_crash_looping_container_is_running() -> None:
    looping = view(state=status.waiting("CrashLoopBackOff"), last_state=done(3), restart_count=2)
    assert status.pod_phase("Always", [looping]) == "Running"


def test_phase_is_terminal_once_terminal_and_on_teardown() -> None:
    assert status.pod_phase("Always", [view()], previous="Succeeded") == "Succeeded"
    assert status.pod_phase("Always", [view(state=done(143))], terminal=True) == "Failed"
    assert status.pod_phase("Always", [view(state=done(0))], terminal=True) == "Succeeded"


def test_init_containers_gate_the_phase() -> None:
    init_running = [view("init", status.running(EARLIER))]
    assert (
        status.pod_phase("Always", [view(state=status.waiting("PodInitializing"))], init_running) == "Pending"
    )
    assert status.pod_phase(
        "Never", [view(state=status.waiting("PodInitializing"))], [view("i", done(1))]
    ) == ("Failed")


def conditions_by_type(conditions: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in conditions}


def test_conditions_ready_and_not_ready() -> None:
    ready = conditions_by_type(status.pod_conditions("Running", True, [view(ready=True, started=True)]))
    assert {k: c["status"] for k, c in ready.items()} == {
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert ready["Ready"]["reason"] is None  # cleared explicitly in the patch
    unready = conditions_by_type(status.pod_conditions("Running", True, [view("a"), view("b", ready=True)]))
    assert unready["Ready"]["status"] == "False"
    assert unready["Ready"]["reason"] == "ContainersNotReady"
    assert unready["Ready"]["message"] == "containers with unready status: [a]"


def test_readiness_gates_hold_ready_back() -> None:
    gated = status.pod_conditions(
        "Running", True, [view(ready=True)], readiness_gates={"example.com/lb": "False"}
    )
    by_type = conditions_by_type(gated)
    assert by_type["ContainersReady"]["status"] == "True"
    assert by_type["Ready"]["status"] == "False" and by_type["Ready"]["reason"] == "ReadinessGatesNotReady"


def test_transition_time_changes_only_with_status() -> None:
    previous = [
        {"type": "Ready", "status": "False", "lastTransitionTime": EARLIER},
        {"type": "Initialized", "status": "True", "lastTransitionTime": EARLIER},
    ]
    current = [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}]
    stamped = conditions_by_type(status.with_transition_times(current, previous, NOW))
    assert stamped["Ready"]["lastTransitionTime"] == NOW
    assert stamped["Initialized"]["lastTransitionTime"] == EARLIER


def test_pod_status_fields_and_restart_counts() -> None:
    crashed = view(
        "worker",
        status.waiting("CrashLoopBackOff"),
        last_state=done(3),
        restart_count=4,
        container_id="process://9",
    )
    pod_view = status.PodView(
        restart_policy="Always",
        host_ip="127.0.0.1",
        pod_ip="127.0.1.3",
        start_time=EARLIER,
        sandbox_ready=True,
        containers=(crashed,),
    )
    result = status.pod_status(pod_view, {"phase": "Pending", "conditions": []}, NOW)
    assert result["phase"] == "Running"
    assert result["podIP"] == "127.0.1.3" and result["podIPs"] == [{"ip": "127.0.1.3"}]
    assert result["hostIPs"] == [{"ip": "127.0.0.1"}] and result["startTime"] == EARLIER
    (entry,) = result["containerStatuses"]
    assert entry["restartCount"] == 4 and entry["ready"] is False
    assert entry["lastState"]["terminated"]["exitCode"] == 3
    assert entry["lastState"]["terminated"]["reason"] == "Error"
    assert entry["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}
    assert entry["containerID"] == "process://9"


def test_status_patch_clears_replaced_states() -> None:
    entry = status.container_status(view(state=done(0)))
    patch = status.status_patch("uid-1", {"phase": "Succeeded", "containerStatuses": [entry]})
    state = patch["status"]["containerStatuses"][0]["state"]
    assert state["running"] is None and state["waiting"] is None
    assert state["terminated"]["reason"] == "Completed"
    assert patch["metadata"] == {"uid": "uid-1"}


# ---- nodes ------------------------------------------------------------------------------------------


def test_gpu_node_manifest() -> None:
    gpu = nodes.node_manifest(nodes.NodeSpec(nodes.GPU_NODE, gpus=4), "v1.35.4", "boot", NOW)
    assert gpu["metadata"]["name"] == "rf-gpu-node"
    assert gpu["status"]["capacity"]["nvidia.com/gpu"] == "4"
    assert gpu["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert gpu["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    assert gpu["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]


def test_cpu_node_manifest() -> None:
    cpu = nodes.node_manifest(nodes.NodeSpec(nodes.CPU_NODE), "v1.35.4", "boot", NOW)
    status_ = cpu["status"]
    assert "nvidia.com/gpu" not in status_["capacity"] and cpu["spec"]["taints"] == []
    assert {k: status_["capacity"][k] for k in ("cpu", "memory", "pods")} == {
        "cpu": "8",
        "memory": "32Gi",
        "pods": "110",
    }
    assert status_["addresses"][0] == {"type": "InternalIP", "address": "127.0.0.1"}
    conditions = {c["type"]: c for c in status_["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert all(conditions[k]["status"] == "False" for k in ("MemoryPressure", "DiskPressure", "PIDPressure"))
    assert all(c["lastHeartbeatTime"] == NOW for c in conditions.values())
    assert status_["nodeInfo"]["kubeletVersion"] == "v1.35.4"
    assert status_["nodeInfo"]["operatingSystem"] == "linux"


def test_lease_is_owned_by_its_node() -> None:
    lease = nodes.lease_manifest("rf-cpu-node", "node-uid", "2030-01-01T00:00:00.000001Z")
    assert lease["metadata"]["namespace"] == "kube-node-lease"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
    assert lease["spec"]["holderIdentity"] == "rf-cpu-node"
    assert nodes.micro_time(0.25).endswith(".250000Z")


# ---- probes ---------------------------------------------------------------------------------------


def test_parse_http_probe_with_named_port() -> None:
    spec = {
        "httpGet": {"path": "/health", "port": "http", "httpHeaders": [{"name": "X-A", "value": "b"}]},
        "initialDelaySeconds": 2,
        "periodSeconds": 3,
        "timeoutSeconds": 4,
        "failureThreshold": 5,
        "successThreshold": 2,
    }
    probe = probes.parse_probe(spec, [{"name": "http", "containerPort": 8080}])
    assert probe == probes.Probe(
        "httpGet",
        port=8080,
        path="/health",
        headers=(("X-A", "b"),),
        initial_delay_s=2,
        period_s=3,
        timeout_s=4,
        failure_threshold=5,
        success_threshold=2,
    )


def test_parse_tcp_and_exec_probes_with_defaults() -> None:
    tcp = probes.parse_probe({"tcpSocket": {"port": 30000}})
    assert tcp is not None and (tcp.kind, tcp.port, tcp.period_s, tcp.timeout_s, tcp.failure_threshold) == (
        "tcpSocket",
        30000,
        10,
        1,
        3,
    )
    exec_probe = probes.parse_probe({"exec": {"command": ["cat", "/tmp/ready"]}})
    assert exec_probe is not None and exec_probe.command == ("cat", "/tmp/ready")
    assert probes.parse_probe(None) is None
    with pytest.raises(ValueError):
        probes.parse_probe({"httpGet": {"port": "metrics"}}, [{"name": "http", "containerPort": 1}])


def test_probe_tracker_thresholds_and_timing() -> None:
    probe = probes.Probe("exec", initial_delay_s=5, period_s=2, failure_threshold=2, success_threshold=2)
    tracker = probes.ProbeTracker(probe, started_at=100.0)
    assert not tracker.due(104.9) and tracker.due(105.0)
    assert tracker.record(True, 105) is None  # one success of two needed
    assert tracker.record(True, 107) is True
    assert tracker.next_at == 109
    assert tracker.record(False, 109) is True  # one failure is not enough
    assert tracker.record(False, 111) is False


# ---- addresses, volumes, processes, restarts -------------------------------------------------------------


def test_address_pool() -> None:
    pool = AddressPool(first="127.0.1.254")
    first, second = pool.allocate(), pool.allocate()
    assert (first, second) == ("127.0.1.254", "127.0.2.1")  # .255 and .0 skipped
    assert pool.allocate(preferred="127.0.9.9") == "127.0.9.9"
    assert pool.allocate(preferred="127.0.0.1") != "127.0.0.1"  # the node's address is never a pod's
    pool.release(first)
    assert first not in pool.in_use()
    assert AddressPool().allocate() == "127.0.1.1"
    block = AddressPool("127.5.0.1", "127.5.0.2")
    assert [block.allocate(), block.allocate()] == ["127.5.0.1", "127.5.0.2"]
    block.release("127.5.0.1")
    assert block.allocate(preferred="127.0.9.9") == "127.5.0.1"  # outside the block: not honoured


def test_concurrent_harnesses_claim_different_address_blocks(tmp_path) -> None:
    from rolloutfleet_testkit.kubelet.addresses import AddressBlockLock

    first, second = AddressBlockLock(tmp_path), AddressBlockLock(tmp_path)
    assert (
        (first.block, second.block) == (1, 2)
        and first.first == "127.1.0.1"
        and second.last == "127.2.255.254"
    )
    first.release()
    third = AddressBlockLock(tmp_path)
    assert third.block == 1  # released blocks are claimed again
    second.release()
    third.release()


def test_container_mounts_sub_paths_and_order(tmp_path) -> None:
    container_spec = {
        "volumeMounts": [
            {"name": "dumps", "mountPath": "/data/dumps/sub", "subPathExpr": "$(POD_NAME)"},
            {
                "name": "config",
                "mountPath": "/etc/app/settings.json",
                "subPath": "settings.json",
                "readOnly": True,
            },
            {"name": "dumps", "mountPath": "/data"},
        ]
    }
    paths = {"dumps": tmp_path / "claim", "config": tmp_path / "cm"}
    mounts = volumes.container_mounts(container_spec, paths, {"POD_NAME": "proxy-3"})
    targets = [m.target for m in mounts]
    assert sorted(targets) == ["/data", "/data/dumps/sub", "/etc/app/settings.json"]
    assert targets.index("/data") < targets.index("/data/dumps/sub")  # parents first
    by_target = {m.target: m for m in mounts}
    assert by_target["/data/dumps/sub"].source == str(tmp_path / "claim" / "proxy-3")
    assert by_target["/etc/app/settings.json"].source == str(tmp_path / "cm" / "settings.json")
    assert by_target["/etc/app/settings.json"].read_only and not by_target["/data"].read_only
    with pytest.raises(ContainerStartError):
        volumes.container_mounts(
            {"volumeMounts": [{"name": "x", "mountPath": "/x", "subPath": "../up"}]}, {"x": tmp_path}, {}
        )


def test_claim_volumes_are_keyed_by_namespace_and_claim(tmp_path) -> None:
    pod = {"metadata": {"namespace": "fleet", "name": "p", "uid": "u"}}
    volume = {"name": "v", "persistentVolumeClaim": {"claimName": "dumps"}}
    assert (
        volumes.volume_host_path(volume, pod, tmp_path / "pod", tmp_path)
        == tmp_path / "pvc" / "fleet" / "dumps"
    )
    assert volumes.volume_host_path({"name": "e", "emptyDir": {}}, pod, tmp_path / "pod", tmp_path) == (
        tmp_path / "pod" / "volumes" / "e"
    )


def test_mount_script_and_wrapped_argv() -> None:
    launch = process.Launch(
        ["python3", "-c", "pass"], {}, "/work dir", [volumes.Mount("/src", "/dst", read_only=True)]
    )
    argv = process.wrapped_argv(launch, euid=0)
    assert argv[1:5] == ["--mount", "--propagation", "private", "--"]
    script = argv[argv.index("-c") + 1]
    assert "mount --bind /src /run/rolloutfleet-kubelet-stage/0" in script
    assert (
        "mount --bind /run/rolloutfleet-kubelet-stage/0 /dst" in script
        and "mount -o remount,bind,ro /dst" in script
    )
    assert "cd '/work dir'" in script and script.endswith('exec "$@"')
    assert argv[-3:] == ["python3", "-c", "pass"]
    assert process.wrapped_argv(process.Launch(["true"], {})) == ["true"]
    assert "--map-root-user" in process.wrapped_argv(launch, euid=1000)


def test_exit_codes_and_backoff() -> None:
    assert process.exit_code(3) == 3 and process.exit_code(-15) == 143 and process.exit_code(-9) == 137
    assert [container.backoff_delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert container.should_restart("Always", 0) and container.should_restart("OnFailure", 1)
    assert not container.should_restart("OnFailure", 0) and not container.should_restart("Never", 1)


def test_pod_kubeconfig() -> None:
    document = json.loads(pod_kubeconfig(ApiServer("https://127.0.0.1:6443", "/ca.crt"), "tok", "fleet"))
    assert document["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": "/ca.crt",
    }
    assert document["users"][0]["user"] == {"token": "tok"}
    assert document["contexts"][0]["context"]["namespace"] == "fleet"


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_process_sees_its_volume_at_the_mount_path(tmp_path) -> None:
    """The real mount-namespace wrapper: a file in the volume is visible at the mountPath."""
    source = tmp_path / "volume"
    source.mkdir()
    (source / "hello").write_text("from the volume")
    target = f"/tmp/rf-kubelet-unit-{os.getpid()}"
    launch = process.Launch(
        [
            "sh",
            "-c",
            f"cat {target}/hello > {tmp_path}/seen; "
            f"touch {target}/ro 2>/dev/null || echo ro >> {tmp_path}/seen",
        ],
        process.process_env({}, {}),
        "/",
        [volumes.Mount(str(source), target, read_only=True)],
    )
    try:
        child = process.start(launch, tmp_path / "log")
        assert child.wait(timeout=10) == 0, (tmp_path / "log").read_text()
        assert (tmp_path / "seen").read_text() == "from the volume" + "ro\n"
        assert not os.path.exists(f"{target}/hello")  # the host's mount table is untouched
    finally:
        os.rmdir(target)


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_a_target_covering_another_source_does_not_hide_it(tmp_path) -> None:
    """An emptyDir mounted over the directory that holds a hostPath source (e.g. /tmp) must not
    hide that source: sources are staged before any target is mounted."""
    holder = tmp_path / "holder"
    (holder / "model").mkdir(parents=True)
    (holder / "model" / "weights.txt").write_text("real weights")
    empty = tmp_path / "empty"
    empty.mkdir()
    mounts = [
        volumes.Mount(str(empty), str(holder)),
        volumes.Mount(str(holder / "model"), str(tmp_path / "dst")),
    ]
    launch = process.Launch(["cat", str(tmp_path / "dst" / "weights.txt")], {}, None, mounts)
    result = subprocess.run(process.wrapped_argv(launch), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "real weights"


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_a_pod_mount_over_the_harness_checkout_keeps_the_checkout_visible(tmp_path) -> None:
    """A checkout under /tmp must survive a pod's emptyDir at /tmp: the program runs from it."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "program.txt").write_text("still here")
    empty = tmp_path / "empty"
    empty.mkdir()
    script = volumes.mount_script([volumes.Mount(str(empty), str(tmp_path))], None, keep=[str(checkout)])
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        script,
        "sh",
        "cat",
        str(checkout / "program.txt"),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "still here"
    hidden = volumes.mount_script([volumes.Mount(str(empty), str(tmp_path))], None)
    assert "keep-" not in hidden  # nothing to keep: nothing re-bound
