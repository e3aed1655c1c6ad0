"""The sample GPU fleet and the operator's chart, made to run on the local cluster.

Shared by the main job (`./dev demo`) and the operator's e2e tests. `local_fleet` starts from
`operator/samples/gpu.yaml` and changes only what this machine cannot provide: volumes become
hostPaths (the locally built test tokenizer stands in for the model), the engines run the SGLang
emulator's image (a test stand-in for SGLang, behind SGLang's own command line), and resource
requests shrink to fit this machine. The gateway runs the operator's default router image
(images/sglang-router: the real sglang-router).
Everything else is the sample as users apply it.
The rest are small helpers both use: reading a fleet's status, finding its pods by label, and
talking to a proxy the way a rollout worker does (plain HTTP, the admin key from the fleet's Secret).
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import httpx
import yaml

from rolloutfleet_testkit.images.catalog import image_name

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rolloutfleet-operator"
CRDS = ROOT / "crds"
GPU_SAMPLE = ROOT / "operator" / "samples" / "gpu.yaml"
HELM_WAIT_S = 300  # the operator pod's start-up, generous for a loaded 2-core machine
OPERATOR_IMAGE = "rolloutfleet-operator"  # images/operator, tagged with the chart's appVersion
# images/testkit: the real sglang-router and the test kit's stand-ins; images/sglang-emulator: the
# SGLang emulator (a test stand-in for GPU SGLang servers) behind SGLang's command line. Built
# locally like every image here.
# Tagged with the project's version (pyproject.toml), as the images catalog names them.
TESTKIT_IMAGE = image_name("testkit")
EMULATOR_IMAGE = image_name("sglang-emulator")
# SGLang's command line for the fixed-latency stand-in in the test kit's image (images/testkit).
FIXED_LATENCY_SGLANG = "/opt/sglang-fixed-latency"
OPERATOR_LABEL = "app.kubernetes.io/name=rolloutfleet-operator"
OPERATOR_METRICS_PORT = 8080  # the chart's metricsPort
WEIGHTS_MOUNT = "/weights"  # where local_fleet's engines see weights_dir
PROXY_PORT = 8000  # the CRD's default spec.proxy.port (the sample keeps it)
GATEWAY_PORT = 30080


def local_fleet(
    name: str,
    namespace: str,
    tokenizer_dir: str | Path,
    dump_dir: str | Path,
    proxies: int | None = None,
    engines: int | None = None,
    memory: dict[str, Any] | None = None,
    engine_token_delay_s: float | None = None,
    weights_dir: str | Path | None = None,
    fixed_latency_engines: bool = False,
) -> dict[str, Any]:
    """The GPU sample, adapted to the local cluster (pure apart from reading the sample file).
    `engine_token_delay_s` slows the emulated engines' decode steps (generations stay in flight);
    `weights_dir` is mounted into the engines at WEIGHTS_MOUNT, for weight updates from disk;
    `fixed_latency_engines`: the engines run the fixed-latency stand-in from the test kit's image
    (no model: fixed tokens) instead of the SGLang emulator (gigabytes of torch)."""
    fleet = yaml.safe_load(GPU_SAMPLE.read_text())
    fleet["metadata"] = {"name": name, "namespace": namespace}
    proxy, engine = fleet["spec"]["proxy"], fleet["spec"]["engines"]
    if proxies is not None:
        proxy["replicas"] = proxies
    if engines is not None:
        engine["replicas"] = engines
    proxy["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    proxy["tokenizer"]["volume"] = {"hostPath": {"path": str(tokenizer_dir), "type": "Directory"}}
    proxy["dump"] = {"path": proxy["dump"]["path"], "hostPath": {"path": str(dump_dir)}}
    proxy["terminationGracePeriodSeconds"] = 30
    proxy["drainGraceSeconds"] = 10
    proxy["memory"] = copy.deepcopy(memory) if memory is not None else {"rssBudgetBytes": 0}
    fleet["spec"]["gateway"]["resources"] = {"requests": {"cpu": "100m", "memory": "128Mi"}}
    engine["image"] = EMULATOR_IMAGE
    if fixed_latency_engines:
        engine["image"] = TESTKIT_IMAGE
        engine["env"] = [{"name": "PYTHONPATH", "value": FIXED_LATENCY_SGLANG}]
    engine["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}}
    engine["modelPath"] = "/models"
    engine["volumes"] = [{"name": "model", "hostPath": {"path": str(tokenizer_dir), "type": "Directory"}}]
    engine["volumeMounts"] = [{"name": "model", "mountPath": "/models", "readOnly": True}]
    if weights_dir is not None:
        engine["volumes"].append(
            {"name": "weights", "hostPath": {"path": str(weights_dir), "type": "Directory"}}
        )
        engine["volumeMounts"].append({"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True})
    if engine_token_delay_s is not None:
        engine["args"] = [*engine.get("args", []), "--token-delay-s", str(engine_token_delay_s)]
    return fleet


def external_fleet(
    name: str,
    namespace: str,
    tokenizer_dir: str | Path,
    engine_url: str,
    replicas: int,
    **proxy: Any,
) -> dict[str, Any]:
    """A fleet in front of an engine served outside the cluster (a stand-in on this machine), routed
    round-robin with `--worker-urls`; `proxy` adds to spec.proxy (dump, memory, image, env, …)."""
    tokenizer = {"path": "/models/tokenizer", "volume": {"hostPath": {"path": str(tokenizer_dir)}}}
    return {
        "apiVersion": "rolloutfleet.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "proxy": {"replicas": replicas, "tokenizer": tokenizer, **proxy},
            "gateway": {"policy": "round_robin"},  # the operator's default router image
            "externalEngineUrls": [engine_url],
        },
    }


def standin_fleet(
    name: str,
    namespace: str,
    tokenizer_dir: str | Path,
    engine_url: str,
    replicas: int,
    dump_dir: str | Path,
    rss_bytes: int,
    drain_s: float,
    **proxy: Any,
) -> dict[str, Any]:
    """A fleet whose proxies are /stats stand-ins (the test kit image as `stats-standin`: reports
    `rss_bytes` until told otherwise, drains for `drain_s` on SIGTERM): for the watchdog's and the
    node failures' tests, where what matters is the operator, not a proxy's sessions. `proxy` adds
    to spec.proxy (memory, tolerations, grace periods, ...)."""
    return external_fleet(
        name,
        namespace,
        tokenizer_dir,  # required by the CRD; the stand-in reads neither it nor the dumps
        engine_url,
        replicas,
        image=TESTKIT_IMAGE,
        dump={"hostPath": {"path": str(pod_writable(dump_dir))}},
        env=[
            {"name": "TESTKIT_PROGRAM", "value": "stats-standin"},
            {"name": "STANDIN_DRAIN_S", "value": f"{drain_s:g}"},
            {"name": "STANDIN_RSS_BYTES", "value": str(rss_bytes)},
        ],
        **proxy,
    )


def pod_writable(path: str | Path) -> Path:
    """A host directory for a hostPath volume that pods running as any user (the proxy image runs as
    uid 65532) can write: created world-writable, and every directory above it made traversable
    (pytest's temporary directories are private to root)."""
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o005)
    return path


