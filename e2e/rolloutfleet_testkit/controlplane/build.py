"""Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy and
helm from Go modules (and, through rolloutfleet_testkit.node.binaries, CoreDNS and the pause program).

k8s.io/kubernetes cannot be `go install`ed: its go.mod requires its staging modules at v0.0.0 and
points them at ./staging. A small wrapper module requires it at the release and replaces every
staging module with its published v0.X.Y (the list is read from the release's own go.mod). etcd's
server builds from the same module; helm builds on its own. Binaries are cached outside the
repository, per version, so only the first run pays. A directory of prebuilt binaries (as
envtest's KUBEBUILDER_ASSETS) can be named by ROLLOUTFLEET_K8S_ASSETS instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rolloutfleet_testkit.cache import exclusive, project_cache

KUBERNETES_VERSION = "v1.35.4"
HELM_VERSION = "v3.22.0"
# promtool checks and unit-tests the chart's PrometheusRule (tests/operator/test_chart_monitoring.py).
# Prometheus 3.x publishes its Go module as v0.3XX.Y: v0.316.0 is Prometheus 3.16.0.
PROMTOOL_VERSION = "v0.316.0"
# The OCI distribution registry (CNCF Distribution's `registry`) that tests push images to
# (tests/testkit/test_image_push.py): a real registry on 127.0.0.1, no Docker.
REGISTRY_VERSION = "v3.1.2"
# kube-score lints what the chart renders and the children the operator builds
# (tests/operator/test_manifest_lint.py).
KUBE_SCORE_VERSION = "v1.20.0"
# KWOK's controller simulates nodes and their pods (no kubelet, no containers) for the scale
# benchmark (rolloutfleet_testkit.controlplane.kwok, bench/scale.py).
KWOK_VERSION = "v0.8.0"
# kubelet and kube-proxy run the test cluster's nodes (rolloutfleet_testkit.node).
KUBE_COMMANDS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "kube-proxy",
)
BINARIES = ("etcd", *KUBE_COMMANDS, "helm")
ASSETS_ENV = "ROLLOUTFLEET_K8S_ASSETS"


@dataclass(frozen=True)
class Versions:
    kubernetes: str
    staging: str  # v0.X.Y of the staging modules
    etcd: str
    helm: str


def cache_root() -> Path:
    return project_cache() / "controlplane"


def say(message: str) -> None:
    print(f"[controlplane] {message}", file=sys.stderr, flush=True)


def staging_version(kubernetes: str) -> str:
    """k8s.io/kubernetes v1.X.Y publishes its staging modules as v0.X.Y."""
    match = re.fullmatch(r"v1\.(\d+)\.(\d+)", kubernetes)
    if not match:
        raise ValueError(f"not a Kubernetes release version: {kubernetes}")
    return f"v0.{match.group(1)}.{match.group(2)}"


def staging_modules(go_mod: str) -> list[str]:
    """Modules the release requires at exactly v0.0.0 (not pseudo-versions): those it points at ./staging."""
    return sorted(
        set(re.findall(r"^\s*(k8s\.io/[\w./-]+) v0\.0\.0[ \t]*(?://.*)?$", go_mod, flags=re.MULTILINE))
    )


def required_version(go_mod: str, module: str) -> str | None:
    match = re.search(rf"^\s*{re.escape(module)} (v[\w.+-]+)", go_mod, flags=re.MULTILINE)
    return match.group(1) if match else None


def wrapper_go_mod(versions: Versions, staging: list[str], go_version: str) -> str:
    lines = [
        "module rolloutfleet.local/controlplane",
        "",
        f"go {go_version}",
        "",
        f"require k8s.io/kubernetes {versions.kubernetes}",
        f"require go.etcd.io/etcd/server/v3 {versions.etcd}",
        "",
    ]
    lines += [f"replace {module} => {module} {versions.staging}" for module in staging]
    return "\n".join(lines) + "\n"


def version_ldflags(kubernetes: str) -> str:
    major, minor = kubernetes.lstrip("v").split(".")[:2]
    values = {
        "gitVersion": kubernetes,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": "rolloutfleet-build",
        "gitTreeState": "clean",
        "buildDate": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    flags = [
        f"-X {package}.{key}={value}"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in values.items()
    ]
    return " ".join(["-s", "-w", *flags])


def go(
    args: list[str], cwd: Path, progress_label: str | None = None, env: dict[str, str] | None = None
) -> str:
    """Run the go tool (with `env` added to its environment); with a label, count the packages it
    compiles as progress (go build -v)."""
    # GOGC 400: the compiler collects garbage a quarter as often; 15% faster builds (kube-score from
    # an empty build cache: 37.6 s against 44.2 s, two runs each), for some more memory per compile.
    defaults = {"GOGC": os.environ.get("GOGC", "400")}
    env = {
        **os.environ,
        **defaults,
        "CGO_ENABLED": "0",
        "GOFLAGS": "-mod=mod",
        "GOTOOLCHAIN": "local",
        **(env or {}),
    }
    if progress_label is None:
        result = subprocess.run(["go", *args], cwd=cwd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"go {' '.join(args)} failed:\n{result.stderr[-4000:]}")
        return result.stdout
    process = subprocess.Popen(
        ["go", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    tail: list[str] = []
    started = time.monotonic()
    count = 0
    for line in process.stdout:
        count += 1
        tail = [*tail[-40:], line.rstrip()]
        if count % 100 == 0:
            say(f"{progress_label}: {count} packages compiled, {time.monotonic() - started:.0f}s")
    if process.wait() != 0:
        raise RuntimeError(f"go {' '.join(args[:2])} failed:\n" + "\n".join(tail))
    say(f"{progress_label}: done ({count} packages, {time.monotonic() - started:.0f}s)")
    return ""


def resolve_versions(work: Path, kubernetes: str, helm: str) -> tuple[Versions, list[str]]:
    work.mkdir(parents=True, exist_ok=True)
    info = json.loads(go(["mod", "download", "-json", f"k8s.io/kubernetes@{kubernetes}"], cwd=work))
    go_mod = Path(info["GoMod"]).read_text()
    etcd = required_version(go_mod, "go.etcd.io/etcd/client/v3")
    if etcd is None:
        raise RuntimeError("the Kubernetes release does not pin go.etcd.io/etcd/client/v3")
    versions = Versions(kubernetes=kubernetes, staging=staging_version(kubernetes), etcd=etcd, helm=helm)
    return versions, staging_modules(go_mod)


def build(bin_dir: Path, kubernetes: str = KUBERNETES_VERSION, helm: str = HELM_VERSION) -> Path:
    """Build etcd and the Kubernetes commands missing from bin_dir (helm: `build_helm`); returns bin_dir."""
    work = bin_dir.parent / "src"
    versions, staging = resolve_versions(work, kubernetes, helm)
    say(
        f"Kubernetes {versions.kubernetes} (staging {versions.staging}, {len(staging)} modules), "
        f"etcd {versions.etcd}, helm {versions.helm}"
    )
    go_version = re.search(r"go(\d+\.\d+)", go(["env", "GOVERSION"], cwd=work)).group(1)
    (work / "go.mod").write_text(wrapper_go_mod(versions, staging, go_version))
    (work / "go.sum").touch()
    bin_dir.mkdir(parents=True, exist_ok=True)
    missing_kube = [c for c in ("etcd", *KUBE_COMMANDS) if not (bin_dir / c).exists()]
    if missing_kube:
        say("resolving module requirements (downloads from the Go module proxy)")
        packages = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS] + ["go.etcd.io/etcd/server/v3"]
        go(
            [
                "get",
                *[f"{p}@{versions.kubernetes}" for p in packages[:-1]],
                f"{packages[-1]}@{versions.etcd}",
            ],
            cwd=work,
        )
        staging_dir = bin_dir.parent / "staging-bin"
        staging_dir.mkdir(exist_ok=True)
        go(
            [
                "build",
                "-v",
                "-trimpath",
                "-ldflags",
                version_ldflags(versions.kubernetes),
                "-o",
                str(staging_dir) + "/",
                *packages,
            ],
            cwd=work,
            progress_label="kubernetes + etcd",
        )
        # go names a binary after its package path minus the major-version suffix: .../server/v3 -> server
        (staging_dir / "server").rename(staging_dir / "etcd")
        for name in ("etcd", *KUBE_COMMANDS):
            os.replace(staging_dir / name, bin_dir / name)
    return bin_dir


def build_helm(bin_dir: Path, version: str = HELM_VERSION) -> Path:
    """helm, `go install`ed into bin_dir beside the release's binaries; returns its path."""
    helm_dir = bin_dir.parent / "helm-src"
    helm_dir.mkdir(parents=True, exist_ok=True)
    flags = f"-s -w -X helm.sh/helm/v3/internal/version.version={version}"
    go(
        ["install", "-v", "-trimpath", "-ldflags", flags, f"helm.sh/helm/v3/cmd/helm@{version}"],
        cwd=helm_dir,
        progress_label="helm",
        env={"GOBIN": str(bin_dir)},
    )
    return bin_dir / "helm"


