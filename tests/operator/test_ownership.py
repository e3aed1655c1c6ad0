"""Which proxy pods a fleet owns (ownership.py): its controller ownerReference's uid decides, not
its labels; orphans are adopted with a patch that names the pod's uid."""

from __future__ import annotations

import copy

from fleet_samples import sample
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_operator.ownership import adoption_patch, claim_proxy_pods, controller_uid, proxy_views


def pod(fleet, ordinal: int, owner_uid: str | None, pod_uid: str = "p") -> dict:
    manifest = copy.deepcopy(proxy_pod(fleet, ordinal))
    manifest["metadata"]["uid"] = f"{pod_uid}-{ordinal}"
    if owner_uid is None:
        del manifest["metadata"]["ownerReferences"]
    else:
        manifest["metadata"]["ownerReferences"][0]["uid"] = owner_uid
    return manifest


def test_pods_are_the_fleets_by_owner_uid_not_by_label():
    fleet = parse_fleet(sample("minimal", uid="fleet-now"))
    mine, earlier, orphan = pod(fleet, 0, "fleet-now"), pod(fleet, 1, "fleet-before"), pod(fleet, 2, None)
    stray = copy.deepcopy(mine)
    stray["metadata"]["name"] = "not-a-proxy-name"
    claim = claim_proxy_pods(fleet, [mine, earlier, orphan, stray])
    assert claim.owned == (mine,) and claim.orphans == (orphan,) and claim.foreign == (earlier,)
    assert claim.foreign_names == {earlier["metadata"]["name"]}
    assert list(proxy_views(fleet, claim.owned)) == [mine["metadata"]["name"]]


def test_a_non_controller_reference_does_not_make_a_pod_anyones():
    fleet = parse_fleet(sample("minimal", uid="fleet-now"))
    loose = pod(fleet, 0, "fleet-now")
    loose["metadata"]["ownerReferences"][0]["controller"] = False
    assert controller_uid(loose) is None
    assert claim_proxy_pods(fleet, [loose]).orphans == (loose,)


def test_the_adoption_patch_carries_the_owner_and_the_pods_uid():
    fleet = parse_fleet(sample("minimal", uid="fleet-now"))
    orphan = pod(fleet, 3, None, pod_uid="orphan")
    patch = adoption_patch(fleet, orphan)
    assert patch["metadata"]["uid"] == "orphan-3"  # a precondition: refused if the name holds another pod
    (ref,) = patch["metadata"]["ownerReferences"]
    assert ref["uid"] == "fleet-now" and ref["controller"] is True and ref["kind"] == "RolloutFleet"
