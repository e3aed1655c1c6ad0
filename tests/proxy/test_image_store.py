"""The image store (storage/images.py) on real files: a start trusts the files a predecessor left by
name and verifies each on first use; a collection works from a snapshot of references taken on the
loop and keeps what a request touched after it."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from rolloutfleet_proxy.images import digest_of, inspect
from rolloutfleet_proxy.storage.images import ImageStore, referenced_digests
from rolloutfleet_testkit.screenshots import screenshot

FORMATS = frozenset({"png", "jpeg", "webp"})


def stored(store: ImageStore, data: bytes) -> bytes:
    """An image brought by a request: pinned, written, released."""
    digest = digest_of(data)
    if store.pin(digest) is None:
        store.put(inspect(data, digest, FORMATS), data)
    store.unpin([digest])
    return digest


def test_a_start_trusts_file_names_and_verifies_each_file_on_first_use(tmp_path):
    images = tmp_path / "images"
    first = ImageStore(images)
    first.load()
    shots = [screenshot(320, 200, seed=i) for i in range(3)]
    digests = [stored(first, shot) for shot in shots]
    # A file damaged after it was written (its header intact), one whose name is no sha256, one
    # whose header is no image: the first is trusted until used, the others are set aside.
    damaged = first.path(first.info(digests[0]))
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (images / "not-a-digest.png").write_bytes(shots[1])
    (images / f"{'ab' * 32}.png").write_bytes(b"no image at all")

    second = ImageStore(images)
    assert second.load() == 3 and second.bytes == sum(len(s) for s in shots)
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == [
        f"{'ab' * 32}.png",
        "not-a-digest.png",
    ]
    # An export reading a damaged file refuses it; an intact one reads, and is verified from then on.
    with pytest.raises(ValueError, match="does not hold the bytes its name says"):
        second.read(digests[0])
    assert second.read(digests[1]) == shots[1]
    # A request that brings the image again rewrites the file from its bytes.
    assert second.pin(digests[0]) is None  # unverified: the request's bytes are stored again
    second.put(inspect(shots[0], digests[0], FORMATS), shots[0])
    second.unpin([digests[0]])
    assert hashlib.sha256(damaged.read_bytes()).digest() == digests[0]
    assert second.read(digests[0]) == shots[0]
    assert second.pin(digests[2]) is None and second.pin(digests[1]) is not None  # verified by the read


def test_a_collection_keeps_what_its_snapshot_references_and_what_requests_touched_since(tmp_path):
    store = ImageStore(tmp_path / "images")
    store.load()
    digests = [stored(store, screenshot(64, 64, seed=i)) for i in range(4)]
    session_digests = array("B", digests[0] + digests[0])  # a session showing image 0 twice
    since = store.epoch()
    holders = [session_digests, frozenset({digests[1]})]  # and a batch not acknowledged
    assert referenced_digests(holders) == {digests[0], digests[1]}
    # After the snapshot a turn records image 2 (pinned, recorded, released); image 3 is pinned still.
    store.pin(digests[2])
    store.unpin([digests[2]])
    store.pin(digests[3])

    assert store.collect(holders, since) == []
    assert len(store) == 4
    store.unpin([digests[3]])
    # The next collection, from a newer snapshot in which only the session holds anything.
    gone = store.collect([session_digests], store.epoch())
    assert sorted(info.digest for info in gone) == sorted(digests[1:])
    assert [p.name.partition(".")[0] for p in (tmp_path / "images").iterdir()] == [digests[0].hex()]
    assert store.bytes == store.info(digests[0]).size