def pod_readable(path: str | Path) -> Path:
    """A host directory (e.g. a model directory for a hostPath volume) that pods running as any
    user can read: its files made world-readable, its directories and every one above it
    traversable (pytest's and the cache's directories are private to root)."""
    path = Path(path).resolve()
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if mode & 0o005 != 0o005:
            directory.chmod(mode | 0o005)
    for file in path.rglob("*"):
        file.chmod(file.stat().st_mode | 0o004 | (0o001 if file.is_dir() else 0))
    return path


def oom_kills(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The OOMKilled terminations a pod's containers report (current or last state)."""
    found = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            terminated = state.get("terminated") or {}
            if terminated.get("reason") == "OOMKilled":
                found.append({"container": status["name"], "restarts": status["restartCount"], **terminated})
    return found


def helm_install_args(
    release: str, namespace: str, watch_namespaces: list[str], extra: dict[str, str] | None = None
) -> list[str]:
    """`helm upgrade --install` arguments for the operator's chart (after the helm binary)."""
    values = {
        "image.repository": OPERATOR_IMAGE,
        "watchNamespaces": "{" + ",".join(watch_namespaces) + "}",
        "resources.requests.cpu": "100m",
        # The tests and the demo apply crds/ with kubectl, once for every release they install.
        "crds.install": "false",
        **(extra or {}),
    }
    sets = [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]
    return [
        "upgrade",
        "--install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        *sets,
        "--wait",
        "--timeout",
        f"{HELM_WAIT_S}s",
    ]


def admin_key(secret: dict[str, Any]) -> str:
    """The proxies' admin key from the fleet's generated Secret (a kubectl -o json document)."""
    return base64.b64decode(secret["data"]["admin-key"]).decode()


def pod_urls(pods: dict[str, Any], port: int) -> dict[str, str]:
    """Pod name → http://podIP:port for a `kubectl get pods -o json` listing (IPs reach pods here)."""
    return {
        pod["metadata"]["name"]: f"http://{pod['status']['podIP']}:{port}"
        for pod in pods["items"]
        if (pod.get("status") or {}).get("podIP") and not pod["metadata"].get("deletionTimestamp")
    }


def component_selector(fleet: str, component: str) -> str:
    """Label selector of one kind of the fleet's pods: proxy, gateway or engine."""
    return f"app.kubernetes.io/instance={fleet},app.kubernetes.io/component={component}"


def condition(status: dict[str, Any], kind: str) -> str | None:
    """The status ("True", "False", "Unknown") of the fleet's condition `kind`, None if absent."""
    return next((c["status"] for c in status.get("conditions", []) if c["type"] == kind), None)


def pod_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (as kubectl shows it; the kit reads the API, not the operator)."""
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def fleet_ready(status: dict[str, Any], replicas: int) -> bool:
    """`replicas` proxies ready and built from the current template, and the Ready condition True."""
    ok = status.get("readyReplicas") == replicas and status.get("updatedReplicas") == replicas
    return ok and condition(status, "Ready") == "True"


def _checked(response: httpx.Response) -> httpx.Response:
    if not response.is_success:
        raise RuntimeError(
            f"{response.request.method} {response.request.url}: {response.status_code} {response.text}"
        )
    return response


def create_session(url: str, key: str) -> tuple[str, str]:
    """A new session on the proxy at `url` (admin `key`): (session id, session key)."""
    response = httpx.post(
        f"{url}/v1/sessions", headers={"Authorization": f"Bearer {key}"}, json={}, timeout=30
    )
    created = _checked(response).json()
    return created["session_id"], created["session_key"]


def session_tokens(url: str, session_id: str, key: str) -> dict[str, Any]:
    """The session as the proxy records it, with its token ids, loss mask and logprobs."""
    response = httpx.get(
        f"{url}/v1/sessions/{session_id}",
        params={"tokens": "true"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    return _checked(response).json()


def one_turn(url: str, session_id: str, key: str, messages: list[dict[str, Any]]) -> str:
    """One chat turn of the session (the full history in `messages`); the assistant's reply."""
    response = httpx.post(
        f"{url}/v1/sessions/{session_id}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"messages": messages, "max_tokens": 12, "seed": 1},
        timeout=60,
    )
    return _checked(response).json()["choices"][0]["message"]["content"]
