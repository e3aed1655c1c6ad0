"""A typed, read-only view of a RolloutFleet object, and the names and labels of its children.

`parse_fleet` takes the object as the API returns it (a camelCase dict). The API server has
applied the CRD's defaults already; the same defaults apply here (DEFAULTS below, generated from the
CRD's source by ./dev crd) so a partial object, e.g. from a test or an older stored version, still
parses into a complete view. What is read by its path instead (the proxy settings the operator
injects, by the table in rolloutfleet_wire.proxy_settings) comes from `Fleet.spec_value`, with the
same defaults.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rolloutfleet_wire.fleet_defaults import PROXY_MEMORY_REFUSE_NEW_SESSIONS_PERCENT, SPEC_DEFAULTS

API_GROUP = "rolloutfleet.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "RolloutFleet"

Component = Literal["proxy", "gateway", "engine"]

# Label and annotation keys.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
FLEET_LABEL = f"{API_GROUP}/fleet"
ORDINAL_LABEL = f"{API_GROUP}/ordinal"
TEMPLATE_HASH_ANNOTATION = f"{API_GROUP}/template-hash"
# On every applied child but proxy pods: the hash of the manifest it was applied from (desired_state.py).
DESIRED_HASH_ANNOTATION = f"{API_GROUP}/desired-hash"
APP_NAME = "rolloutfleet"
MANAGER = "rolloutfleet-operator"

# The key of the generated admin-key Secret (used when spec.proxy.adminKeySecret is not set).
GENERATED_ADMIN_KEY_KEY = "admin-key"

# The longest suffix a child's name adds to the fleet's (a proxy pod `<fleet>-proxy-<ordinal>`,
# ordinal < 1000, is also its hostname: a DNS label of at most 63 characters). The CRD refuses
# longer fleet names with a CEL rule on metadata.name (a test checks they agree).
MAX_FLEET_NAME_LENGTH = 63 - len("-proxy-999")

# The CRD's defaults, by path under spec (generated from the CRD's source).
DEFAULTS: dict[str, Any] = dict(SPEC_DEFAULTS)


# The operator's own settings for every fleet, from its environment (the chart sets them): the
# images used where the spec names none (`<registry>/<name>:<version>`; else local names of this
# release), and whether fleets get NetworkPolicies (JSON, see NetworkPolicySpec).
PROXY_IMAGE_ENV = "ROLLOUTFLEET_DEFAULT_PROXY_IMAGE"
GATEWAY_IMAGE_ENV = "ROLLOUTFLEET_DEFAULT_GATEWAY_IMAGE"
NETWORK_POLICY_ENV = "ROLLOUTFLEET_NETWORK_POLICY"
# Rollout workers and trainers label their pods with this to reach proxies (and engines) when the
# fleets have NetworkPolicies, unless the operator is told another selector.
CLIENT_LABEL = f"{API_GROUP}/client"
# The sglang-router release the tests run (pyproject.toml pins the same): the default gateway image.
SGLANG_ROUTER_VERSION = "0.3.2"


def package_version() -> str:
    try:
        return importlib.metadata.version("rolloutfleet")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0.0.0"


@dataclass(frozen=True)
class NetworkPolicySpec:
    """Who may reach a fleet's pods when its NetworkPolicies are on (Kubernetes LabelSelectors)."""

    clients: dict[str, Any]  # pods of rollout workers and trainers: proxies and engines
    client_namespaces: dict[str, Any] | None  # their namespaces; None: the fleet's own
    operator_namespace: str  # the operator's pods poll the proxies' /stats from there
    scrapers: dict[str, Any] | None  # namespaces allowed to scrape metrics ports (Prometheus); None: none

    @classmethod
    def parse(cls, text: str) -> NetworkPolicySpec:
        """From the JSON the chart puts in ROLLOUTFLEET_NETWORK_POLICY. Pure."""
        raw = json.loads(text)
        if not raw.get("operatorNamespace"):
            raise ValueError(f"{NETWORK_POLICY_ENV} needs operatorNamespace")
        return cls(
            clients=raw.get("clients") or {"matchLabels": {CLIENT_LABEL: "true"}},
            client_namespaces=raw.get("clientNamespaces"),
            operator_namespace=raw["operatorNamespace"],
            scrapers=raw.get("scrapeNamespaces"),
        )


