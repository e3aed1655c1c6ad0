"""The kind cluster's pure decisions: its config, the CNI config and routes that stand in for
kindnetd, the runtime wrapper, the node image's systemd links, and the host-state diff."""

from __future__ import annotations

import gzip
import hashlib
import io
import ipaddress
import json
import shutil
import subprocess
import tarfile

import pytest
import yaml
from rolloutfleet_testkit.images.oci import stream_image_archive, tar_layer, write_image_archive
from rolloutfleet_testkit.images.registry import compressed_layer
from rolloutfleet_testkit.kind import config, host, nodeimage
from rolloutfleet_testkit.kind.cluster import nodes_for
from rolloutfleet_testkit.node.binaries import COREDNS_PLUGINS, coredns_main


def test_cluster_config_has_a_control_plane_and_a_tainted_labelled_gpu_worker_without_kindnetd():
    parsed = yaml.safe_load(config.cluster_config(cgroup_v1=True, shared_dir="/srv/shared"))
    assert parsed["networking"] == {"disableDefaultCNI": True, "podSubnet": config.POD_SUBNET}
    control_plane, worker = parsed["nodes"]
    shared = [{"hostPath": "/srv/shared", "containerPath": "/srv/shared"}]
    assert control_plane["extraMounts"] == shared
    # The control-plane node is the CPU node: kubeadm's control-plane taint is left off.
    init = yaml.safe_load(control_plane["kubeadmConfigPatches"][0])
    assert init == {"kind": "InitConfiguration", "nodeRegistration": {"taints": []}}
    assert worker["extraMounts"] == shared
    assert worker["labels"] == {"nvidia.com/gpu.present": "true"}
    join = yaml.safe_load(worker["kubeadmConfigPatches"][0])
    assert join["kind"] == "JoinConfiguration"
    assert join["nodeRegistration"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    ]
    kubelet = yaml.safe_load(parsed["kubeadmConfigPatches"][0])
    assert kubelet == {"kind": "KubeletConfiguration", "failCgroupV1": False}


def test_cluster_config_on_cgroup_v2_patches_no_kubelet_setting():
    assert (
        yaml.safe_load(config.cluster_config(cgroup_v1=False, shared_dir="/srv/shared"))[
            "kubeadmConfigPatches"
        ]
        == []
    )


def test_cni_conflist_gives_pods_addresses_from_the_nodes_own_cidr():
    conflist = json.loads(config.cni_conflist("10.244.1.0/24"))
    ptp, portmap = conflist["plugins"]
    assert ptp["type"] == "ptp" and ptp["ipMasq"] is True
    assert ptp["ipam"]["ranges"] == [[{"subnet": "10.244.1.0/24"}]]
    assert portmap["type"] == "portmap"
    # Only plugins the node image links into /opt/cni/bin (from Debian's package).
    assert {p["type"] for p in conflist["plugins"]} | {ptp["ipam"]["type"]} <= set(nodeimage.CNI_PLUGINS)
    assert ipaddress.ip_network("10.244.1.0/24").subnet_of(ipaddress.ip_network(config.POD_SUBNET))


def test_cni_conflist_refuses_a_bad_cidr():
    with pytest.raises(ValueError):
        config.cni_conflist("10.244.1.0/33")


def test_pod_routes_reach_every_other_node_through_it_and_never_the_node_itself():
    nodes = [
        config.KindNode("cp", "172.18.0.2", "10.244.0.0/24"),
        config.KindNode("gpu", "172.18.0.3", "10.244.1.0/24"),
        config.KindNode("w2", "172.18.0.4", "10.244.2.0/24"),
    ]
    routes = config.pod_routes(nodes)
    assert routes["cp"] == [
        ["ip", "route", "replace", "10.244.1.0/24", "via", "172.18.0.3"],
        ["ip", "route", "replace", "10.244.2.0/24", "via", "172.18.0.4"],
    ]
    assert all("10.244.1.0/24" not in route for route in routes["gpu"])
    assert config.pod_routes(nodes[:1]) == {"cp": []}
    assert config.host_routes(nodes[:2]) == [
        ["ip", "route", "replace", "10.244.0.0/24", "via", "172.18.0.2"],
        ["ip", "route", "replace", "10.244.1.0/24", "via", "172.18.0.3"],
    ]


