"""The test cluster's pure parts: node configuration (CNI, containerd, kubelet, kube-proxy, CoreDNS),
the Dockerfile reader, the image archive's layout and SGLang's command line for the emulator."""

from __future__ import annotations

import ipaddress
import json
import re
import tarfile
import tomllib
from pathlib import Path

import pytest
from rolloutfleet_testkit.controlplane.cluster import component_args
from rolloutfleet_testkit.controlplane.pki import Pki
from rolloutfleet_testkit.images import dockerfile
from rolloutfleet_testkit.images.build import chain, ignored
from rolloutfleet_testkit.images.catalog import image_name
from rolloutfleet_testkit.images.oci import normalized, sha256_file, write_image_archive
from rolloutfleet_testkit.node import config
from rolloutfleet_testkit.node.binaries import coredns_main
from rolloutfleet_testkit.node.packages import missing_packages
from rolloutfleet_testkit.sglang_emulator.sglang_cli import emulator_args

ROOT = Path(__file__).resolve().parents[2]


def test_nodes_hand_out_disjoint_addresses_inside_the_bridge_subnet_away_from_the_gateway():
    subnet = ipaddress.ip_network(config.POD_SUBNET)
    ranges = []
    for node in config.NODES:
        start, end = ipaddress.ip_address(node.range_start), ipaddress.ip_address(node.range_end)
        assert start in subnet and end in subnet and start < end
        assert not start <= ipaddress.ip_address(config.BRIDGE_IP) <= end
        ranges.append(set(range(int(start), int(end) + 1)))
    assert not ranges[0] & ranges[1]
    assert [n.gpu for n in config.NODES] == [False, True]


