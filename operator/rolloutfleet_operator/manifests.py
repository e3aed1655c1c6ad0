"""Pure builders of the fleet's child objects: a Fleet in, Kubernetes manifests (dicts) out.

Every child carries the fleet's labels for its component and a controller ownerReference to the
fleet, so garbage collection removes it with the fleet. Proxy pods are built one at a time
(`proxy_pod`) because the reconciler creates, replaces and deletes them individually under stable
names; everything else comes from `desired_children`. The admin-key Secret is built on its own
(`admin_key_secret`): its value is random, so it is created once and never re-applied.

Proxy settings reach the proxy as environment variables named by the shared contract
(`rolloutfleet_wire.proxy_settings`), which the proxy's settings model must satisfy, so the operator
and the proxy cannot disagree on a name.

Servers bind the wildcard address (`0.0.0.0`), as containers normally do: each pod has its own
network namespace, and a wildcard bind also answers `kubectl port-forward` (which connects to the
pod's loopback), unlike a bind to the pod's own IP.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from rolloutfleet_wire.proxy_settings import INJECTED_ENV as ENV

from .fleet import (
    API_VERSION,
    KIND,
    ORDINAL_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    Component,
    Fleet,
    NetworkPolicySpec,
    Placement,
    client_service_name,
    engine_name,
    engine_service_name,
    gateway_name,
    gateway_url,
    headless_service_name,
    labels,
    proxy_pod_name,
)

Manifest = dict[str, Any]

PROXY_CONTAINER = "proxy"
GATEWAY_CONTAINER = "router"
ENGINE_CONTAINER = "engine"
GPU_RESOURCE = "nvidia.com/gpu"
# SGLang's switch that makes /health cheap instead of a generation that hangs behind a weight update,
# and the one that makes its logprobs untempered.
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
ENGINE_STARTUP_S = 3600  # loading a large model's weights can take tens of minutes
NONROOT_ID = 65532

BIND_ALL = "0.0.0.0"

TOKENIZER_VOLUME = "tokenizer"
DUMP_VOLUME = "dumps"
TMP_VOLUME = "tmp"
SHM_VOLUME = "rolloutfleet-shm"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"

# Pod Security "restricted" for a container (the proxy's and, unless the spec says otherwise, the
# router's): non-root, no privilege escalation, no capabilities, the runtime's seccomp profile.
RESTRICTED_CONTAINER: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": NONROOT_ID,
    "runAsGroup": NONROOT_ID,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_POD: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": NONROOT_ID,
    "runAsGroup": NONROOT_ID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# Engines: GPU images (lmsysorg/sglang) run as root and write caches under $HOME, so the default
# meets Pod Security "baseline" and hardens what does not get in their way; the spec can override.
ENGINE_CONTAINER_DEFAULT: Manifest = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


# --- common parts --------------------------------------------------------------------------------


def owner_reference(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": fleet.name,
        "uid": fleet.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(fleet: Fleet, name: str, component: Component) -> Manifest:
    return {
        "name": name,
        "namespace": fleet.namespace,
        "labels": labels(fleet, component),
        "ownerReferences": [owner_reference(fleet)],
    }


def pod_labels(fleet: Fleet, component: Component, placement: Placement) -> dict[str, str]:
    """The spec's podLabels under the component's own (which the selectors use, so they win)."""
    return {**placement.pod_labels, **labels(fleet, component)}


def _place(pod_spec: Manifest, placement: Placement, default_spread: list[Manifest] | None = None) -> None:
    """Placement from the spec into a pod spec (copied: manifests never alias the parsed fleet)."""
    if placement.node_selector:
        pod_spec["nodeSelector"] = copy.deepcopy(placement.node_selector)
    if placement.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(list(placement.tolerations))
    if placement.affinity:
        pod_spec["affinity"] = copy.deepcopy(placement.affinity)
    spread = copy.deepcopy(list(placement.topology_spread_constraints)) or default_spread
    if spread:
        pod_spec["topologySpreadConstraints"] = spread
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    if placement.image_pull_secrets:
        pod_spec["imagePullSecrets"] = copy.deepcopy(list(placement.image_pull_secrets))


def soft_spread_over_nodes(fleet: Fleet, component: Component) -> list[Manifest]:
    """Prefer different nodes for the component's pods, but schedule them anyway (a small cluster
    may have one node): one node's loss then takes as few proxies as the cluster allows."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME_TOPOLOGY,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": labels(fleet, component)},
        }
    ]