@pytest.mark.skipif(shutil.which("jq") is None, reason="the wrapper runs jq")
def test_runtime_wrapper_strips_the_missing_capability_from_spec_and_process(tmp_path):
    fake_runc = tmp_path / "runc"
    fake_runc.write_text('#!/bin/bash\necho "runc $*"\n')
    fake_runc.chmod(0o755)
    wrapper = tmp_path / "wrapper"
    wrapper.write_text(config.runtime_wrapper(str(fake_runc)))
    wrapper.chmod(0o755)
    caps = ["CAP_CHOWN", "CAP_SYS_RESOURCE", "CAP_NET_ADMIN"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(
        json.dumps({"process": {"capabilities": {"bounding": caps, "effective": caps}}})
    )
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["sh"], "capabilities": {"permitted": caps}}))
    out = subprocess.run(
        [str(wrapper), "create", "--bundle", str(bundle), "x"], capture_output=True, text=True
    )
    assert out.stdout.strip() == f"runc create --bundle {bundle} x"
    spec = json.loads((bundle / "config.json").read_text())["process"]["capabilities"]
    assert spec == {"bounding": ["CAP_CHOWN", "CAP_NET_ADMIN"], "effective": ["CAP_CHOWN", "CAP_NET_ADMIN"]}
    subprocess.run([str(wrapper), "exec", f"--process={process}", "x"], check=True, capture_output=True)
    assert json.loads(process.read_text())["capabilities"]["permitted"] == ["CAP_CHOWN", "CAP_NET_ADMIN"]


def test_image_names_are_keyed_by_component():
    listing = (
        "registry.k8s.io/kube-apiserver:v1.35.4\nregistry.k8s.io/coredns/coredns:v1.13.1\n"
        "registry.k8s.io/pause:3.10.1\nregistry.k8s.io/etcd:3.6.6-0\n"
    )
    names = config.image_names(listing)
    assert names["coredns"] == "registry.k8s.io/coredns/coredns:v1.13.1"
    assert names["etcd"] == "registry.k8s.io/etcd:3.6.6-0"
    assert set(names) == {"kube-apiserver", "coredns", "pause", "etcd"}


def test_wanted_by_reads_the_install_section():
    unit = "[Unit]\nDescription=x\n[Install]\nWantedBy=multi-user.target graphical.target\n"
    assert nodeimage.wanted_by(unit) == ["multi-user.target", "graphical.target"]
    assert nodeimage.wanted_by("[Unit]\n") == []


def test_the_coredns_build_imports_the_metrics_package_for_kubeadms_prometheus_directive():
    main = coredns_main(COREDNS_PLUGINS)
    assert '"github.com/coredns/coredns/plugin/metrics"' in main
    assert "plugin/prometheus" not in main
    assert '"prometheus", "errors"' in main and '"loop", "forward"}' in main


def test_differences_name_each_changed_sysctl_and_setting():
    before = {
        "sysctls": {"kernel.panic": "1", "vm.overcommit_memory": "0"},
        "links": ["lo", "eth0"],
        "packages": ["a"],
    }
    after = {
        "sysctls": {"kernel.panic": "10", "vm.overcommit_memory": "0"},
        "links": ["lo", "eth0", "docker0"],
        "packages": ["a"],
    }
    assert host.differences(before, after) == {
        "sysctl kernel.panic": ("1", "10"),
        "links": (["lo", "eth0"], ["lo", "eth0", "docker0"]),
    }
    assert host.differences(before, before) == {}
    assert host.added(before, after, "links") == ["docker0"]
    assert host.added(after, before, "links") == []


def test_recorded_sysctls_cover_the_nodes_and_kinds_own():
    from rolloutfleet_testkit.node.host import SYSCTLS as NODE_SYSCTLS

    assert set(NODE_SYSCTLS) <= set(host.SYSCTLS)
    # kind's base image sets these through /etc/sysctl.d in a privileged node, i.e. on the host.
    assert {"net.ipv4.conf.all.route_localnet", "net.ipv4.conf.all.rp_filter", "fs.protected_regular"} <= set(
        host.SYSCTLS
    )
    assert len(host.SYSCTLS) == len(set(host.SYSCTLS))


