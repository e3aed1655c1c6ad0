"""The real node's pure parts beyond the configuration files (see test_node_and_images_units.py): the
uplink guard and its counters, the iptables clean-up plan, the unmount order, the state `down` reads,
the record that lets the next `up` undo a killed run, the kubelets' serving certificates and the
command line."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from rolloutfleet_testkit.controlplane.cluster import component_args
from rolloutfleet_testkit.controlplane.pki import create_pki
from rolloutfleet_testkit.node import __main__ as cli
from rolloutfleet_testkit.node import cluster as node_cluster
from rolloutfleet_testkit.node import config, host
from rolloutfleet_testkit.node.cluster import RealCluster, recorded_clusters, recorded_program

PORTS = {"etcd": 1, "etcd-peer": 2, "kube-apiserver": 3, "kube-controller-manager": 4, "kube-scheduler": 5}


def test_guard_drops_what_leaves_the_bridge_and_what_enters_the_pod_subnet_and_counts_it():
    rules = [line.strip() for line in host.guard_ruleset().splitlines() if "drop" in line]
    assert rules == [
        f'iifname "{config.BRIDGE}" oifname != "{config.BRIDGE}" counter drop comment "{host.GUARD_OUT}"',
        f'iifname != "{config.BRIDGE}" ip daddr {config.POD_SUBNET} counter drop comment "{host.GUARD_IN}"',
    ]
    assert "hook forward" in host.guard_ruleset() and "policy accept" in host.guard_ruleset()


def test_guard_counts_are_read_per_rule_from_nft_json():
    def rule(comment, packets):
        match = {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "rfbr0"}}
        expr = [match, {"counter": {"packets": packets, "bytes": 60 * packets}}, {"drop": None}]
        return {"rule": {"family": "inet", "chain": "forward", "comment": comment, "expr": expr}}

    listing = {
        "nftables": [
            {"metainfo": {"json_schema_version": 1}},
            {"table": {"family": "inet", "name": host.GUARD_TABLE}},
            rule(host.GUARD_OUT, 3),
            rule(host.GUARD_IN, 0),
        ]
    }
    assert host.guard_counts(listing) == {host.GUARD_OUT: 3, host.GUARD_IN: 0}
    assert host.guard_counts({}) == {}


IPTABLES_NAT = """-P PREROUTING ACCEPT
-P OUTPUT ACCEPT
-N DOCKER
-N KUBE-SERVICES
-N KUBE-SVC-ABC
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j DOCKER
-A OUTPUT -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-ABC
-A KUBE-SVC-ABC -j DNAT --to-destination 10.88.0.1:6443
"""


def test_kube_chain_cleanup_unhooks_then_flushes_then_deletes_only_kube_chains():
    plan = host.kube_chain_cleanup(IPTABLES_NAT)
    assert plan == [
        # The quoted comment stays one argument (or the rule to delete would not be found).
        ["-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals",
         "-j", "KUBE-SERVICES"],
        ["-D", "OUTPUT", "-j", "KUBE-SERVICES"],
        ["-F", "KUBE-SERVICES"],
        ["-F", "KUBE-SVC-ABC"],
        ["-X", "KUBE-SERVICES"],
        ["-X", "KUBE-SVC-ABC"],
    ]  # fmt: skip
    assert not any("DOCKER" in part for command in plan for part in command)
    assert host.kube_chain_cleanup("-P INPUT ACCEPT\n") == []


def test_mounts_below_the_root_only_deepest_first():
    def line(point):
        return f"36 35 0:30 / {point} rw,relatime shared:1 - tmpfs tmpfs rw"

    mountinfo = "\n".join(
        line(p)
        for p in (
            "/",
            "/run/c",
            "/run/c/node/kubelet/pods/u/volumes/x",
            "/run/c/node/containerd/state/sandboxes/s/shm",
            "/run/c/node/kubelet/pods/u/volumes/x",  # stacked twice: listed once
            "/run/cluster-other/x",  # a sibling sharing the prefix is not below the root
            "/run/c/with\\040space",
        )
    )
    points = host.mount_points_under(mountinfo, Path("/run/c"))
    assert points == [
        "/run/c/node/containerd/state/sandboxes/s/shm",
        "/run/c/node/kubelet/pods/u/volumes/x",
        "/run/c/with space",
    ]


def test_the_state_down_needs_survives_a_round_trip(tmp_path, monkeypatch):
    # Never the machine's own record: the next real `up` would tear this made-up cluster down.
    monkeypatch.setattr(node_cluster, "MACHINE_RECORD", tmp_path / "run" / "node-state.json")
    cluster = RealCluster(
        tmp_path,
        kubeconfig=str(tmp_path / "admin.kubeconfig"),
        bin_dir=Path("/opt/bin"),
        containerd_by_node={"rf-cpu-node": "/a.sock", "rf-gpu-node": "/b.sock"},
        pids={"kubelet:rf-cpu-node": 12},
        sysctls={"net.ipv4.ip_forward": "0"},
        netns_before=["x"],
        tables_before=["table ip filter"],
    )
    cluster.save()
    assert RealCluster.load(tmp_path) == cluster
    assert cluster.containerd_addresses == ["/a.sock", "/b.sock"]
    assert cluster.gpu_containerd_addresses == ["/b.sock"]
    assert RealCluster.load(tmp_path / "elsewhere") is None


def _cluster_in(root: Path) -> RealCluster:
    return RealCluster(
        root, kubeconfig="", bin_dir=Path("/opt/bin"), containerd_by_node={}, pids={"kube-proxy": 7}
    )


def test_a_run_killed_before_teardown_is_found_by_the_next_up_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(node_cluster, "MACHINE_RECORD", tmp_path / "run" / "node-state.json")
    killed = _cluster_in(tmp_path / "pytest-1" / "cluster0")
    killed.save()
    # The killed run's directory is the one recorded, also when the next run uses another directory
    # (pytest's next temporary directory) and when that directory was removed since.
    assert recorded_clusters(killed.root) == [killed]
    assert recorded_clusters(tmp_path / "pytest-2" / "cluster0") == [killed]
    (killed.root / "node-state.json").unlink()
    assert recorded_clusters(tmp_path / "pytest-2" / "cluster0") == [killed]
    # Another directory's teardown leaves the machine's record of the killed run alone; its own clears it.
    _cluster_in(tmp_path / "elsewhere").forget()
    assert recorded_clusters(tmp_path / "pytest-2" / "cluster0") == [killed]
    killed.forget()
    assert recorded_clusters(tmp_path / "pytest-2" / "cluster0") == []


def test_a_recorded_pid_counts_as_running_only_while_it_runs_the_recorded_program(tmp_path):
    assert [recorded_program(n) for n in ("controlplane:etcd", "kubelet:rf-cpu-node", "kube-proxy")] == [
        "etcd",
        "kubelet",
        "kube-proxy",
    ]
    kubelet = tmp_path / "kubelet"
    kubelet.symlink_to(shutil.which("sleep"))
    process = subprocess.Popen([str(kubelet), "30"])
    try:
        # Until the child has exec'd, /proc shows the forking parent's command line: wait for it.
        deadline = time.monotonic() + 10
        while (
            b"kubelet" not in Path(f"/proc/{process.pid}/cmdline").read_bytes()
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        assert node_cluster._still_runs("kubelet:rf-cpu-node", process.pid)
        # The same PID under another name is a reused PID, not ours.
        assert not node_cluster._still_runs("containerd:rf-cpu-node", process.pid)
    finally:
        process.kill()
        process.wait()
    assert not node_cluster._still_runs("kubelet:rf-cpu-node", process.pid)


def test_kubelets_serve_certificates_of_the_cluster_ca_that_the_api_server_checks(tmp_path):
    pki = create_pki(tmp_path / "pki", server_ips=(config.BRIDGE_IP,), nodes=("rf-gpu-node",))
    crt, key = pki.client("node-rf-gpu-node-serving")
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(config.BRIDGE_IP)]
    assert names.get_values_for_type(x509.DNSName) == ["rf-gpu-node"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    client = x509.load_pem_x509_certificate(pki.client("node-rf-gpu-node")[0].read_bytes())
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:rf-gpu-node"
    assert client.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"

    dirs = config.NodeDirs(tmp_path / "n", tmp_path / "store")
    kubelet = config.kubelet_config(config.NODES[1], dirs, 1, 2, pki.ca_cert, (crt, key))
    assert (kubelet["tlsCertFile"], kubelet["tlsPrivateKeyFile"]) == (str(crt), str(key))
    assert "tlsCertFile" not in config.kubelet_config(config.NODES[1], dirs, 1, 2, pki.ca_cert)

    bridge = component_args("kube-apiserver", Path("/bin"), tmp_path, pki, PORTS, config.BRIDGE_IP)
    assert f"--kubelet-certificate-authority={pki.ca_cert}" in bridge
    loopback = component_args("kube-apiserver", Path("/bin"), tmp_path, pki, PORTS)
    assert not any(a.startswith("--kubelet-") for a in loopback)


def test_command_line():
    args = cli.parser().parse_args(["up", "--dir", "/tmp/x", "--images", "busybox", "testkit"])
    assert (args.command, args.dir, args.images) == ("up", Path("/tmp/x"), ["busybox", "testkit"])
    assert cli.parser().parse_args(["down"]).images is None


def test_a_cluster_is_refused_on_a_nearly_full_disk_with_what_to_free(tmp_path, monkeypatch):
    node_cluster._refuse_full_disk(tmp_path)  # this machine's disk has room for the floor
    monkeypatch.setattr(node_cluster, "MIN_FREE_DISK_BYTES", shutil.disk_usage(tmp_path).total + 1)
    with pytest.raises(RuntimeError) as refused:
        node_cluster._refuse_full_disk(tmp_path)
    assert f"on the disk holding {tmp_path}" in str(refused.value) and "images/layers" in str(refused.value)
