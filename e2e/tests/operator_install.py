"""The operator installed with its Helm chart, for the e2e tests that need it running as a pod."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

from rolloutfleet_testkit import fleet_setup


@contextlib.contextmanager
def installed_operator(
    cluster, namespace: str, release: str, extra: dict[str, str] | None = None
) -> Iterator[str]:
    """The CRD applied and the operator installed by its chart into `namespace`, watching it; yields
    the operator's Deployment name. Uninstalled (and the namespace deleted) afterwards."""
    helm = cluster.tool("helm")
    cluster.kubectl("apply", "-f", str(fleet_setup.CRDS))
    cluster.kubectl_client().wait_established("rolloutfleets.rolloutfleet.dev")
    cluster.kubectl("create", "namespace", namespace)
    install = subprocess.run(
        [
            helm,
            "--kubeconfig",
            cluster.kubeconfig,
            *fleet_setup.helm_install_args(release, namespace, [namespace], extra),
        ],
        capture_output=True,
        text=True,
        timeout=fleet_setup.HELM_WAIT_S + 60,
    )
    if install.returncode != 0:  # say why: the operator's pods and their last words
        pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        logs = cluster.kubectl(
            "logs", f"deploy/{release}-rolloutfleet-operator", "-n", namespace, "--tail=40", check=False
        )
        events = cluster.kubectl("get", "events", "-n", namespace, check=False).stdout
        raise AssertionError(f"{install.stderr}\n{pods}\n{logs.stdout}{logs.stderr}\n{events[-3000:]}")
    try:
        yield f"{release}-rolloutfleet-operator"
    finally:
        subprocess.run(
            [helm, "--kubeconfig", cluster.kubeconfig, "uninstall", release, "-n", namespace],
            capture_output=True,
            timeout=120,
        )
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