def pod_disruption_budget(fleet: Fleet, component: Component, name: str, max_unavailable: int) -> Manifest:
    """Voluntary disruptions (node drains, evictions) take at most `max_unavailable` of the
    component's pods at once."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(fleet, name, component),
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": labels(fleet, component)}},
    }


def _http_probe(path: str, port: int, period_s: int, failure_threshold: int, timeout_s: int = 2) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failure_threshold,
    }


def _setting(value: Any) -> str:
    """An environment variable's value for a number or string setting (1800.0 -> "1800")."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _env(name: str, value: Any) -> Manifest:
    return {"name": name, "value": _setting(value)}


def _with_overrides(base: list[Manifest], extra: tuple[Manifest, ...]) -> list[Manifest]:
    """`base` followed by `extra`; an `extra` entry replaces a `base` entry of the same name."""
    overridden = {entry["name"] for entry in extra}
    return [entry for entry in base if entry["name"] not in overridden] + [copy.deepcopy(e) for e in extra]


def _merge_resources(resources: dict[str, Any], gpus: int) -> Manifest:
    merged = copy.deepcopy(resources)
    if gpus > 0:
        # Extended resources cannot be overcommitted: a request, if any, must equal the limit.
        merged.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
        if GPU_RESOURCE in merged.get("requests", {}):
            merged["requests"][GPU_RESOURCE] = str(gpus)
    return merged


# --- proxy pods ----------------------------------------------------------------------------------


def _dump_volume(fleet: Fleet) -> Manifest:
    dump = fleet.proxy.dump
    if dump.persistent_volume_claim is not None:
        return {
            "name": DUMP_VOLUME,
            "persistentVolumeClaim": {"claimName": dump.persistent_volume_claim["claimName"]},
        }
    if dump.host_path is not None:
        return {
            "name": DUMP_VOLUME,
            "hostPath": {"path": dump.host_path["path"], "type": "DirectoryOrCreate"},
        }
    return {"name": DUMP_VOLUME, "emptyDir": copy.deepcopy(dump.empty_dir or {})}


def _proxy_env(fleet: Fleet, pod_name: str, public_url: str) -> list[Manifest]:
    proxy = fleet.proxy
    secret = fleet.admin_key_ref
    injected = [
        _env(ENV["upstream_url"], gateway_url(fleet)),
        _env(ENV["tokenizer_path"], proxy.tokenizer.path),
        _env(ENV["stale_session_timeout_s"], proxy.stale_session_timeout_s),
        _env(ENV["cleanup_interval_s"], proxy.cleanup_interval_s),
        _env(ENV["dump_dir"], f"{proxy.dump.path.rstrip('/')}/{pod_name}"),
        _env(ENV["durability"], proxy.dump.durability),
        _env(ENV["drain_grace_s"], proxy.drain_grace_s),
        _env(ENV["public_url"], public_url),
        _env(ENV["export_ttl_s"], proxy.export_ttl_s),
        _env(ENV["engine_logprobs"], proxy.engine_logprobs),
        *_chat_format_env(fleet),
        *_runtime_tunable_env(fleet),
        {
            "name": ENV["admin_key"],
            "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
        },
    ]
    return _with_overrides(copy.deepcopy(injected), proxy.env)


