"""kubectl against one cluster, for the demo, the benchmarks and the e2e tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from rolloutfleet_testkit.waiting import wait_for


class Kubectl:
    """`run` gives the finished process; calling the object gives its output or raises; `json`
    parses a `get` in this object's namespace."""

    def __init__(
        self, binary: str | Path, kubeconfig: str, namespace: str | None = None, timeout_s: float = 300
    ):
        self.binary, self.kubeconfig = str(binary), kubeconfig
        self.namespace, self.timeout_s = namespace, timeout_s

    def run(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.binary, "--kubeconfig", self.kubeconfig, *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=self.timeout_s,
        )

    def __call__(self, *args: str, input: str | None = None) -> str:
        result = self.run(*args, input=input)
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def json(self, *args: str, missing_ok: bool = False) -> dict[str, Any]:
        """`kubectl get ARGS -o json` in the namespace; with missing_ok, {} when it fails."""
        scope = ["-n", self.namespace] if self.namespace else []
        result = self.run("get", *args, *scope, "-o", "json")
        if result.returncode != 0:
            if missing_ok:
                return {}
            raise RuntimeError(f"kubectl get {' '.join(args)}: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def wait_established(self, crd: str, timeout_s: float = 60) -> None:
        """Until the CRD is Established. (`kubectl wait --for=condition=Established` gives up at
        once while a just-created CRD has no conditions yet, which a large one may not for a moment.)"""
        query = '{.status.conditions[?(@.type=="Established")].status}'
        last: list[subprocess.CompletedProcess[str]] = []

        def established() -> bool:
            last[:] = [self.run("get", "crd", crd, "-o", f"jsonpath={query}")]
            return last[0].returncode == 0 and last[0].stdout.strip() == "True"

        what = f"CRD {crd} to be Established"
        wait_for(established, timeout_s, what, detail=lambda: f": {last[0].stderr.strip()}")
