"""Which proxy pods a fleet owns: a pure claim over the pods its label selects, as Kubernetes'
controllers claim pods (ownerReferences, not labels alone, say whose a pod is).

- A pod named `<fleet>-proxy-<i>` whose controller ownerReference carries the fleet's uid is the
  fleet's: planned, polled, counted, rolled and restarted.
- An orphan (the fleet's labels and a proxy name, no controller ownerReference: e.g. left by a
  fleet deleted with `--cascade=orphan`) is adopted: the reconciler patches the fleet's
  ownerReference in, with the pod's uid as precondition, and from then on it is the fleet's.
- A pod controlled by anything else (an earlier fleet of the same name still being garbage
  collected, another controller) is never the fleet's: not polled, counted as serving, rolled or
  deleted. It holds its name, so that ordinal is not created until it is gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .fleet import Fleet, proxy_ordinal
from .manifests.metadata import owner_reference
from .plan import ProxyPodView, proxy_pod_view

Pod = Mapping[str, Any]


def controller_uid(obj: Pod) -> str | None:
    """The uid of the object's controller (its ownerReference with `controller: true`), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("uid") or "") or None
    return None


@dataclass(frozen=True)
class ProxyClaim:
    """The proxy-named pods of a fleet's selection, by whose they are."""

    owned: tuple[Pod, ...] = ()
    orphans: tuple[Pod, ...] = ()  # no controller: to adopt
    foreign: tuple[Pod, ...] = ()  # another controller's: left alone

    @property
    def foreign_names(self) -> frozenset[str]:
        return frozenset(_name(pod) for pod in self.foreign)


def claim_proxy_pods(fleet: Fleet, pods: Iterable[Pod]) -> ProxyClaim:
    """Sort `pods` (the fleet's proxy selection) into owned, orphans and foreign; pods whose name
    is not `<fleet>-proxy-<i>` are none of these and dropped."""
    owned, orphans, foreign = [], [], []
    for pod in pods:
        if proxy_ordinal(fleet, _name(pod)) is None:
            continue
        controller = controller_uid(pod)
        if controller == fleet.uid and fleet.uid:
            owned.append(pod)
        elif controller is None:
            orphans.append(pod)
        else:
            foreign.append(pod)
    return ProxyClaim(tuple(owned), tuple(orphans), tuple(foreign))


def adoption_patch(fleet: Fleet, pod: Pod) -> dict[str, Any]:
    """The strategic merge patch that adopts an orphan: the fleet's controller ownerReference
    (ownerReferences merge by uid), and the pod's uid, which makes the API server refuse the patch
    (409) if the name now holds another pod (as the ReplicaSet controller adopts)."""
    uid = (pod.get("metadata") or {})["uid"]
    return {"metadata": {"ownerReferences": [owner_reference(fleet)], "uid": uid}}


def proxy_views(fleet: Fleet, owned: Iterable[Pod]) -> dict[str, ProxyPodView]:
    """Pod name -> view, for the fleet's own proxy pods."""
    views = {}
    for pod in owned:
        ordinal = proxy_ordinal(fleet, _name(pod))
        if ordinal is not None:
            views[_name(pod)] = proxy_pod_view(pod, ordinal)
    return views


def _name(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")