@pytest.mark.skipif(shutil.which("ctr") is None or shutil.which("go") is None, reason="needs ctr and go")
def test_kind_tree_lays_kinds_base_files_and_our_parts_over_a_rootfs(tmp_path):
    """kind's own base files (from its Go module) with its systemd set-up, Debian's containerd, runc
    and CNI plugins where kind calls them, and the Kubernetes binaries, over a (stub) rootfs."""
    tree = tmp_path / "tree"
    for directory in ("etc/systemd", "usr/bin", "sbin", "lib/systemd/system/multi-user.target.wants"):
        (tree / directory).mkdir(parents=True)
    (tree / "etc/systemd/journald.conf").write_text("[Journal]\n")
    (tree / "lib/systemd/system/multi-user.target.wants/getty.target").write_text("")
    kubelet = tmp_path / "kubelet"
    kubelet.write_text("#!/bin/sh\n")
    nodeimage.kind_tree(nodeimage.kind_base_files(), tree, {"kubelet": kubelet})

    wants = tree / "etc/systemd/system/multi-user.target.wants"
    assert {p.name for p in wants.iterdir()} == {
        "kubelet.service",
        "containerd.service",
        "undo-mount-hacks.service",
    }
    assert not (tree / "lib/systemd/system/multi-user.target.wants/getty.target").exists()
    assert str((tree / "sbin/init").readlink()) == "/usr/lib/systemd/systemd"
    assert str((tree / "etc/systemd/system/systemd-binfmt.service").readlink()) == "/dev/null"
    assert str((tree / "usr/local/bin/containerd").readlink()) == "/usr/bin/containerd"
    assert str((tree / "opt/cni/bin/ptp").readlink()) == "/usr/lib/cni/ptp"
    spec = json.loads((tree / "etc/containerd/cri-base.json").read_text())
    assert {"path": "/kind/bin/mount-product-files.sh"} in spec["hooks"]["createContainer"]
    assert "rlimits" not in spec["process"]
    assert "restrict_oom_score_adj = true" in (tree / "etc/containerd/config.toml").read_text()
    assert (tree / "usr/bin/kubelet").read_text() == "#!/bin/sh\n"
    assert (tree / "kind/version").read_text() == nodeimage.KUBERNETES_VERSION
    assert "StorageClass" in (tree / "kind/manifests/default-storage.yaml").read_text()
    assert (tree / "usr/local/bin/entrypoint").stat().st_mode & 0o111


def test_the_engines_image_goes_to_the_gpu_nodes_and_the_others_to_the_rest():
    assert nodes_for("sglang-emulator", ["w"], ["cp"]) == ["w"]
    assert nodes_for("proxy", ["w"], ["cp"]) == ["cp"]
    assert nodes_for("testkit", ["w"], ["cp"]) == ["cp", "w"]  # its stand-ins run as engines too


def test_a_streamed_archive_is_the_written_one_byte_for_byte(tmp_path):
    """The kind loader pipes the archive into the node's importer; the local cluster's importer reads
    the file: both must get the same image."""
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hello").write_text("hi\n")
    layer = tar_layer(tree, tmp_path / "layer.tar")
    written = write_image_archive(tmp_path / "image.tar", [layer], {"Cmd": ["/hello"]}, ["hello:1"])
    streamed = io.BytesIO()
    stream_image_archive(streamed, [layer], {"Cmd": ["/hello"]}, ["hello:1"])
    assert streamed.getvalue() == written.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(streamed.getvalue())) as archive:
        names = archive.getnames()
    assert "manifest.json" in names and any(n.endswith("/layer.tar") for n in names)


def test_a_compressed_stream_holds_gzip_layers_under_their_uncompressed_digests(tmp_path):
    """What the kind loader sends: each layer gzip-compressed (containerd stores it so), the image's
    config still naming the uncompressed layers (the diff ids the unpacked tree is checked against)."""
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hello").write_text("hi\n" * 1000)
    layer = tar_layer(tree, tmp_path / "layer.tar")
    packed = compressed_layer(layer).file()
    streamed = io.BytesIO()
    stream_image_archive(streamed, [layer], {"Cmd": ["/hello"]}, ["hello:1"], [packed])
    with tarfile.open(fileobj=io.BytesIO(streamed.getvalue())) as archive:
        manifest = json.loads(archive.extractfile("manifest.json").read())[0]
        config = json.loads(archive.extractfile(manifest["Config"]).read())
        sent = archive.extractfile(manifest["Layers"][0]).read()
    assert sent == packed.read_bytes() and sent[:2] == b"\x1f\x8b"
    assert gzip.decompress(sent) == layer.read_bytes()
    assert config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer.read_bytes()).hexdigest()}"]