def test_cni_conflist_is_a_bridge_without_masquerading(tmp_path):
    node = config.NODES[1]
    conf = config.cni_conflist(node, config.NodeDirs(tmp_path, tmp_path / "store"))
    bridge = conf["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["bridge"] == config.BRIDGE and bridge["ipMasq"] is False
    (range_,) = bridge["ipam"]["ranges"][0:1][0]
    assert range_ == {
        "subnet": config.POD_SUBNET,
        "rangeStart": node.range_start,
        "rangeEnd": node.range_end,
        "gateway": config.BRIDGE_IP,
    }
    assert bridge["ipam"]["dataDir"] == str(tmp_path / "ipam")  # per node: two nodes never share it


def test_containerd_config_has_what_this_machine_needs(tmp_path):
    dirs = config.NodeDirs(tmp_path / "rf-cpu-node", tmp_path / "store")
    text = config.containerd_config(dirs)
    parsed = tomllib.loads(text)
    cri = parsed["plugins"]["io.containerd.grpc.v1.cri"]
    assert parsed["grpc"]["address"] == str(dirs.socket)
    assert cri["restrict_oom_score_adj"] is True and cri["disable_apparmor"] is True
    assert cri["sandbox_image"] == config.PAUSE_IMAGE
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert cri["cni"] == {"bin_dir": "/usr/lib/cni", "conf_dir": str(dirs.cni_conf)}
    assert parsed["root"] == str(dirs.store) and parsed["state"].startswith(str(dirs.root))


def test_kubelet_config_and_args(tmp_path):
    gpu = config.NODES[1]
    dirs = config.NodeDirs(tmp_path, tmp_path / "store")
    kubelet = config.kubelet_config(gpu, dirs, 10250, 10248, tmp_path / "ca.crt")
    assert kubelet["failCgroupV1"] is False and kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["cgroupRoot"] == "/rolloutfleet-rf-gpu-node"
    assert kubelet["clusterDNS"] == [config.CLUSTER_DNS_IP] and kubelet["address"] == config.BRIDGE_IP
    assert kubelet["authentication"]["anonymous"] == {"enabled": False}
    assert kubelet["containerRuntimeEndpoint"] == f"unix://{dirs.socket}"
    # No disk threshold on (one crossed deletes every unused image: the pause image between pods).
    disk = {k: v for k, v in kubelet["evictionHard"].items() if k.startswith(("nodefs", "imagefs"))}
    assert set(disk) == {"nodefs.available", "nodefs.inodesFree", "imagefs.available", "imagefs.inodesFree"}
    assert set(disk.values()) == {"0%"} and kubelet["imageGCHighThresholdPercent"] == 100
    args = config.kubelet_args(gpu, dirs, Path("/bin/kubelet"), tmp_path / "k")
    assert "--node-labels=nvidia.com/gpu.present=true" in args
    assert "--register-with-taints=nvidia.com/gpu=present:NoSchedule" in args
    assert "--hostname-override=rf-gpu-node" in args
    cpu_args = config.kubelet_args(config.NODES[0], dirs, Path("/bin/kubelet"), tmp_path / "k")
    assert not any(a.startswith(("--node-labels", "--register-with-taints")) for a in cpu_args)


def test_kube_proxy_serves_node_ports_on_the_bridge_only(tmp_path):
    proxy = config.kube_proxy_config(tmp_path / "k", "rf-cpu-node", 1, 2)
    assert proxy["mode"] == "iptables" and proxy["clusterCIDR"] == config.POD_SUBNET
    assert proxy["nodePortAddresses"] == [f"{config.BRIDGE_IP}/32"]
    assert proxy["iptables"]["localhostNodePorts"] is False and proxy["conntrack"]["maxPerCore"] == 0


def test_coredns_answers_cluster_names_only():
    corefile = config.corefile(18080, 18181)
    assert "forward" not in corefile and f"bind {config.BRIDGE_IP}" in corefile
    assert "kubernetes cluster.local" in corefile
    objects = {o["kind"]: o for o in config.dns_objects(18080, 18181)}
    assert objects["Service"]["spec"]["clusterIP"] == config.CLUSTER_DNS_IP
    assert objects["Deployment"]["spec"]["template"]["spec"]["hostNetwork"] is True
    main = coredns_main()
    for plugin in config.corefile(1, 2).split():
        if plugin in ("bind", "errors", "health", "ready", "cache", "loadbalance", "reload", "kubernetes"):
            assert f'"github.com/coredns/coredns/plugin/{plugin}"' in main, plugin


def test_the_api_server_faces_the_nodes_only_when_asked(tmp_path):
    ports = {
        "etcd": 1,
        "etcd-peer": 2,
        "kube-apiserver": 3,
        "kube-controller-manager": 4,
        "kube-scheduler": 5,
    }
    pki = Pki(tmp_path)
    loopback = component_args("kube-apiserver", Path("/bin"), tmp_path, pki, ports)
    assert "--endpoint-reconciler-type=none" in loopback and "--bind-address=127.0.0.1" in loopback
    bridge = component_args("kube-apiserver", Path("/bin"), tmp_path, pki, ports, config.BRIDGE_IP)
    assert (
        f"--advertise-address={config.BRIDGE_IP}" in bridge and "--endpoint-reconciler-type=lease" in bridge
    )
    assert "--kubelet-preferred-address-types=InternalIP" in bridge
    assert any(a.startswith("--kubelet-client-certificate=") for a in bridge)


def test_missing_packages_are_named_by_their_debian_names():
    assert missing_packages(lambda path: True) == []
    assert missing_packages(lambda path: path != "/usr/sbin/runc") == ["runc"]


DOCKERFILE = """# comment
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV A=1 B="two words"
WORKDIR /src
COPY pyproject.toml \\
     README.md ./
RUN --mount=type=cache,id=uv,target=/root/.cache/uv echo $A \\
 && echo ${B:-none} ${C:-fallback}
USER 65532:65532
ENTRYPOINT ["rolloutfleet-proxy"]
CMD echo shell form
"""


def test_dockerfile_instructions_flags_and_forms():
    parsed = dockerfile.parse(DOCKERFILE)
    assert [i.keyword for i in parsed] == [
        "ARG",
        "FROM",
        "ENV",
        "WORKDIR",
        "COPY",
        "RUN",
        "USER",
        "ENTRYPOINT",
        "CMD",
    ]
    copy = parsed[4]
    assert copy.text == "pyproject.toml README.md ./" and copy.line == 6
    run = parsed[5]
    assert dockerfile.cache_mounts(run) == {"/root/.cache/uv": "uv"}
    assert run.text == "echo $A && echo ${B:-none} ${C:-fallback}"
    assert parsed[7].exec_form == ["rolloutfleet-proxy"] and parsed[8].exec_form is None
    assert dockerfile.key_values(parsed[2].text) == {"A": "1", "B": "two words"}
    assert dockerfile.substitute(run.text, {"A": "x", "B": "y"}) == "echo x && echo y fallback"
    assert dockerfile.substitute("${X:+set}|${Y:+set}", {"X": "1"}) == "set|"


@pytest.mark.parametrize(
    "text",
    ["RUN echo no base", "FROM x\nADD a b", "FROM x\nRUN --mount=type=bind,target=/x true"],
)
def test_dockerfile_errors(text):
    with pytest.raises(dockerfile.DockerfileError):
        instructions = dockerfile.parse(text)
        for instruction in instructions:
            dockerfile.cache_mounts(instruction)


def test_build_context_ignores_caches_and_the_chain_key_changes_with_any_part():
    patterns = ["**/__pycache__", "**/*.pyc", ".git"]
    assert ignored("proxy/rolloutfleet_proxy/__pycache__/app.cpython-311.pyc", patterns)
    assert ignored(".git/HEAD", patterns) and not ignored("proxy/rolloutfleet_proxy/app.py", patterns)
    assert chain("a", "RUN x") != chain("a", "RUN y") != chain("b", "RUN y")
    assert chain("a", "RUN x") == chain("a", "RUN x")


def test_project_dockerfiles_build_from_a_public_base_and_product_images_hold_no_test_kit():
    for name in ("proxy", "operator", "testkit", "sglang-emulator"):
        parsed = dockerfile.parse((ROOT / "images" / name / "Dockerfile").read_text())
        arg = dockerfile.key_values(parsed[0].text)
        assert parsed[0].keyword == "ARG" and arg == {"BASE": "python:3.11-slim"}, name
        copies = " ".join(i.text for i in parsed if i.keyword == "COPY")
        test_kit = any(word == "e2e" or word.startswith("e2e/") for word in copies.split())
        assert test_kit == (name in ("testkit", "sglang-emulator")), name
        if name in ("proxy", "operator"):
            assert any(i.keyword == "USER" and i.text == "65532:65532" for i in parsed), name
            # Multi-stage: the image is the last stage, which takes the built environment from the
            # builder and installs nothing itself (no uv, pip or compilers reach the image).
            froms = [n for n, i in enumerate(parsed) if i.keyword == "FROM"]
            final = parsed[froms[-1] :]
            assert len(froms) == 2 and dockerfile.stage_source(parsed[froms[0]].text)[1] == "builder", name
            assert [i.flag("from") for i in final if i.keyword == "COPY"] == [["builder"]], name
            assert not [
                i.text for i in final if i.keyword == "RUN" and re.search(r"\b(uv|pip|gcc)\b", i.text)
            ]
            labels = dockerfile.key_values(next(i.text for i in final if i.keyword == "LABEL"))
            assert labels["org.opencontainers.image.version"] == "${VERSION}", name


def test_image_archive_layout_names_and_digests(tmp_path):
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as out:
        info = tarfile.TarInfo("hello.txt")
        info.size = 2
        import io

        out.addfile(info, io.BytesIO(b"hi"))
    archive = write_image_archive(tmp_path / "image.tar", [layer], {"Entrypoint": ["/x"]}, ["a:1", "b/c:2"])
    with tarfile.open(archive) as read:
        manifest = json.loads(read.extractfile("manifest.json").read())
        (entry,) = manifest
        assert entry["RepoTags"] == ["a:1", "b/c:2"]
        digest = sha256_file(layer)
        assert entry["Layers"] == [f"{digest}/layer.tar"]
        image = json.loads(read.extractfile(entry["Config"]).read())
    assert image["rootfs"]["diff_ids"] == [f"sha256:{digest}"] and image["config"]["Entrypoint"] == ["/x"]


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        (image_name("proxy"), f"docker.io/library/{image_name('proxy')}"),
        ("lmsysorg/sglang", "docker.io/lmsysorg/sglang:latest"),
        ("rolloutfleet.local/pause:1", "rolloutfleet.local/pause:1"),
        ("localhost:5000/x:2", "localhost:5000/x:2"),
    ],
)
def test_image_names_normalize_as_the_kubelet_does(name, reference):
    assert normalized(name) == reference


def test_sglang_command_line_becomes_the_emulators():
    args = [
        "--model-path", "/models", "--host", "0.0.0.0", "--port", "30000", "--tp-size", "2",
        "--mem-fraction-static", "0.85", "--trust-remote-code", "--served-model-name", "m",
        "--random-seed=3", "--token-delay-s", "0.02",
    ]  # fmt: skip
    assert emulator_args(args) == [
        "--host", "0.0.0.0", "--port", "30000", "--model-name", "m", "--seed", "3",
        "--token-delay-s", "0.02", "--tokenizer-path", "/models",
    ]  # fmt: skip
    assert emulator_args(["--tokenizer-path", "/tok", "--model-path", "/w"]) == ["--tokenizer-path", "/tok"]