@dataclass(frozen=True)
class OperatorDefaults:
    proxy_image: str
    gateway_image: str
    network_policy: NetworkPolicySpec | None = None  # None: fleets get no NetworkPolicies

    @classmethod
    def from_environment(cls, env: Mapping[str, str], version: str) -> OperatorDefaults:
        """Pure: the operator's settings for that environment and package version."""
        policy = env.get(NETWORK_POLICY_ENV)
        return cls(
            proxy_image=env.get(PROXY_IMAGE_ENV) or f"rolloutfleet-proxy:{version}",
            gateway_image=env.get(GATEWAY_IMAGE_ENV) or f"rolloutfleet-sglang-router:{SGLANG_ROUTER_VERSION}",
            network_policy=NetworkPolicySpec.parse(policy) if policy else None,
        )


def operator_defaults() -> OperatorDefaults:
    return OperatorDefaults.from_environment(os.environ, package_version())


def _default(path: str) -> Any:
    return DEFAULTS[path]


def _get(section: Mapping[str, Any], key: str, path: str) -> Any:
    value = section.get(key)
    return _default(path) if value is None else value


def _copy_dict(value: Any) -> dict[str, Any]:
    return copy.deepcopy(dict(value)) if value else {}


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _copy_list(value: Any) -> tuple[Any, ...]:
    return tuple(copy.deepcopy(list(value))) if value else ()


@dataclass(frozen=True)
class Placement:
    """Where and with what identity a component's pods run (the CRD's shared placement block)."""

    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    affinity: dict[str, Any]
    topology_spread_constraints: tuple[dict[str, Any], ...]
    priority_class_name: str | None
    image_pull_secrets: tuple[dict[str, Any], ...]
    pod_labels: dict[str, str]
    pod_annotations: dict[str, str]


def _parse_placement(raw: Mapping[str, Any]) -> Placement:
    return Placement(
        node_selector=_copy_dict(raw.get("nodeSelector")),
        tolerations=_copy_list(raw.get("tolerations")),
        affinity=_copy_dict(raw.get("affinity")),
        topology_spread_constraints=_copy_list(raw.get("topologySpreadConstraints")),
        priority_class_name=_optional_str(raw.get("priorityClassName")),
        image_pull_secrets=_copy_list(raw.get("imagePullSecrets")),
        pod_labels={str(k): str(v) for k, v in (raw.get("podLabels") or {}).items()},
        pod_annotations={str(k): str(v) for k, v in (raw.get("podAnnotations") or {}).items()},
    )


@dataclass(frozen=True)
class TokenizerSpec:
    path: str
    volume: dict[str, Any] | None  # a pod volume source (without the name), or None (in the image)


@dataclass(frozen=True)
class DumpSpec:
    path: str
    persistent_volume_claim: dict[str, Any] | None
    host_path: dict[str, Any] | None
    empty_dir: dict[str, Any] | None  # None when another source is set; {} is the default


@dataclass(frozen=True)
class MemorySpec:
    rss_budget_bytes: int
    check_interval_s: int
    consecutive_samples: int
    max_unavailable: int
    cooldown_s: int
    max_cooldown_s: int
    dry_run: bool
    refuse_new_sessions_percent: int = PROXY_MEMORY_REFUSE_NEW_SESSIONS_PERCENT

    @property
    def enabled(self) -> bool:
        return self.rss_budget_bytes > 0

    @property
    def soft_limit_bytes(self) -> int:
        """RSS from which a proxy refuses new sessions (0: never)."""
        if not self.enabled or self.refuse_new_sessions_percent <= 0:
            return 0
        return self.rss_budget_bytes * self.refuse_new_sessions_percent // 100


