"""Session is built on SessionRecord: its persistent fields are the record's, declared once, and every
one of them survives a snapshot, a copy, a restore and a dump file."""

from __future__ import annotations

from array import array
from dataclasses import fields
from pathlib import Path

import pytest
from rolloutfleet_proxy.session import Session
from rolloutfleet_proxy.storage.dumps import LIVE_AREA, load_session_file, write_session_dump
from rolloutfleet_wire.session_record import RECORD_FIELDS, SessionRecord


def _full_record() -> SessionRecord:
    """A record whose every field differs from its default."""
    return SessionRecord(
        session_id="session-full-1",
        key_digest=b"\x07" * 32,
        created_at=12.5,
        metadata={"task": "t"},
        token_ids=array("i", [5, 6, 7, 8]),
        loss_mask=array("B", [0, 0, 1, 1]),
        logprobs=array("f", [0.0, 0.0, -0.5, -0.25]),
        turn_bounds=array("i", [0, 2, 4]),
        turn_versions=array("i", [3]),
        version_changes=array("i", [3, 4]),
        turn_temperatures=array("f", [0.5]),
        turn_tempered=array("B", [1]),
        turn_parents=array("i", [-1]),
        turn_keeps=array("i", [0]),
        turn_calls=array("i", [0]),
        turn_stop_tokens=array("i", [8]),
        turn_message_counts=array("i", [2]),
        turn_end_digests=array("B", b"\x09" * 32),
        turn_request_digests=array("B", b"\x0a" * 32),
        turn_finishes=array("B", [1]),
        turn_flags=array("B", [1]),
        turn_created=array("d", [1795000000.5]),
        image_spans=array("i", [1, 1, 1, 2, 2]),  # one image of 1 token in the prompt [5, 6]
        image_digests=array("B", b"\x0b" * 32),
        turn_routed=array("B", [1]),
        turn_routing_crcs=array("I", [0xDEADBEEF]),
        turn_stop_strings={0: "###"},
        idempotency_keys={"ab" * 16: 0},
        message_count=2,
        history_digest=b"\x09" * 32,
        last_output_stopped=True,
        last_stop_token=8,
        reward=1.5,
        turn_rewards={0: 0.25},
        finished=True,
    )


def test_every_record_field_differs_from_its_default_in_the_sample():
    defaults = SessionRecord("s", b"", 0.0, {}, array("i"), array("B"), array("f"), array("i"))
    full = _full_record()
    same = [f.name for f in fields(SessionRecord) if getattr(full, f.name) == getattr(defaults, f.name)]
    assert same == []  # a new field needs a value here too, or the round trips below miss it


def test_session_restores_snapshots_and_copies_every_persistent_field():
    record = _full_record()
    session = Session.from_record(record)
    assert session.to_record() == record
    copied = session.copied_record()
    assert copied == record
    assert all(
        getattr(copied, name) is not getattr(session, name)
        for name in RECORD_FIELDS
        if isinstance(getattr(session, name), array | dict)
    )


def test_a_dump_file_carries_every_persistent_field(tmp_path: Path):
    record = _full_record()
    path = write_session_dump(tmp_path, LIVE_AREA, record, "drain")
    assert load_session_file(path) == record


def test_a_session_is_a_record_that_compares_by_identity():
    a, b = Session("session-a", b"k" * 32, created_at=1.0), Session("session-a", b"k" * 32, created_at=1.0)
    assert a != b and len({a, b}) == 2
    assert a.turn_rewards is None and a.to_record().turn_rewards == {}
    assert not hasattr(a, "__dict__")  # slots only: sessions are many


def test_the_dump_format_refuses_to_load_without_a_place_for_every_field(monkeypatch):
    from rolloutfleet_proxy.storage import dumps

    dumps._check_storage_covers_the_record()  # as shipped: every field has exactly one place
    monkeypatch.delitem(dumps._HEADER, "finished")
    with pytest.raises(RuntimeError, match=r"not stored \['finished'\]"):
        dumps._check_storage_covers_the_record()
    monkeypatch.setitem(dumps._HEADER, "finished", dumps._HEADER["reward"])
    monkeypatch.setitem(dumps._HEADER, "token_ids", dumps._HEADER["reward"])
    with pytest.raises(RuntimeError, match=r"stored twice \['token_ids'\]"):
        dumps._check_storage_covers_the_record()


def test_a_dump_without_a_required_value_is_refused_by_name(tmp_path: Path):
    import orjson
    from rolloutfleet_proxy.storage.dumps import FORMAT, DumpFormatError
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    path = write_session_dump(tmp_path, LIVE_AREA, _full_record(), "drain")
    with safe_open(str(path), framework="numpy") as f:
        header = orjson.loads(f.metadata()[FORMAT])
    del header["message_count"]
    save_file(load_file(str(path)), str(path), metadata={FORMAT: orjson.dumps(header).decode()})
    with pytest.raises(DumpFormatError, match="no message_count in the header"):
        load_session_file(path)
