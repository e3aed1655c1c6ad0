"""The node's own programs beyond the Kubernetes release: CoreDNS and the pause program.

CoreDNS is built from a main package of our own that registers only the plugins the cluster's DNS
needs (the upstream binary links every plugin, cloud providers included, which costs minutes on
two cores). The pause program (a pod sandbox's first process) is a few lines of Go: it sleeps until
told to stop and reaps orphans, as PID 1 of a pod must. Both are static (CGO off), built from the Go
module proxy and cached per version beside the control plane's binaries.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from rolloutfleet_testkit.controlplane.build import build_main_module, cache_root, say

COREDNS_VERSION = "v1.14.7"
PAUSE_VERSION = "1"

# Plugins in CoreDNS's own execution order (core/dnsserver's directive list, reduced): what the local
# cluster's Corefile uses and kubeadm's (kind's clusters run it), which adds prometheus, loop and
# forward. One build serves both.
COREDNS_PLUGINS = (
    "reload",
    "bind",
    "ready",
    "health",
    "prometheus",
    "errors",
    "log",
    "loadbalance",
    "cache",
    "hosts",
    "kubernetes",
    "loop",
    "forward",
)
# The plugin directory of those whose name differs from their directive.
PLUGIN_PACKAGES = {"prometheus": "metrics"}

PAUSE_MAIN = """package main

// The pod sandbox's first process: holds the pod's namespaces open, sleeps until signalled and
// reaps orphaned children (it is PID 1 of the pod's PID namespace when that is shared).

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			for {
				var status syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
"""


def coredns_main(plugins: tuple[str, ...] = COREDNS_PLUGINS) -> str:
    """main.go of a CoreDNS with exactly `plugins`, in that order (pure)."""
    imports = "\n".join(
        f'\t_ "github.com/coredns/coredns/plugin/{PLUGIN_PACKAGES.get(name, name)}"' for name in plugins
    )
    directives = ", ".join(f'"{name}"' for name in plugins)
    return (
        "package main\n\n"
        "import (\n"
        '\t"github.com/coredns/coredns/core/dnsserver"\n'
        '\t"github.com/coredns/coredns/coremain"\n'
        f"{imports}\n"
        ")\n\n"
        f"func init() {{ dnsserver.Directives = []string{{{directives}}} }}\n\n"
        "func main() { coremain.Run() }\n"
    )


def node_binaries_dir() -> Path:
    return cache_root() / "node-bin"


def coredns_binary() -> Path:
    """Where the CoreDNS build is cached: named by its version and plugins (another set rebuilds)."""
    plugins = hashlib.sha256(" ".join(COREDNS_PLUGINS).encode()).hexdigest()[:8]
    return node_binaries_dir() / f"coredns-{COREDNS_VERSION}-{plugins}"


def ensure_node_binaries() -> Path:
    """coredns and pause in the cache (built on first use); returns their directory."""
    bin_dir = node_binaries_dir()
    bin_dir.mkdir(parents=True, exist_ok=True)
    coredns = coredns_binary()
    pause = bin_dir / f"pause-{PAUSE_VERSION}"
    if not (coredns.exists() and pause.exists()) and shutil.which("go") is None:
        raise RuntimeError("Go is needed to build CoreDNS and the pause program")
    if not coredns.exists():
        say(f"building CoreDNS {COREDNS_VERSION} (plugins: {', '.join(COREDNS_PLUGINS)})")
        build_main_module("coredns", coredns_main(), {"github.com/coredns/coredns": COREDNS_VERSION}, coredns)
    if not pause.exists():
        say(f"building the pause program {PAUSE_VERSION}")
        build_main_module("pause", PAUSE_MAIN, {}, pause)
    return bin_dir