@dataclass(frozen=True)
class AdmissionSpec:
    consumer_batch_size: int | None

    def batch_share(self, replicas: int) -> int | None:
        """Each proxy's share of the consumer batch: rounded up, so the fleet admits at least a
        whole batch per version, and at least 1."""
        if self.consumer_batch_size is None:
            return None
        return max(1, -(-self.consumer_batch_size // max(replicas, 1)))


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class ProxySpec:
    replicas: int
    image: str
    image_pull_policy: str
    port: int
    resources: dict[str, Any]
    tokenizer: TokenizerSpec
    termination_grace_period_s: int
    dump: DumpSpec
    memory: MemorySpec
    admission: AdmissionSpec
    env: tuple[dict[str, Any], ...]
    env_from: tuple[dict[str, Any], ...]
    placement: Placement
    service_account_name: str | None
    admin_key_secret: SecretKeyRef | None  # None: the operator generates `<fleet>-admin-key`
    # What the engines' logprobs are: "tempered" (SGLang's default) or "original"
    # (SGLANG_RETURN_ORIGINAL_LOGPROB=1, set on operator-run engines to match).
    engine_logprobs: str


@dataclass(frozen=True)
class GatewayRetries:
    max_retries: int  # attempts, the first included
    initial_backoff_ms: int
    max_backoff_ms: int
    backoff_multiplier: float
    jitter_factor: float


@dataclass(frozen=True)
class CircuitBreaker:
    enabled: bool
    failure_threshold: int
    success_threshold: int
    timeout_s: int
    window_s: int


@dataclass(frozen=True)
class GatewaySpec:
    image: str
    image_pull_policy: str
    replicas: int
    max_unavailable: int
    port: int
    policy: str
    assignment_mode: str  # how policy manual places a session it has not seen
    retries: GatewayRetries
    circuit_breaker: CircuitBreaker
    otlp_traces_endpoint: str | None  # None: no tracing
    metrics_port: int
    extra_args: tuple[str, ...]
    resources: dict[str, Any]
    placement: Placement
    security_context: dict[str, Any] | None  # None: the operator's restricted default


@dataclass(frozen=True)
class EngineSpec:
    replicas: int
    image: str
    image_pull_policy: str
    model_path: str
    port: int
    tensor_parallel_size: int
    gpus_per_engine: int
    args: tuple[str, ...]
    resources: dict[str, Any]
    volumes: tuple[dict[str, Any], ...]
    volume_mounts: tuple[dict[str, Any], ...]
    termination_grace_period_s: int
    placement: Placement
    env: tuple[dict[str, Any], ...]
    env_from: tuple[dict[str, Any], ...]
    runtime_class_name: str | None
    service_account_name: str | None
    shm_size: str | None
    max_unavailable: int
    security_context: dict[str, Any] | None  # None: the operator's baseline default
    pod_security_context: dict[str, Any] | None


@dataclass(frozen=True)
class Fleet:
    name: str
    namespace: str
    uid: str
    generation: int
    labels: dict[str, str]
    proxy: ProxySpec
    gateway: GatewaySpec
    engines: EngineSpec | None
    external_engine_urls: tuple[str, ...]
    network_policy: NetworkPolicySpec | None = None
    # The spec as the object holds it (a copy), for what is read by its path: the proxy settings the
    # operator injects (rolloutfleet_wire.proxy_settings names them by path).
    spec: Mapping[str, Any] = field(default_factory=dict)

    def spec_value(self, path: str) -> Any:
        """The value at `path` under spec (e.g. "proxy.dump.durability"): the object's, else the
        CRD's default, else None."""
        node: Any = self.spec
        for key in path.split("."):
            node = node.get(key) if isinstance(node, Mapping) else None
            if node is None:
                return DEFAULTS.get(path)
        return node

    @property
    def admin_key_ref(self) -> SecretKeyRef:
        """Where the proxies' admin key lives: the spec's Secret, or the generated one."""
        if self.proxy.admin_key_secret is not None:
            return self.proxy.admin_key_secret
        return SecretKeyRef(generated_admin_key_secret_name(self), GENERATED_ADMIN_KEY_KEY)

    @property
    def generates_admin_key(self) -> bool:
        return self.proxy.admin_key_secret is None


def _parse_dump(raw: Mapping[str, Any]) -> DumpSpec:
    pvc = raw.get("persistentVolumeClaim")
    host = raw.get("hostPath")
    empty = raw.get("emptyDir")
    if pvc is None and host is None and empty is None:
        empty = {}
    return DumpSpec(
        path=_get(raw, "path", "proxy.dump.path"),
        persistent_volume_claim=_copy_dict(pvc) if pvc is not None else None,
        host_path=_copy_dict(host) if host is not None else None,
        empty_dir=_copy_dict(empty) if empty is not None else None,
    )


def _parse_memory(raw: Mapping[str, Any]) -> MemorySpec:
    return MemorySpec(
        rss_budget_bytes=int(_get(raw, "rssBudgetBytes", "proxy.memory.rssBudgetBytes")),
        check_interval_s=int(_get(raw, "checkIntervalSeconds", "proxy.memory.checkIntervalSeconds")),
        consecutive_samples=int(_get(raw, "consecutiveSamples", "proxy.memory.consecutiveSamples")),
        max_unavailable=int(_get(raw, "maxUnavailable", "proxy.memory.maxUnavailable")),
        cooldown_s=int(_get(raw, "cooldownSeconds", "proxy.memory.cooldownSeconds")),
        max_cooldown_s=int(_get(raw, "maxCooldownSeconds", "proxy.memory.maxCooldownSeconds")),
        dry_run=bool(_get(raw, "dryRun", "proxy.memory.dryRun")),
        refuse_new_sessions_percent=int(
            _get(raw, "refuseNewSessionsPercent", "proxy.memory.refuseNewSessionsPercent")
        ),
    )


def _parse_admission(raw: Mapping[str, Any]) -> AdmissionSpec:
    staleness, batch = raw.get("maxStaleness"), raw.get("consumerBatchSize")
    if (staleness is None) != (batch is None):
        raise ValueError("spec.proxy.admission.maxStaleness and consumerBatchSize go together")
    return AdmissionSpec(consumer_batch_size=None if batch is None else int(batch))


def _parse_proxy(raw: Mapping[str, Any], defaults: OperatorDefaults) -> ProxySpec:
    tokenizer = raw.get("tokenizer") or {}
    if not tokenizer.get("path"):
        raise ValueError("spec.proxy.tokenizer.path is required")
    admin = raw.get("adminKeySecret")
    return ProxySpec(
        replicas=int(_get(raw, "replicas", "proxy.replicas")),
        image=raw.get("image") or defaults.proxy_image,
        image_pull_policy=_get(raw, "imagePullPolicy", "proxy.imagePullPolicy"),
        port=int(_get(raw, "port", "proxy.port")),
        resources=_copy_dict(raw.get("resources")),
        tokenizer=TokenizerSpec(
            path=tokenizer["path"],
            volume=_copy_dict(tokenizer["volume"]) if tokenizer.get("volume") else None,
        ),
        termination_grace_period_s=int(
            _get(raw, "terminationGracePeriodSeconds", "proxy.terminationGracePeriodSeconds")
        ),
        dump=_parse_dump(raw.get("dump") or {}),
        memory=_parse_memory(raw.get("memory") or {}),
        admission=_parse_admission(raw.get("admission") or {}),
        env=_copy_list(raw.get("env")),
        env_from=_copy_list(raw.get("envFrom")),
        placement=_parse_placement(raw),
        service_account_name=_optional_str(raw.get("serviceAccountName")),
        admin_key_secret=SecretKeyRef(admin["name"], admin["key"]) if admin else None,
        engine_logprobs=_get(raw, "engineLogprobs", "proxy.engineLogprobs"),
    )


def _optional_dict(value: Any) -> dict[str, Any] | None:
    return None if value is None else _copy_dict(value)


def _parse_gateway_retries(raw: Mapping[str, Any]) -> GatewayRetries:
    return GatewayRetries(
        max_retries=int(_get(raw, "maxRetries", "gateway.retries.maxRetries")),
        initial_backoff_ms=int(_get(raw, "initialBackoffMillis", "gateway.retries.initialBackoffMillis")),
        max_backoff_ms=int(_get(raw, "maxBackoffMillis", "gateway.retries.maxBackoffMillis")),
        backoff_multiplier=float(_get(raw, "backoffMultiplier", "gateway.retries.backoffMultiplier")),
        jitter_factor=float(_get(raw, "jitterFactor", "gateway.retries.jitterFactor")),
    )


def _parse_circuit_breaker(raw: Mapping[str, Any]) -> CircuitBreaker:
    return CircuitBreaker(
        enabled=bool(_get(raw, "enabled", "gateway.circuitBreaker.enabled")),
        failure_threshold=int(_get(raw, "failureThreshold", "gateway.circuitBreaker.failureThreshold")),
        success_threshold=int(_get(raw, "successThreshold", "gateway.circuitBreaker.successThreshold")),
        timeout_s=int(_get(raw, "timeoutSeconds", "gateway.circuitBreaker.timeoutSeconds")),
        window_s=int(_get(raw, "windowSeconds", "gateway.circuitBreaker.windowSeconds")),
    )


def _parse_gateway(raw: Mapping[str, Any], defaults: OperatorDefaults) -> GatewaySpec:
    replicas = int(_get(raw, "replicas", "gateway.replicas"))
    policy = _get(raw, "policy", "gateway.policy")
    if replicas > 1 and policy == "manual":  # the CRD's CEL rule, for objects that bypassed it
        raise ValueError("spec.gateway.replicas must be 1 with policy manual")
    return GatewaySpec(
        image=raw.get("image") or defaults.gateway_image,
        image_pull_policy=_get(raw, "imagePullPolicy", "gateway.imagePullPolicy"),
        replicas=replicas,
        max_unavailable=int(_get(raw, "maxUnavailable", "gateway.maxUnavailable")),
        port=int(_get(raw, "port", "gateway.port")),
        policy=policy,
        assignment_mode=_get(raw, "assignmentMode", "gateway.assignmentMode"),
        retries=_parse_gateway_retries(raw.get("retries") or {}),
        circuit_breaker=_parse_circuit_breaker(raw.get("circuitBreaker") or {}),
        otlp_traces_endpoint=(raw.get("tracing") or {}).get("otlpEndpoint"),
        metrics_port=int(_get(raw, "metricsPort", "gateway.metricsPort")),
        extra_args=tuple(str(a) for a in raw.get("extraArgs") or ()),
        resources=_copy_dict(raw.get("resources")),
        placement=_parse_placement(raw),
        security_context=_optional_dict(raw.get("securityContext")),
    )


def _parse_engines(raw: Mapping[str, Any]) -> EngineSpec:
    if not raw.get("modelPath"):
        raise ValueError("spec.engines.modelPath is required")
    if not raw.get("image"):
        raise ValueError("spec.engines.image is required")
    shm = raw.get("shmSize")
    return EngineSpec(
        replicas=int(_get(raw, "replicas", "engines.replicas")),
        image=raw["image"],
        image_pull_policy=_get(raw, "imagePullPolicy", "engines.imagePullPolicy"),
        model_path=raw["modelPath"],
        port=int(_get(raw, "port", "engines.port")),
        tensor_parallel_size=int(_get(raw, "tensorParallelSize", "engines.tensorParallelSize")),
        gpus_per_engine=int(_get(raw, "gpusPerEngine", "engines.gpusPerEngine")),
        args=tuple(str(a) for a in raw.get("args") or ()),
        resources=_copy_dict(raw.get("resources")),
        volumes=_copy_list(raw.get("volumes")),
        volume_mounts=_copy_list(raw.get("volumeMounts")),
        termination_grace_period_s=int(
            _get(raw, "terminationGracePeriodSeconds", "engines.terminationGracePeriodSeconds")
        ),
        placement=_parse_placement(raw),
        env=_copy_list(raw.get("env")),
        env_from=_copy_list(raw.get("envFrom")),
        runtime_class_name=_optional_str(raw.get("runtimeClassName")),
        service_account_name=_optional_str(raw.get("serviceAccountName")),
        shm_size=None if shm is None else str(shm),
        max_unavailable=int(_get(raw, "maxUnavailable", "engines.maxUnavailable")),
        security_context=_optional_dict(raw.get("securityContext")),
        pod_security_context=_optional_dict(raw.get("podSecurityContext")),
    )


def parse_fleet(obj: Mapping[str, Any], defaults: OperatorDefaults | None = None) -> Fleet:
    """The typed view of a RolloutFleet object (as returned by the API: a camelCase dict); images
    the spec leaves unset and NetworkPolicies come from `defaults` (default: the operator's
    environment).

    Raises ValueError when required fields are missing or both/neither of spec.engines and
    spec.externalEngineUrls are set (the CRD's CEL rules reject such objects; this is a guard).
    """
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    if not metadata.get("name"):
        raise ValueError("metadata.name is required")
    if "proxy" not in spec:
        raise ValueError("spec.proxy is required")
    if len(metadata["name"]) > MAX_FLEET_NAME_LENGTH:
        raise ValueError(f"metadata.name must be at most {MAX_FLEET_NAME_LENGTH} characters")
    defaults = defaults or operator_defaults()
    engines_raw = spec.get("engines")
    urls = tuple(spec.get("externalEngineUrls") or ())
    if (engines_raw is None) == (not urls):
        raise ValueError("set exactly one of spec.engines or spec.externalEngineUrls")
    return Fleet(
        name=metadata["name"],
        namespace=metadata.get("namespace") or "default",
        uid=metadata.get("uid") or "",
        generation=int(metadata.get("generation") or 0),
        labels=dict(metadata.get("labels") or {}),
        proxy=_parse_proxy(spec["proxy"] or {}, defaults),
        gateway=_parse_gateway(spec.get("gateway") or {}, defaults),
        engines=_parse_engines(engines_raw) if engines_raw is not None else None,
        external_engine_urls=urls,
        network_policy=defaults.network_policy,
        spec=copy.deepcopy(dict(spec)),
    )


# --- names ---------------------------------------------------------------------------------------


def proxy_pod_name(fleet: Fleet, ordinal: int) -> str:
    return f"{fleet.name}-proxy-{ordinal}"


def proxy_ordinal(fleet: Fleet, pod_name: str) -> int | None:
    """The ordinal in a proxy pod's name (`<fleet>-proxy-<i>`), or None for any other name."""
    prefix = f"{fleet.name}-proxy-"
    if not pod_name.startswith(prefix):
        return None
    rest = pod_name[len(prefix) :]
    if not rest.isdigit() or (len(rest) > 1 and rest.startswith("0")):
        return None
    return int(rest)


def headless_service_name(fleet: Fleet) -> str:
    """The headless Service giving each proxy pod its DNS name `<pod>.<headless>.<ns>.svc`."""
    return f"{fleet.name}-proxies"


def client_service_name(fleet: Fleet) -> str:
    """The ClusterIP Service in front of all proxies."""
    return f"{fleet.name}-proxy"


def gateway_name(fleet: Fleet) -> str:
    """Name of the gateway Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return f"{fleet.name}-gateway"


def engine_name(fleet: Fleet) -> str:
    return f"{fleet.name}-engine"


def engine_service_name(fleet: Fleet) -> str:
    """The headless Service over the engine pods (DNS for the trainer's pause and weight updates)."""
    return f"{fleet.name}-engines"


def generated_admin_key_secret_name(fleet: Fleet) -> str:
    return f"{fleet.name}-admin-key"


def proxy_public_url(fleet: Fleet, ordinal: int) -> str:
    """A proxy pod's stable URL through the headless Service's per-pod DNS record."""
    pod = proxy_pod_name(fleet, ordinal)
    return f"http://{pod}.{headless_service_name(fleet)}.{fleet.namespace}.svc:{fleet.proxy.port}"


def gateway_url(fleet: Fleet) -> str:
    return f"http://{gateway_name(fleet)}.{fleet.namespace}.svc:{fleet.gateway.port}"


# --- labels --------------------------------------------------------------------------------------


def labels(fleet: Fleet, component: Component) -> dict[str, str]:
    """The labels of a child of the fleet; also the selector of that component's pods."""
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: fleet.name,
        COMPONENT_LABEL: component,
        MANAGED_BY_LABEL: MANAGER,
        FLEET_LABEL: fleet.name,
    }


def selector_string(fleet: Fleet, component: Component) -> str:
    """The component's label selector as `k=v,k=v` (status.selector, list calls)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels(fleet, component).items()))
