"""The process kubelet's cluster-DNS hosts file (a test-harness part), as a pure function."""

from __future__ import annotations

from rolloutfleet_testkit.kubelet.cluster_dns import HEADER, hosts_file, write_in_place


def service(name: str, selector: dict, namespace: str = "ns", **spec) -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"selector": selector, **spec}}


def pod(ip: str, labels: dict, ready: bool = True, namespace: str = "ns", terminating: bool = False, **spec):
    meta = {"name": f"p-{ip}", "namespace": namespace, "labels": labels}
    if terminating:
        meta["deletionTimestamp"] = "2026-11-21T00:00:00Z"
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": meta, "spec": spec, "status": {"podIP": ip, "conditions": [condition]}}


def test_service_names_map_to_the_lowest_ready_selected_pod():
    text = hosts_file(
        [service("gw", {"app": "gw"})],
        [
            pod("127.0.1.20", {"app": "gw"}),
            pod("127.0.1.3", {"app": "gw", "extra": "x"}),
            pod("127.0.1.2", {"app": "gw"}, ready=False),
            pod("127.0.1.1", {"app": "gw"}, terminating=True),
            pod("127.0.1.0", {"app": "other"}),
            pod("127.0.0.9", {"app": "gw"}, namespace="elsewhere"),
        ],
    )
    assert text.startswith(HEADER)
    assert text.endswith("127.0.1.3\tgw.ns gw.ns.svc gw.ns.svc.cluster.local\n")
    for absent in ("127.0.1.20", "127.0.1.2\t", "127.0.1.1\t", "127.0.1.0", "127.0.0.9"):
        assert absent not in text


def test_hostnames_with_a_headless_subdomain_get_their_own_names():
    labels = {"app": "proxy"}
    text = hosts_file(
        [service("f-proxies", labels, clusterIP="None"), service("plain", labels)],
        [
            pod("127.0.1.5", labels, hostname="f-proxy-0", subdomain="f-proxies"),
            pod("127.0.1.6", labels, hostname="f-proxy-1", subdomain="f-proxies"),
            pod("127.0.1.7", labels, ready=False, hostname="f-proxy-2", subdomain="f-proxies"),
            pod("127.0.1.8", labels, hostname="x-0", subdomain="plain"),  # not headless: no name
        ],
    )
    assert "127.0.1.5\tf-proxy-0.f-proxies.ns.svc f-proxy-0.f-proxies.ns.svc.cluster.local\n" in text
    assert "127.0.1.6\tf-proxy-1.f-proxies.ns.svc" in text
    assert "f-proxy-2" not in text and "x-0" not in text


def test_publish_not_ready_addresses_names_starting_pods():
    labels = {"app": "proxy"}
    text = hosts_file(
        [service("f-proxies", labels, clusterIP="None", publishNotReadyAddresses=True)],
        [pod("127.0.1.7", labels, ready=False, hostname="f-proxy-2", subdomain="f-proxies")],
    )
    assert "127.0.1.7\tf-proxy-2.f-proxies.ns.svc " in text and "127.0.1.7\tf-proxies.ns " in text


def test_selectorless_and_external_name_services_get_no_entry():
    labels = {"app": "a"}
    text = hosts_file(
        [service("ext", labels, type="ExternalName"), service("manual", {})], [pod("127.0.1.9", labels)]
    )
    assert text == HEADER


def test_rewrite_keeps_the_inode(tmp_path):
    path = tmp_path / "hosts"
    write_in_place(path, "a long first version\n")
    inode = path.stat().st_ino
    write_in_place(path, "short\n")
    assert path.read_text() == "short\n" and path.stat().st_ino == inode