def built_once(path: Path, name: str, version: str, build: Callable[[], object]) -> Path:
    """`path`, built by `build` unless it exists. The build holds a lock of its own: ./dev test
    prepares in the background while the tests that need a tool run, and they wait for it here."""
    if path.exists():
        return path
    with exclusive(f"build-{name}-{version}"):
        if not path.exists():  # else built by the holder we waited for
            if shutil.which("go") is None:
                raise RuntimeError(f"Go is needed to build {name} (or set {ASSETS_ENV})")
            say(f"building {name} {version} into {path.parent} (first run only)")
            build()
    return path


def ensure_helm() -> Path:
    """helm (the chart's tests render with it), built on first use; returns its path."""
    path = binaries_dir() / "helm"
    return built_once(path, "helm", HELM_VERSION, lambda: build_helm(path.parent))


def main_go_mod(module: str, go_version: str, requires: dict[str, str]) -> str:
    lines = [f"module {module}", "", f"go {go_version}", ""]
    lines += [f"require {path} {version}" for path, version in requires.items()]
    return "\n".join(lines) + "\n"


def build_main_module(
    name: str, main: str, requires: dict[str, str], out: Path, ldflags: str = "-s -w"
) -> None:
    """Build `out` from a main package of our own (`main`, the text of main.go) in a module
    requiring `requires`: for programs whose upstream main links far more than the tests use."""
    work = cache_root() / "main-src" / name
    work.mkdir(parents=True, exist_ok=True)
    go_version = re.search(r"go(\d+\.\d+)", go(["env", "GOVERSION"], cwd=work)).group(1)
    (work / "go.mod").write_text(main_go_mod(f"rolloutfleet.local/{name}", go_version, requires))
    (work / "go.sum").touch()
    (work / "main.go").write_text(main)
    if requires:
        say(f"{name}: resolving module requirements (downloads from the Go module proxy)")
        go(["get", *[f"{path}@{version}" for path, version in requires.items()]], cwd=work)
    staged = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    go(
        ["build", "-v", "-trimpath", "-ldflags", ldflags, "-o", str(staged), "."],
        cwd=work,
        progress_label=name,
    )
    staged.replace(out)


