"""The kit's one bounded wait: it returns what the probe found, and a timeout names what it waited for."""

from __future__ import annotations

import time

import pytest
from rolloutfleet_testkit.waiting import log_tail, wait_for


def test_returns_the_first_truthy_value_of_the_probe():
    answers = iter([0, None, "", {"ready": True}, "never asked"])
    assert wait_for(lambda: next(answers), 5, "readiness", 0.001) == {"ready": True}
    assert next(answers) == "never asked"


def test_a_timeout_names_what_it_waited_for_and_the_detail():
    calls = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 0.2s waiting for the node: last 503"):
        wait_for(lambda: calls.append(1), 0.2, "the node", 0.05, detail=lambda: ": last 503")
    assert 0.2 <= time.monotonic() - started < 2
    assert 3 <= len(calls) <= 10  # polled at its interval, and once more at the deadline


def test_the_log_tail_is_the_last_lines_or_nothing(tmp_path):
    log = tmp_path / "kubelet.log"
    assert log_tail(log) == "" and log_tail(None) == ""
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    assert log_tail(log, lines=2) == "\nline 38\nline 39"


def test_ports_picked_together_are_distinct_and_free():
    import socket

    from rolloutfleet_testkit.processes import free_ports

    ports = free_ports(50)
    assert len(set(ports)) == 50
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free again once chosen