def _chat_format_env(fleet: Fleet) -> list[Manifest]:
    """The served model's chat formats, each only when the spec sets it (else the proxy's default).
    The keywords are compact JSON with sorted keys: the same object always gives the same value, so
    the template hash does not depend on the order the API returns its keys in."""
    proxy = fleet.proxy
    env = []
    if proxy.tool_call_parser is not None:
        env.append(_env(ENV["tool_call_parser"], proxy.tool_call_parser))
    if proxy.reasoning_parser is not None:
        env.append(_env(ENV["reasoning_parser"], proxy.reasoning_parser))
    if proxy.chat_template_kwargs:
        kwargs = json.dumps(proxy.chat_template_kwargs, sort_keys=True, separators=(",", ":"))
        env.append({"name": ENV["chat_template_kwargs"], "value": kwargs})
    return env


# Settings that follow the fleet's scale or budget. They stay out of the template hash: changing
# replicas or the RSS budget must not roll every proxy. A pod keeps the values it was created with
# until it is replaced (admission and the soft limit are approximate for that while, not wrong).
HASH_EXEMPT_ENV = frozenset({ENV["staleness_batch_share"], ENV["rss_soft_limit_bytes"]})


def _runtime_tunable_env(fleet: Fleet) -> list[Manifest]:
    proxy = fleet.proxy
    admission = proxy.admission
    env = []
    if admission.max_staleness is not None:
        env.append(_env(ENV["max_staleness"], admission.max_staleness))
        env.append(_env(ENV["staleness_batch_share"], admission.batch_share(proxy.replicas)))
    if admission.max_concurrent_sessions > 0:
        env.append(_env(ENV["max_concurrent_sessions"], admission.max_concurrent_sessions))
    if proxy.memory.soft_limit_bytes > 0:
        env.append(_env(ENV["rss_soft_limit_bytes"], proxy.memory.soft_limit_bytes))
    return env