def go_tool_path(name: str, version: str) -> Path:
    """Where a `go install`ed tool of that module version is cached (its own directory, not among
    the Kubernetes binaries): `<cache>/controlplane/<name>-<version>/bin/<name>`."""
    return cache_root() / f"{name}-{version}" / "bin" / name


def ensure_go_tool(name: str, package: str, version: str, tags: str = "") -> Path:
    """A tool built with `go install package@version` from the Go module proxy on first use and
    cached per version; returns its path."""
    path = go_tool_path(name, version)

    def install() -> None:
        work = path.parent.parent / "src"
        work.mkdir(parents=True, exist_ok=True)
        go(
            go_install_args(package, version, tags),
            cwd=work,
            progress_label=name,
            env={"GOBIN": str(path.parent)},
        )

    return built_once(path, name, version, install)


def go_install_args(package: str, version: str, tags: str = "") -> list[str]:
    """`go install` of one command at a pinned module version, stripped and path-independent as
    upstream releases build (pure)."""
    flags = ["-tags", tags] if tags else []
    return ["install", "-v", "-trimpath", *flags, "-ldflags", "-s -w", f"{package}@{version}"]


def promtool_path(version: str = PROMTOOL_VERSION) -> Path:
    """The cached promtool of that Prometheus module version."""
    return go_tool_path("promtool", version)


def ensure_promtool(version: str = PROMTOOL_VERSION) -> Path:
    """promtool, built from the Go module proxy on first use; returns its path."""
    # remove_all_sd (Prometheus's own build tag) leaves the service-discovery plugins out: checking
    # and testing rules needs none, and some pin module versions the Go proxy no longer serves (nomad).
    return ensure_go_tool(
        "promtool", "github.com/prometheus/prometheus/cmd/promtool", version, tags="remove_all_sd"
    )


