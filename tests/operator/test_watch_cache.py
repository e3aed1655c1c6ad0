"""The watch caches' read side (watch_cache.py): objects grouped by fleet, looked up by kind and name."""

from __future__ import annotations

import kopf
from rolloutfleet_operator import main as operator_main
from rolloutfleet_operator.fleet import COMPONENT_LABEL, FLEET_LABEL
from rolloutfleet_operator.watch_cache import CACHED_KINDS, FleetStore, OwnedObjects, by_fleet, index_id


def obj(name: str, fleet: str | None, component: str = "proxy", namespace: str = "ns") -> dict:
    labels = {COMPONENT_LABEL: component} | ({FLEET_LABEL: fleet} if fleet else {})
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels}}


def test_objects_are_indexed_by_namespace_and_fleet():
    assert by_fleet(obj("a", "f")) == {("ns", "f"): obj("a", "f")}
    assert by_fleet(obj("a", None)) == {}  # managed by the operator but of no fleet: not cached


def test_lookup_by_kind_fleet_component_and_name():
    pod = ("v1", "Pod")
    owned = OwnedObjects(
        {
            kind: {("ns", "f"): [obj("f-proxy-0", "f"), obj("f-engine-x", "f", "engine")]}
            if kind == pod
            else {}
            for kind in CACHED_KINDS
        }
    )
    assert [p["metadata"]["name"] for p in owned.of_fleet(pod, "ns", "f", "proxy")] == ["f-proxy-0"]
    assert len(owned.of_fleet(pod, "ns", "f")) == 2
    assert owned.of_fleet(pod, "ns", "other") == []
    assert owned.get(pod, "ns", "f", "f-engine-x") == obj("f-engine-x", "f", "engine")
    assert owned.get(("apps/v1", "Deployment"), "ns", "f", "f-gateway") is None


def test_index_ids_are_distinct_keywords():
    ids = [index_id(kind) for kind in CACHED_KINDS]
    assert len(set(ids)) == len(ids) and all(i.isidentifier() for i in ids)


def test_the_fleet_store_keeps_the_latest_body():
    store = FleetStore()
    body = {"metadata": {"namespace": "ns", "name": "f", "resourceVersion": "1"}}
    store.put(body)
    store.put({**body, "metadata": {**body["metadata"], "resourceVersion": "2"}})
    assert store.get("ns", "f")["metadata"]["resourceVersion"] == "2"
    store.forget("ns", "f")
    assert store.get("ns", "f") is None and ("ns", "f") not in store


async def test_the_operator_watches_only_the_objects_it_manages():
    """Every cached kind's watch carries a label selector, so the API server sends only the
    operator's own pods and children (kopf's handler filter alone would still stream every pod and
    Service of the cluster to the operator); fleets are watched whole."""
    settings = kopf.OperatorSettings()
    operator_main.select_owned_objects(settings)
    fleets = kopf.Resource(
        group="rolloutfleet.dev", version="v1alpha1", plural="rolloutfleets", namespaced=True
    )
    for kind in CACHED_KINDS:
        group, version, plural = operator_main._resource(kind)
        resource = kopf.Resource(group=group, version=version, plural=plural, kind=kind[1], namespaced=True)
        selector = ",".join(settings.watching.label_selectors.collect(resource))
        assert selector == "app.kubernetes.io/managed-by=rolloutfleet-operator", kind
    assert list(settings.watching.label_selectors.collect(fleets)) == []