def _proxy_pod_body(fleet: Fleet, pod_name: str) -> Manifest:
    """The proxy pod for `pod_name`, without the ordinal label and the template hash."""
    proxy = fleet.proxy
    headless = headless_service_name(fleet)
    public_url = f"http://{pod_name}.{headless}.{fleet.namespace}.svc:{proxy.port}"
    mounts: list[Manifest] = []
    volumes: list[Manifest] = []
    if proxy.tokenizer.volume is not None:
        volumes.append({**copy.deepcopy(proxy.tokenizer.volume), "name": TOKENIZER_VOLUME})
        mounts.append({"name": TOKENIZER_VOLUME, "mountPath": proxy.tokenizer.path, "readOnly": True})
    volumes.append(_dump_volume(fleet))
    mounts.append({"name": DUMP_VOLUME, "mountPath": proxy.dump.path})
    # Last, so a process-kubelet bind mount over /tmp cannot hide the sources of the others.
    volumes.append({"name": TMP_VOLUME, "emptyDir": {}})
    mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
    container: Manifest = {
        "name": PROXY_CONTAINER,
        "image": proxy.image,
        "imagePullPolicy": proxy.image_pull_policy,
        "args": ["--host", BIND_ALL, "--port", str(proxy.port)],
        "env": _proxy_env(fleet, pod_name, public_url),
        **({"envFrom": copy.deepcopy(list(proxy.env_from))} if proxy.env_from else {}),
        "ports": [{"name": "http", "containerPort": proxy.port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        # Restoring a predecessor's sessions can take a while: the startup probe holds the
        # liveness probe off for up to 5 minutes; readiness gates traffic until the proxy has started.
        "startupProbe": _http_probe("/healthz", proxy.port, period_s=1, failure_threshold=300),
        "readinessProbe": _http_probe("/readyz", proxy.port, period_s=5, failure_threshold=2),
        "livenessProbe": _http_probe("/healthz", proxy.port, period_s=10, failure_threshold=6, timeout_s=5),
        "securityContext": {**copy.deepcopy(RESTRICTED_CONTAINER), "readOnlyRootFilesystem": True},
    }
    if proxy.resources:
        container["resources"] = copy.deepcopy(proxy.resources)
    metadata = _metadata(fleet, pod_name, "proxy")
    metadata["labels"] = pod_labels(fleet, "proxy", proxy.placement)
    if proxy.placement.pod_annotations:
        metadata["annotations"] = dict(proxy.placement.pod_annotations)
    spec: Manifest = {
        "hostname": pod_name,
        "subdomain": headless,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": proxy.termination_grace_period_s,
        # The proxy never calls the API; and service links could inject variables such as
        # ROLLOUTFLEET_PROXY_PORT=tcp://... for a Service named "rolloutfleet-proxy".
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {**copy.deepcopy(RESTRICTED_POD), "fsGroup": NONROOT_ID},
        "containers": [container],
        "volumes": volumes,
    }
    if proxy.service_account_name:
        spec["serviceAccountName"] = proxy.service_account_name
    _place(spec, proxy.placement, soft_spread_over_nodes(fleet, "proxy"))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def template_hash(fleet: Fleet) -> str:
    """A short, stable hash of the proxy pod template: every part that comes from the spec.

    The pod is built for a placeholder name, so the name and the ordinal (and what is derived from
    them: hostname, dump subdirectory, public URL) do not enter; replicas and the memory watchdog's
    settings are not part of the pod, so changing them does not roll the proxies; nor do the
    settings derived from them (HASH_EXEMPT_ENV).
    """
    body = _proxy_pod_body(fleet, "$(POD_NAME)")
    for container in body["spec"]["containers"]:
        container["env"] = [e for e in container["env"] if e["name"] not in HASH_EXEMPT_ENV]
    identity = {key: body["metadata"].get(key) for key in ("labels", "annotations")}
    canonical = json.dumps({**identity, "spec": body["spec"]}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def proxy_pod(fleet: Fleet, ordinal: int) -> Manifest:
    """Proxy pod `<fleet>-proxy-<ordinal>`, annotated with the current template hash."""
    name = proxy_pod_name(fleet, ordinal)
    pod = _proxy_pod_body(fleet, name)
    pod["metadata"]["labels"][ORDINAL_LABEL] = str(ordinal)
    pod["metadata"]["annotations"] = {
        **pod["metadata"].get("annotations", {}),
        TEMPLATE_HASH_ANNOTATION: template_hash(fleet),
    }
    return pod


def headless_service(fleet: Fleet) -> Manifest:
    """Per-pod DNS for the proxies; not-ready pods get records too, so a starting proxy's public URL
    resolves as soon as the pod has an address."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, headless_service_name(fleet), "proxy"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(fleet, "proxy"),
            "ports": [{"name": "http", "port": fleet.proxy.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def client_service(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, client_service_name(fleet), "proxy"),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(fleet, "proxy"),
            "ports": [{"name": "http", "port": fleet.proxy.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def admin_key_secret(fleet: Fleet, key: str) -> Manifest:
    """The generated admin-key Secret (only when the spec names none); the caller supplies the key."""
    ref = fleet.admin_key_ref
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(fleet, ref.name, "proxy"),
        "type": "Opaque",
        "stringData": {ref.key: key},
    }


# --- gateway -------------------------------------------------------------------------------------


def gateway_service_account(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(fleet, gateway_name(fleet), "gateway"),
    }


def gateway_role(fleet: Fleet) -> Manifest:
    """What the router's service discovery needs: reading pods in the fleet's namespace."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(fleet, gateway_name(fleet), "gateway"),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def gateway_role_binding(fleet: Fleet) -> Manifest:
    name = gateway_name(fleet)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(fleet, name, "gateway"),
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
        *("--retry-backoff-multiplier", _setting(retries.backoff_multiplier)),
        *("--retry-jitter-factor", _setting(retries.jitter_factor)),
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
        "readinessProbe": _http_probe("/readiness", gateway.port, period_s=5, failure_threshold=3),
        "livenessProbe": _http_probe("/health", gateway.port, period_s=10, failure_threshold=6, timeout_s=5),
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
    _place(pod_spec, gateway.placement)
    return _deployment(
        fleet, gateway_name(fleet), "gateway", gateway.replicas, pod_spec, placement=gateway.placement
    )


def gateway_service(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, gateway_name(fleet), "gateway"),
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


# --- engines -------------------------------------------------------------------------------------


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
            *engines.args,
        ],
        "env": _with_overrides(engine_env(fleet), engines.env),
        **({"envFrom": copy.deepcopy(list(engines.env_from))} if engines.env_from else {}),
        "ports": [{"name": "http", "containerPort": engines.port, "protocol": "TCP"}],
        # With health generation off, SGLang's /health answers at once, also while weights update
        # (a generating /health hangs then and would fail the probes on every weight sync). The
        # startup probe gives weight loading up to an hour before liveness counts.
        "startupProbe": _http_probe(
            "/health", engines.port, period_s=10, failure_threshold=ENGINE_STARTUP_S // 10, timeout_s=5
        ),
        "readinessProbe": _http_probe("/health", engines.port, period_s=5, failure_threshold=3, timeout_s=5),
        "livenessProbe": _http_probe("/health", engines.port, period_s=15, failure_threshold=8, timeout_s=10),
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
    _place(pod_spec, engines.placement)
    # GPUs are usually all taken: a surge pod would stay Pending, so replace in place.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return _deployment(
        fleet, engine_name(fleet), "engine", engines.replicas, pod_spec, strategy, placement=engines.placement
    )


def engine_env(fleet: Fleet) -> list[Manifest]:
    env = [_env(HEALTH_GENERATION_ENV, "0")]
    if fleet.proxy.engine_logprobs == "original":  # the engines and the proxies' records agree
        env.append(_env(ORIGINAL_LOGPROB_ENV, "1"))
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
        "metadata": _metadata(fleet, engine_service_name(fleet), "engine"),
        "spec": {"clusterIP": "None", "selector": labels(fleet, "engine"), "ports": [port]},
    }


