"""The main job on the local cluster: control plane + process kubelet + a sample workload.

Brings up the local control plane (building its binaries on first run, with progress), starts the
process kubelet (a test harness running pods as local processes), deploys CPU reference engines
(test stand-ins for SGLang) on the GPU node, the real SGLang router discovering them through the
Kubernetes API, and a proxy in front of the router; sends sessions through the proxy with the
official openai client, and prints `kubectl get` output and the proxy's /stats. Once the operator
exists (issue #4) it will apply a RolloutFleet instead of the sample workload.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from pathlib import Path

import httpx

from rolloutfleet_testkit import sample_workload as sample
from rolloutfleet_testkit.controlplane.build import ensure_binaries
from rolloutfleet_testkit.controlplane.cluster import down, up
from rolloutfleet_testkit.demo import ADMIN_KEY, QUESTIONS, run_session, step
from rolloutfleet_testkit.kubelet import ProcessKubelet
from rolloutfleet_testkit.processes import wait_until_routed
from rolloutfleet_testkit.tokenizer_builder import build_test_tokenizer

NAMESPACE = "rolloutfleet-demo"


class Kubectl:
    def __init__(self, binary: Path, kubeconfig: str):
        self.binary, self.kubeconfig = str(binary), kubeconfig

    def __call__(self, *args: str, input: str | None = None) -> str:
        result = subprocess.run(
            [self.binary, "--kubeconfig", self.kubeconfig, *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def apply(self, *manifests: dict) -> None:
        self(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}),
        )


def main(argv: list[str] | None = None) -> int:
    cache = Path(os.environ.get("ROLLOUTFLEET_CACHE", Path.home() / ".cache" / "rolloutfleet"))
    work = Path(tempfile.mkdtemp(prefix="rolloutfleet-demo-"))
    step("control-plane binaries (built from the Go module proxy on the first run, then cached)")
    kubectl_bin = ensure_binaries() / "kubectl"
    tokenizer_dir = str(build_test_tokenizer(cache / "test-tokenizer"))
    step("starting the local control plane")
    state = up(work / "cluster")
    kubectl = Kubectl(kubectl_bin, state.kubeconfig)
    step("starting the process kubelet (a CPU node and a GPU node; pods run as local processes)")
    kubelet = ProcessKubelet(state.kubeconfig, work / "kubelet").start()
    try:
        kubectl("create", "namespace", NAMESPACE)
        step("deploying 2 reference engines on the GPU node and the SGLang router with service discovery")
        kubectl.apply(
            *sample.router_rbac(NAMESPACE),
            sample.engines(NAMESPACE, 2, tokenizer_dir),
            sample.router(NAMESPACE),
        )
        kubectl("wait", "-n", NAMESPACE, "--for=condition=Ready", "pod", "--all", "--timeout=300s")
        router_ip = kubectl("get", "pod", "sample-router", "-n", NAMESPACE, "-o", "jsonpath={.status.podIP}")
        router_url = f"http://{router_ip}:{sample.ROUTER_PORT}"
        wait_until_routed(router_url)
        step(f"deploying a proxy in front of the router at {router_url}")
        kubectl.apply(sample.proxy(NAMESPACE, router_url, tokenizer_dir, ADMIN_KEY))
        kubectl("wait", "-n", NAMESPACE, "--for=condition=Ready", "pod/sample-proxy-0", "--timeout=180s")
        proxy_ip = kubectl("get", "pod", "sample-proxy-0", "-n", NAMESPACE, "-o", "jsonpath={.status.podIP}")
        proxy_url = f"http://{proxy_ip}:{sample.PROXY_PORT}"
        step(f"running {len(QUESTIONS)} multi-turn sessions through {proxy_url} with the openai client")

        async def all_sessions() -> list[dict]:
            return await asyncio.gather(*(run_session(proxy_url, q, i) for i, q in enumerate(QUESTIONS)))

        for summary in asyncio.run(all_sessions()):
            print(
                f"    session {summary['session_id']}: {summary['num_turns']} turns, "
                f"{summary['num_tokens']} tokens, {sum(summary['trajectory']['loss_mask'])} generated, "
                f"reward {summary['reward']}"
            )
        step("kubectl get nodes,pods -o wide")
        print(kubectl("get", "nodes", "-o", "wide"))
        print(kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide"))
        step("the proxy's /stats")
        print(json.dumps(httpx.get(f"{proxy_url}/stats").json(), indent=2))
    finally:
        step("stopping the kubelet (pods' processes end) and the control plane")
        kubelet.stop()
        down(work / "cluster")
    step(f"done; pod logs in {work / 'kubelet'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