# The registry's own main registers every storage driver and auth scheme (cloud SDKs: twice the
# packages); the push tests need the filesystem driver and basic auth (htpasswd), as a local
# registry is configured.
REGISTRY_MAIN = """package main

// github.com/distribution/distribution/v3's registry with the filesystem driver and htpasswd auth only.

import (
	"os"

	"github.com/distribution/distribution/v3/registry"
	_ "github.com/distribution/distribution/v3/registry/auth/htpasswd"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
)

func main() {
	if err := registry.RootCmd.Execute(); err != nil {
		os.Exit(1) // cobra has said why
	}
}
"""


def ensure_registry(version: str = REGISTRY_VERSION) -> Path:
    """The OCI distribution registry (`registry serve CONFIG`), built on first use from REGISTRY_MAIN
    at that release; returns its path."""
    path = go_tool_path("registry", version)
    requires = {"github.com/distribution/distribution/v3": version}
    return built_once(
        path, "registry", version, lambda: build_main_module("registry", REGISTRY_MAIN, requires, path)
    )


def ensure_kube_score(version: str = KUBE_SCORE_VERSION) -> Path:
    """kube-score, the Kubernetes manifest linter, built on first use; returns its path."""
    return ensure_go_tool("kube-score", "github.com/zegl/kube-score/cmd/kube-score", version)


def ensure_kwok(version: str = KWOK_VERSION) -> Path:
    """KWOK's controller (`kwok`), built on first use; returns its path. Its module has no replace
    directives, so `go install` builds it as it does helm."""
    return ensure_go_tool("kwok", "sigs.k8s.io/kwok/cmd/kwok", version)


def ensure_kubeadm() -> Path:
    """kubeadm, which only kind's nodes run (they bootstrap with it), built on first use from the
    same wrapper module and version flags as the release's other binaries; returns its path."""
    bin_dir = ensure_binaries()
    path = cache_root() / KUBERNETES_VERSION / "kind-bin" / "kubeadm"

    def build_kubeadm() -> None:
        staged = path.with_name("kubeadm.partial")
        path.parent.mkdir(parents=True, exist_ok=True)
        go(
            [
                "build",
                "-v",
                "-trimpath",
                "-ldflags",
                version_ldflags(KUBERNETES_VERSION),
                "-o",
                str(staged),
                "k8s.io/kubernetes/cmd/kubeadm",
            ],
            cwd=bin_dir.parent / "src",
            progress_label="kubeadm",
        )
        staged.replace(path)

    return built_once(path, "kubeadm", KUBERNETES_VERSION, build_kubeadm)


def binaries_dir() -> Path:
    """Where the binaries are: ROLLOUTFLEET_K8S_ASSETS if it holds them all, else the per-version cache."""
    assets = os.environ.get(ASSETS_ENV) or os.environ.get("KUBEBUILDER_ASSETS")
    if assets and all((Path(assets) / b).exists() for b in BINARIES):
        return Path(assets)
    return cache_root() / KUBERNETES_VERSION / "bin"


def ensure_binaries() -> Path:
    """The release's binaries (bin_dir, returned) and the nodes' CoreDNS and pause program (their own
    cache directory, rolloutfleet_testkit.node.binaries); only what is missing is built."""
    bin_dir = binaries_dir()
    release = [b for b in BINARIES if b != "helm"]
    with contextlib.ExitStack() as held:
        if not all((bin_dir / b).exists() for b in release):
            held.enter_context(exclusive(f"build-kubernetes-{KUBERNETES_VERSION}"))
        if not all((bin_dir / b).exists() for b in release):  # not built by the holder we waited for
            if shutil.which("go") is None:
                raise RuntimeError("Go is needed to build the control plane (or set ROLLOUTFLEET_K8S_ASSETS)")
            say(f"building control-plane binaries into {bin_dir} (first run only; tens of minutes)")
            build(bin_dir)
    ensure_helm()
    from rolloutfleet_testkit.node.binaries import ensure_node_binaries  # it builds with this module's go()

    ensure_node_binaries()
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (or find) the local control plane's binaries.")
    parser.parse_args(argv)
    print(ensure_binaries())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