def _deployment(
    fleet: Fleet,
    name: str,
    component: Component,
    replicas: int,
    pod_spec: Manifest,
    strategy: Manifest | None = None,
    *,
    placement: Placement,
) -> Manifest:
    template_metadata: Manifest = {"labels": pod_labels(fleet, component, placement)}
    if placement.pod_annotations:
        template_metadata["annotations"] = dict(placement.pod_annotations)
    spec: Manifest = {
        "replicas": replicas,
        "selector": {"matchLabels": labels(fleet, component)},
        "template": {"metadata": template_metadata, "spec": pod_spec},
    }
    if strategy:
        spec["strategy"] = strategy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(fleet, name, component),
        "spec": spec,
    }


# --- network policies ----------------------------------------------------------------------------

OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "rolloutfleet-operator"}  # the chart's selector labels


def _peer(pods: dict[str, Any], namespaces: dict[str, Any] | None) -> Manifest:
    """A NetworkPolicy peer: pods matching `pods`, in the namespaces matching `namespaces` (None:
    the policy's own namespace)."""
    peer: Manifest = {"podSelector": copy.deepcopy(pods)}
    if namespaces is not None:
        peer["namespaceSelector"] = copy.deepcopy(namespaces)
    return peer


def _namespace_named(name: str) -> Manifest:
    return {"matchLabels": {"kubernetes.io/metadata.name": name}}


def _ingress(peers: list[Manifest], ports: list[int] | None) -> Manifest:
    rule: Manifest = {"from": peers}
    if ports is not None:
        rule["ports"] = [{"protocol": "TCP", "port": port} for port in ports]
    return rule


