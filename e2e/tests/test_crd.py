"""The RolloutFleet CRD against a real API server: it installs with `kubectl apply -f crds/`, the
samples apply cleanly, defaults are filled in, CEL rules reject invalid fleets with their messages,
typos inside Kubernetes-typed fields (resources, tolerations, volumes) are refused at apply with the
API server's message, `kubectl explain` documents the fields and `kubectl scale` works through the
scale subresource."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CRD_NAME = "rolloutfleets.rolloutfleet.dev"


@pytest.fixture(scope="module")
def crd(cluster):
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl_client().wait_established(CRD_NAME)
    return CRD_NAME


def fleet(name: str, spec: dict) -> str:
    return json.dumps(
        {
            "apiVersion": "rolloutfleet.dev/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def test_samples_apply_cleanly_and_get_defaults(cluster, crd, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "operator" / "samples"))
    minimal = json.loads(cluster.kubectl("get", "rf", "minimal", "-n", namespace, "-o", "json").stdout)[
        "spec"
    ]
    assert minimal["proxy"]["replicas"] == 1 and minimal["proxy"]["port"] == 8000
    assert minimal["proxy"]["dump"]["path"] == "/var/lib/rolloutfleet/dumps"
    assert minimal["proxy"]["memory"]["maxUnavailable"] == 1 and minimal["gateway"]["policy"] == "manual"
    listing = cluster.kubectl("get", "rolloutfleets", "-n", namespace).stdout
    assert "UP-TO-DATE" in listing and "AVAILABLE" in listing and "MEMORY-RESTARTS" in listing
    assert "gpu-fleet" in listing


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"proxy": {"tokenizer": {"path": "/t"}}}, "set exactly one of spec.engines"),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}},
                "externalEngineUrls": ["http://a"],
                "engines": {"modelPath": "/m", "image": "e"},
            },
            "set exactly one of spec.engines",
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}},
                "engines": {"modelPath": "/m", "image": "e", "tensorParallelSize": 4},
            },
            "gpusPerEngine must be at least engines.tensorParallelSize",
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}, "cleanupIntervalSeconds": 4000},
                "externalEngineUrls": ["http://a"],
            },
            "cleanupIntervalSeconds must not exceed",
        ),
        (
            {
                "proxy": {
                    "tokenizer": {"path": "/t"},
                    "terminationGracePeriodSeconds": 10,
                    "drainGraceSeconds": 30,
                },
                "externalEngineUrls": ["http://a"],
            },
            "must exceed proxy.drainGraceSeconds",
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}, "dump": {"hostPath": {"path": "/d"}, "emptyDir": {}}},
                "externalEngineUrls": ["http://a"],
            },
            "at most one of persistentVolumeClaim, hostPath or emptyDir",
        ),
        (
            {"proxy": {"tokenizer": {"path": "/t"}, "replicas": -1}, "externalEngineUrls": ["http://a"]},
            "should be greater than or equal to 0",
        ),
        ({"proxy": {"tokenizer": {"path": "/t"}}, "externalEngineUrls": ["ftp://a"]}, "should match"),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}, "admission": {"maxStaleness": 2}},
                "externalEngineUrls": ["http://a"],
            },
            "maxStaleness and proxy.admission.consumerBatchSize go together",
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}},
                "gateway": {"replicas": 2},
                "externalEngineUrls": ["http://a"],
            },
            "gateway.replicas must be 1 with policy manual",
        ),
    ],
)
def test_invalid_fleets_are_rejected_with_a_clear_message(cluster, crd, namespace, spec, message):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=fleet("invalid", spec), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert cluster.kubectl("get", "rf", "invalid", "-n", namespace, check=False).returncode != 0


EXTERNAL = {"externalEngineUrls": ["http://a"]}
ENGINES = {"modelPath": "/m", "image": "e"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"proxy": {"tokenizer": {"path": "/t"}, "resources": {"limit": {"cpu": "1"}}}, **EXTERNAL},
            'unknown field "spec.proxy.resources.limit"',
        ),
        (
            {"proxy": {"tokenizer": {"path": "/t"}, "tolerations": [{"efect": "NoSchedule"}]}, **EXTERNAL},
            'unknown field "spec.proxy.tolerations[0].efect"',
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}},
                "engines": {
                    **ENGINES,
                    "volumes": [{"name": "w", "persistentVolumeClaim": {"claimNmae": "x"}}],
                },
            },
            'unknown field "spec.engines.volumes[0].persistentVolumeClaim.claimNmae"',
        ),
        (
            {
                "proxy": {
                    "tokenizer": {"path": "/t", "volume": {"hostPath": {"path": "/t", "tpye": "Directory"}}}
                },
                **EXTERNAL,
            },
            'unknown field "spec.proxy.tokenizer.volume.hostPath.tpye"',
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}},
                "gateway": {"resources": {"limits": {"cpu": ["1"]}}},
                **EXTERNAL,
            },
            "spec.gateway.resources.limits.cpu",
        ),
        (
            {
                "proxy": {"tokenizer": {"path": "/t"}, "podLabels": {"app.kubernetes.io/component": "x"}},
                **EXTERNAL,
            },
            "podLabels cannot set the operator's own label keys",
        ),
        (
            {"proxy": {"tokenizer": {"path": "/t"}}, "engines": {"modelPath": "/m"}},
            "spec.engines.image: Required value",
        ),
    ],
)
def test_typos_in_kubernetes_typed_fields_are_refused_at_apply(cluster, crd, namespace, spec, message):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=fleet("typo", spec), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert cluster.kubectl("get", "rf", "typo", "-n", namespace, check=False).returncode != 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("f" * 54, "metadata.name must be at most 53 characters"),
        ("1fleet", "metadata.name must start with a letter"),
    ],
)
def test_fleet_names_that_would_make_invalid_child_names_are_refused(cluster, crd, namespace, name, message):
    spec = {"proxy": {"tokenizer": {"path": "/t"}}, **EXTERNAL}
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=fleet(name, spec), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_explain_documents_fields(cluster, crd):
    text = cluster.kubectl("explain", "rolloutfleet.spec.proxy.memory").stdout
    assert "rssBudgetBytes" in text and "RSS budget per proxy" in text


def test_scale_subresource(cluster, crd, namespace):
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=fleet("scalable", {"proxy": {"tokenizer": {"path": "/t"}}, "externalEngineUrls": ["http://a"]}),
    )
    cluster.kubectl("scale", "rf/scalable", "-n", namespace, "--replicas=5")
    spec = json.loads(cluster.kubectl("get", "rf", "scalable", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["proxy"]["replicas"] == 5
