"""The SGLang engines on GPU nodes (when the fleet runs them): a Deployment whose pods carry the
engine labels the gateway discovers by, and a headless Service."""

from __future__ import annotations

import copy
from typing import Any

from ..fleet import Fleet, engine_name, engine_service_name, labels
from .metadata import Manifest, object_metadata
from .pods import BIND_ALL, deployment, http_probe, place, with_overrides

ENGINE_CONTAINER = "engine"
GPU_RESOURCE = "nvidia.com/gpu"
# SGLang's switch that makes /health cheap instead of a generation that hangs behind a weight update,
# and the one that makes its logprobs untempered.
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# SGLang's server flag that makes it capture the experts each token was routed to (routing replay).
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
ENGINE_STARTUP_S = 3600  # loading a large model's weights can take tens of minutes
SHM_VOLUME = "rolloutfleet-shm"

# Engines: GPU images (lmsysorg/sglang) run as root and write caches under $HOME, so the default
# meets Pod Security "baseline" and hardens what does not get in their way; the spec can override.
ENGINE_CONTAINER_DEFAULT: Manifest = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _merge_resources(resources: dict[str, Any], gpus: int) -> Manifest:
    merged = copy.deepcopy(resources)
    if gpus > 0:
        # Extended resources cannot be overcommitted: a request, if any, must equal the limit.
        merged.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
        if GPU_RESOURCE in merged.get("requests", {}):
            merged["requests"][GPU_RESOURCE] = str(gpus)
    return merged


def engine_deployment(fleet: Fleet) -> Manifest:
    """SGLang servers on GPU nodes; their pods carry the engine labels the gateway discovers by."""
    engines = fleet.engines
    if engines is None:
        raise ValueError(f"fleet {fleet.name} uses external engines")
    container: Manifest = {
        "name": ENGINE_CONTAINER,
        "image": engines.image,
        "imagePullPolicy": engines.image_pull_policy,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": [
            "--model-path",
            engines.model_path,
            "--host",
            BIND_ALL,
            "--port",
            str(engines.port),
            "--tp-size",
            str(engines.tensor_parallel_size),
            *engine_feature_args(fleet),
            *engines.args,
        ],
        "env": with_overrides(engine_env(fleet), engines.env),
        **({"envFrom": copy.deepcopy(list(engines.env_from))} if engines.env_from else {}),
        "ports": [{"name": "http", "containerPort": engines.port, "protocol": "TCP"}],
        # With health generation off, SGLang's /health answers at once, also while weights update
        # (a generating /health hangs then and would fail the probes on every weight sync). The
        # startup probe gives weight loading up to an hour before liveness counts.
        "startupProbe": http_probe(
            "/health", engines.port, period_s=10, failure_threshold=ENGINE_STARTUP_S // 10, timeout_s=5
        ),
        "readinessProbe": http_probe("/health", engines.port, period_s=5, failure_threshold=3, timeout_s=5),
        "livenessProbe": http_probe("/health", engines.port, period_s=15, failure_threshold=8, timeout_s=10),
        "securityContext": copy.deepcopy(
            engines.security_context if engines.security_context is not None else ENGINE_CONTAINER_DEFAULT
        ),
    }
    resources = _merge_resources(engines.resources, engines.gpus_per_engine)
    if resources:
        container["resources"] = resources
    mounts = copy.deepcopy(list(engines.volume_mounts))
    volumes = copy.deepcopy(list(engines.volumes))
    if not any(mount.get("mountPath") == "/dev/shm" for mount in mounts):
        # A container's default 64 MiB /dev/shm is too small for NCCL and SGLang's tensor parallelism.
        shm: Manifest = {"medium": "Memory"}
        if engines.shm_size:
            shm["sizeLimit"] = engines.shm_size
        volumes.append({"name": SHM_VOLUME, "emptyDir": shm})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    container["volumeMounts"] = mounts
    pod_spec: Manifest = {
        "enableServiceLinks": False,
        # SGLang finishes its running requests on SIGTERM; long generations need more than 30 s.
        "terminationGracePeriodSeconds": engines.termination_grace_period_s,
        "containers": [container],
        "volumes": volumes,
    }
    for key, value in (
        ("runtimeClassName", engines.runtime_class_name),
        ("serviceAccountName", engines.service_account_name),
        ("securityContext", engines.pod_security_context),
    ):
        if value:
            pod_spec[key] = copy.deepcopy(value)
    place(pod_spec, engines.placement)
    # GPUs are usually all taken: a surge pod would stay Pending, so replace in place.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return deployment(
        fleet, engine_name(fleet), "engine", engines.replicas, pod_spec, strategy, placement=engines.placement
    )


def engine_feature_args(fleet: Fleet) -> list[str]:
    """Flags the proxies' settings need from the engines they record (unless `engines.args` has them):
    routing replay needs SGLang to capture the routed experts (`--enable-return-routed-experts`)."""
    given = fleet.engines.args if fleet.engines is not None else ()
    args = []
    if fleet.spec_value("proxy.routedExperts") and ROUTED_EXPERTS_FLAG not in given:
        args.append(ROUTED_EXPERTS_FLAG)
    return args


def engine_env(fleet: Fleet) -> list[Manifest]:
    env = [{"name": HEALTH_GENERATION_ENV, "value": "0"}]
    if fleet.proxy.engine_logprobs == "original":  # the engines and the proxies' records agree
        env.append({"name": ORIGINAL_LOGPROB_ENV, "value": "1"})
    return env


def engine_service(fleet: Fleet) -> Manifest:
    """Headless: DNS for every engine pod, so a trainer can reach each one (pause, weight updates;
    the router has no such routes)."""
    engines = fleet.engines
    if engines is None:
        raise ValueError(f"fleet {fleet.name} uses external engines")
    port = {"name": "http", "port": engines.port, "targetPort": "http", "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(fleet, engine_service_name(fleet), "engine"),
        "spec": {"clusterIP": "None", "selector": labels(fleet, "engine"), "ports": [port]},
    }
