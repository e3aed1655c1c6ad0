"""A hostPath volume provisioner, so PersistentVolumeClaims bind on the bare control plane.

The scheduler does not place a pod whose claim is unbound, and the bare control plane has no
storage provisioner (kind ships local-path). This one provides the `rf-process-local` StorageClass
(the cluster default unless another default exists, binding Immediate) and, for each claim of that
class, a PersistentVolume whose hostPath is the per-claim directory the kubelet mounts
(<state>/pvc/<namespace>/<claim>); the controller manager's PV controller then binds the two.
When a claim is deleted its volume is Released; the provisioner deletes it and its directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kubernetes.client import Configuration

from .kube import Informer, Kube
from .volumes import claim_dir, remove_tree

log = logging.getLogger("rolloutfleet.kubelet")

STORAGE_CLASS = "rf-process-local"
PROVISIONER = "rolloutfleet.dev/process-kubelet"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
PROVISIONER_ANNOTATIONS = (
    "volume.kubernetes.io/storage-provisioner",
    "volume.beta.kubernetes.io/storage-provisioner",
)


def storage_class_manifest(default: bool) -> dict:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS, "annotations": {DEFAULT_CLASS_ANNOTATION: str(default).lower()}},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def wants_volume(pvc: dict) -> bool:
    """A pending claim of our class (or handed to our provisioner) that has no volume yet."""
    spec, meta = pvc.get("spec") or {}, pvc["metadata"]
    annotations = meta.get("annotations") or {}
    ours = spec.get("storageClassName") == STORAGE_CLASS or any(
        annotations.get(key) == PROVISIONER for key in PROVISIONER_ANNOTATIONS
    )
    pending = (pvc.get("status") or {}).get("phase", "Pending") == "Pending"
    return ours and pending and not spec.get("volumeName") and not meta.get("deletionTimestamp")


def pv_manifest(pvc: dict, path: Path) -> dict:
    meta, spec = pvc["metadata"], pvc.get("spec") or {}
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": f"pvc-{meta['uid']}",
            "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": storage},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": spec.get("storageClassName") or STORAGE_CLASS,
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


class Provisioner:
    def __init__(self, kube: Kube, configuration: Configuration, state_dir: Path):
        self._kube = kube
        self._state_dir = state_dir
        self._informers = [
            Informer(
                configuration,
                lambda api: api.list_persistent_volume_claim_for_all_namespaces,
                self._on_claim,
                "pvcs",
            ),
            Informer(configuration, lambda api: api.list_persistent_volume, self._on_volume, "pvs"),
        ]

    def start(self) -> Provisioner:
        classes = self._kube.request("GET", "/apis/storage.k8s.io/v1/storageclasses")["items"]
        has_default = any(
            (c["metadata"].get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"
            for c in classes
            if c["metadata"]["name"] != STORAGE_CLASS
        )
        self._kube.create("/apis/storage.k8s.io/v1/storageclasses", storage_class_manifest(not has_default))
        for informer in self._informers:
            informer.start()
        return self

    def stop(self) -> None:
        for informer in self._informers:
            informer.stop()

    def _on_claim(self, kind: str, pvc: dict) -> None:
        if kind == "DELETED" or not wants_volume(pvc):
            return
        path = claim_dir(self._state_dir, pvc["metadata"]["namespace"], pvc["metadata"]["name"])
        path.mkdir(parents=True, exist_ok=True)
        if self._kube.create("/api/v1/persistentvolumes", pv_manifest(pvc, path)) is not None:
            log.info(
                "provisioned %s for claim %s/%s", path, pvc["metadata"]["namespace"], pvc["metadata"]["name"]
            )

    def _on_volume(self, kind: str, pv: dict) -> None:
        annotations = pv["metadata"].get("annotations") or {}
        released = (pv.get("status") or {}).get("phase") == "Released"
        if (
            kind == "DELETED"
            or not released
            or annotations.get("pv.kubernetes.io/provisioned-by") != PROVISIONER
        ):
            return
        claim = pv["spec"].get("claimRef") or {}
        namespace, name = claim.get("namespace"), claim.get("name")
        self._kube.delete(f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
        if not (namespace and name):
            return
        # A new claim of the same name already reuses the directory: keep it then.
        if self._kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}") is None:
            remove_tree(claim_dir(self._state_dir, namespace, name))
