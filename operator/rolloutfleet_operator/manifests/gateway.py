"""The SGLang gateway: the router's Deployment (service discovery of the fleet's engine pods, or
the external engine URLs), the ServiceAccount, Role and RoleBinding its discovery reads pods with,
and its Service."""

from __future__ import annotations

import copy

from ..fleet import Fleet, gateway_name, labels
from .metadata import Manifest, object_metadata
from .pods import BIND_ALL, RESTRICTED_CONTAINER, RESTRICTED_POD, deployment, http_probe, place

GATEWAY_CONTAINER = "router"


def gateway_service_account(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_metadata(fleet, gateway_name(fleet), "gateway"),
    }


def gateway_role(fleet: Fleet) -> Manifest:
    """What the router's service discovery needs: reading pods in the fleet's namespace."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_metadata(fleet, gateway_name(fleet), "gateway"),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def gateway_role_binding(fleet: Fleet) -> Manifest:
    name = gateway_name(fleet)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_metadata(fleet, name, "gateway"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": fleet.namespace}],
    }


def gateway_args(fleet: Fleet) -> list[str]:
    """sglang-router 0.3.2's command line (`python -m sglang_router.launch_router --help`; a test
    parses it with the router's own parser). Every setting is given, so what runs is what the spec
    says whatever the image's defaults."""
    gateway = fleet.gateway
    args = ["--host", BIND_ALL, "--port", str(gateway.port), "--policy", gateway.policy]
    args += ["--assignment-mode", gateway.assignment_mode]
    retries = gateway.retries
    args += [
        *("--retry-max-retries", str(retries.max_retries)),
        *("--retry-initial-backoff-ms", str(retries.initial_backoff_ms)),
        *("--retry-max-backoff-ms", str(retries.max_backoff_ms)),
        *("--retry-backoff-multiplier", str(retries.backoff_multiplier)),
        *("--retry-jitter-factor", str(retries.jitter_factor)),
    ]
    breaker = gateway.circuit_breaker
    args += [
        *("--cb-failure-threshold", str(breaker.failure_threshold)),
        *("--cb-success-threshold", str(breaker.success_threshold)),
        *("--cb-timeout-duration-secs", str(breaker.timeout_s)),
        *("--cb-window-duration-secs", str(breaker.window_s)),
    ]
    if not breaker.enabled:
        args.append("--disable-circuit-breaker")
    if gateway.otlp_traces_endpoint is not None:
        args += ["--enable-trace", "--otlp-traces-endpoint", gateway.otlp_traces_endpoint]
    if fleet.engines is not None:
        selector = [f"{k}={v}" for k, v in sorted(labels(fleet, "engine").items())]
        args += [
            "--service-discovery",
            "--selector",
            *selector,
            "--service-discovery-port",
            str(fleet.engines.port),
            "--service-discovery-namespace",
            fleet.namespace,
        ]
    else:
        args += ["--worker-urls", *fleet.external_engine_urls]
    args += ["--prometheus-host", BIND_ALL, "--prometheus-port", str(gateway.metrics_port)]
    return args + list(gateway.extra_args)


def gateway_deployment(fleet: Fleet) -> Manifest:
    gateway = fleet.gateway
    container: Manifest = {
        "name": GATEWAY_CONTAINER,
        "image": gateway.image,
        "imagePullPolicy": gateway.image_pull_policy,
        "command": ["python3", "-m", "sglang_router.launch_router"],
        "args": gateway_args(fleet),
        "ports": [
            {"name": "http", "containerPort": gateway.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": gateway.metrics_port, "protocol": "TCP"},
        ],
        # sglang-router: /health is liveness (always 200); /readiness is 503 while no worker is
        # healthy, so a gateway without engines is not Ready.
        "readinessProbe": http_probe("/readiness", gateway.port, period_s=5, failure_threshold=3),
        "livenessProbe": http_probe("/health", gateway.port, period_s=10, failure_threshold=6, timeout_s=5),
        "securityContext": copy.deepcopy(
            gateway.security_context if gateway.security_context is not None else RESTRICTED_CONTAINER
        ),
    }
    if gateway.resources:
        container["resources"] = copy.deepcopy(gateway.resources)
    pod_spec: Manifest = {
        "serviceAccountName": gateway_name(fleet),
        "enableServiceLinks": False,
        "containers": [container],
    }
    if gateway.security_context is None:
        pod_spec["securityContext"] = copy.deepcopy(RESTRICTED_POD)
    place(pod_spec, gateway.placement)
    return deployment(
        fleet, gateway_name(fleet), "gateway", gateway.replicas, pod_spec, placement=gateway.placement
    )


def gateway_service(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(fleet, gateway_name(fleet), "gateway"),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(fleet, "gateway"),
            "ports": [
                {"name": "http", "port": fleet.gateway.port, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": fleet.gateway.metrics_port,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