def _network_policy(fleet: Fleet, component: Component, name: str, rules: list[Manifest]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(fleet, name, component),
        "spec": {
            "podSelector": {"matchLabels": labels(fleet, component)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def network_policies(fleet: Fleet, policy: NetworkPolicySpec) -> list[Manifest]:
    """Ingress to the fleet's pods only from those that need it: proxies from the clients (rollout
    workers, trainers) and the operator (its /stats polls); the gateway from the fleet's proxies;
    engines from the gateway and the clients (trainers pause them and update their weights, NCCL
    on any port). Metrics ports also from the scrapers' namespaces, when named."""
    clients = _peer(policy.clients, policy.client_namespaces)
    operator = _peer({"matchLabels": OPERATOR_POD_LABELS}, _namespace_named(policy.operator_namespace))
    scrapers = [_peer({}, policy.scrapers)] if policy.scrapers is not None else []
    proxy_port, gateway = fleet.proxy.port, fleet.gateway
    proxy_rules = [_ingress([clients, operator, *scrapers], [proxy_port])]
    gateway_rules = [_ingress([_peer({"matchLabels": labels(fleet, "proxy")}, None)], [gateway.port])]
    if scrapers:
        gateway_rules.append(_ingress(scrapers, [gateway.metrics_port]))
    policies = [
        _network_policy(fleet, "proxy", client_service_name(fleet), proxy_rules),
        _network_policy(fleet, "gateway", gateway_name(fleet), gateway_rules),
    ]
    if fleet.engines is not None:
        from_gateway = _ingress(
            [_peer({"matchLabels": labels(fleet, "gateway")}, None)], [fleet.engines.port]
        )
        engine_rules = [from_gateway, _ingress([clients], None)]
        if scrapers:
            engine_rules.append(_ingress(scrapers, [fleet.engines.port]))
        policies.append(_network_policy(fleet, "engine", engine_name(fleet), engine_rules))
    return policies


NETWORK_POLICY_NAMES = (client_service_name, gateway_name, engine_name)


# --- everything ----------------------------------------------------------------------------------


def unwanted_children(fleet: Fleet) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of children this fleet may have created earlier but no longer wants:
    the engine Deployment once the spec switched to external engines (it would hold its GPUs)."""
    unwanted = []
    if fleet.engines is None:
        unwanted += [
            ("apps/v1", "Deployment", engine_name(fleet)),
            ("v1", "Service", engine_service_name(fleet)),
            ("policy/v1", "PodDisruptionBudget", engine_name(fleet)),
        ]
    # NetworkPolicies turned off in the operator, or the engine's once the engines are gone.
    wanted = (
        {c["metadata"]["name"] for c in network_policies(fleet, fleet.network_policy)}
        if fleet.network_policy
        else set()
    )
    unwanted += [
        ("networking.k8s.io/v1", "NetworkPolicy", name(fleet))
        for name in NETWORK_POLICY_NAMES
        if name(fleet) not in wanted
    ]
    return unwanted


def desired_children(fleet: Fleet) -> list[Manifest]:
    """Every child except proxy pods and the admin-key Secret, in a safe order of creation."""
    children = [
        headless_service(fleet),
        client_service(fleet),
        pod_disruption_budget(fleet, "proxy", client_service_name(fleet), fleet.proxy.memory.max_unavailable),
        gateway_service_account(fleet),
        gateway_role(fleet),
        gateway_role_binding(fleet),
        gateway_service(fleet),
        pod_disruption_budget(fleet, "gateway", gateway_name(fleet), fleet.gateway.max_unavailable),
        gateway_deployment(fleet),
    ]
    if fleet.engines is not None:
        engines = fleet.engines
        children += [
            engine_service(fleet),
            pod_disruption_budget(fleet, "engine", engine_name(fleet), engines.max_unavailable),
            engine_deployment(fleet),
        ]
    if fleet.network_policy is not None:
        children += network_policies(fleet, fleet.network_policy)
    return children
