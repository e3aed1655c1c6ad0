"""The trainer-side client against two real proxies: pull across the fleet, torch tensors, ack, versions."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
import torch
from proxy_harness import ADMIN_KEY, play_session, remount, running_proxy, tmpfs
from rolloutfleet_client.errors import NoAnswerCode, ProxyRequestError
from rolloutfleet_client.retry import Backoff, nothing_done, trainer_should_retry
from rolloutfleet_client.trainer import ProxyCallError, TrainerClient, to_torch
from rolloutfleet_testkit.processes import free_port, serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app
from rolloutfleet_testkit.waiting import wait_for
from rolloutfleet_wire.errors import ErrorCode


@pytest.fixture(scope="module")
def upstream_url():
    with serve_app(create_stub_app(latency_s=0.0, output_tokens=4)) as url:
        yield url


@pytest.fixture
def fleet(upstream_url, test_tokenizer_dir, tmp_path):
    with (
        running_proxy(upstream_url, test_tokenizer_dir, tmp_path / "p0") as p0,
        running_proxy(upstream_url, test_tokenizer_dir, tmp_path / "p1") as p1,
    ):
        yield [p0, p1]


def test_pull_across_the_fleet_to_torch_and_ack(fleet):
    p0, p1 = fleet
    expected = {}
    for proxy, turns in ((p0, 1), (p0, 2), (p1, 1), (p1, 3), (p1, 1)):
        sid, key = play_session(proxy, turns=turns, reward=float(turns))
        expected[sid] = proxy.get(sid, key).json()["trajectory"]
    with TrainerClient([p0.url, p1.url + "/"], ADMIN_KEY) as client:
        client.set_model_version(1)
        batches = client.pull(4)
        assert sum(b.num_trajectories for b in batches) == 4  # never more than asked for
        assert {b.proxy_url for b in batches} == {p0.url, p1.url}
        tensors = to_torch(batches, pad_token_id=-7)
        infos = [info for b in batches for info in b.trajectories()]
        assert tensors["input_ids"].shape == tensors["attention_mask"].shape == tensors["versions"].shape
        assert tensors["input_ids"].dtype == torch.int64 and tensors["attention_mask"].dtype == torch.bool
        assert tensors["rewards"].shape == (4,) and tensors["seq_lens"].tolist() == [
            i["num_tokens"] for i in infos
        ]
        for row, info in enumerate(infos):
            want = expected[info["session_id"]]
            n = len(want["input_ids"])
            assert tensors["input_ids"][row, :n].tolist() == want["input_ids"]
            assert (tensors["input_ids"][row, n:] == -7).all()
            assert tensors["attention_mask"][row].sum().item() == n
            assert tensors["loss_mask"][row, :n].tolist() == [bool(m) for m in want["loss_mask"]]
            assert tensors["logprobs"][row, :n].tolist() == pytest.approx(want["logprobs"])
            assert tensors["versions"][row].tolist() == [0 if m else -1 for m in want["loss_mask"]] + [-1] * (
                tensors["versions"].shape[1] - n
            )
            assert tensors["rewards"][row].item() == info["reward"] == len(want["turns"])
        assert client.ack(batches) == {b.batch_id: True for b in batches}
        assert client.ack(batches[:1]) == {batches[0].batch_id: False}  # idempotent: already acknowledged
        assert all(p.stats()["export_bytes"] == 0 for p in fleet)
        rest = client.pull(10)
        assert sum(b.num_trajectories for b in rest) == 1 and client.pull(10) == []
        client.ack(rest)


def test_pull_waits_for_trajectories_and_pending_recovers_unacked(fleet):
    p0, p1 = fleet
    sid, key = play_session(p1, finish=False)
    timer = threading.Timer(
        0.3,
        lambda: httpx.post(f"{p1.url}/v1/sessions/{sid}/finish", headers={"Authorization": f"Bearer {key}"}),
    )
    timer.start()
    with TrainerClient([p0.url, p1.url], ADMIN_KEY) as client:
        assert client.pull(1) == []  # nothing ready yet, no wait asked for
        (batch,) = client.pull(1, timeout_s=10, poll_interval_s=0.05)
        timer.join()
        assert batch.proxy_url == p1.url and batch.trajectories()[0]["session_id"] == sid
        # A trainer that lost its batches (restart) finds what is still unacknowledged.
        (again,) = client.pending()
        assert again.batch_id == batch.batch_id and again.data == batch.data
        assert client.ack([again]) == {batch.batch_id: True}
        assert client.pending() == []


def test_fleet_version_and_pause(fleet):
    with TrainerClient([p.url for p in fleet], ADMIN_KEY) as client:
        answers = client.set_model_version(12)
        assert {url: a["model_version"] for url, a in answers.items()} == {p.url: 12 for p in fleet}
        assert all(a["paused"] and a["generating_turns"] == 0 for a in client.pause(wait_s=1).values())
        assert all(p.stats()["generation_paused"] for p in fleet)
        assert not any(a["paused"] for a in client.resume().values())


def test_errors_are_raised_not_swallowed(fleet):
    with (
        TrainerClient([fleet[0].url], "wrong-key", retries=0) as client,
        pytest.raises(ProxyRequestError) as err,
    ):
        client.pull(1)
    assert err.value.status == 401 and err.value.code == ErrorCode.UNAUTHORIZED
    assert ProxyCallError is ProxyRequestError  # the name the docs gave it first still works
    dead = f"http://127.0.0.1:{free_port()}"
    with TrainerClient([dead, fleet[0].url], ADMIN_KEY, retries=0) as client:
        play_session(fleet[0])
        (batch,) = client.pull(5)  # an unreachable proxy is skipped, the others still serve
        with pytest.raises(ProxyRequestError, match="unreachable") as unreachable:
            client.set_model_version(1)
        assert unreachable.value.status is None and unreachable.value.code == NoAnswerCode.UNREACHABLE
        client.ack([batch])


@pytest.mark.parametrize(
    ("status", "code", "repeatable", "retry"),
    [
        (503, "draining", True, True),  # a proxy shutting down: its successor holds the batches
        (503, "draining", False, True),  # said by the proxy itself: no batch was built
        (503, "storage_unavailable", False, True),
        (503, "starting", True, True),
        (503, "http_error", True, True),  # a balancer's answer without the proxy's body
        (503, "http_error", False, False),  # ...for a batch build: the proxy may have built it
        (502, "http_error", True, True),
        (503, "some_future_code", True, True),  # a newer proxy's code: the status decides
        (410, "draining", True, False),  # a batch dropped at shutdown is gone for good
        (410, "batch_expired", True, False),
        (409, "session_not_finished", True, False),
        (404, "not_found", True, False),
        (401, "unauthorized", True, False),
        (500, "internal_error", True, False),
        (504, "upstream_timeout", True, False),
    ],
)
def test_the_trainer_retries_what_the_shared_codes_call_retryable(status, code, repeatable, retry):
    assert trainer_should_retry(status, code, repeatable=repeatable) is retry
    assert nothing_done(status, code) is (retry or (code == "http_error" and not repeatable))


def test_the_trainer_waits_out_a_proxy_that_cannot_persist(upstream_url, test_tokenizer_dir, tmp_path):
    """A real proxy whose dump volume turns read-only refuses exports with 503 storage_unavailable;
    a pull skips it, a call with retries waits until the volume is back and then gets the batch."""
    with (
        tmpfs(tmp_path / "dumps", "16m") as dumps,
        running_proxy(upstream_url, test_tokenizer_dir, dumps, storage_check_interval_s=0.1) as proxy,
    ):
        sid, _ = play_session(proxy)
        remount(dumps, "ro")
        wait_for(lambda: httpx.get(f"{proxy.url}/readyz").status_code == 503, 10, "/readyz 503", 0.05)
        backoff = Backoff(initial_s=0.1, cap_s=0.3)
        with TrainerClient([proxy.url], ADMIN_KEY, backoff=backoff, retries=40) as client:
            with pytest.raises(ProxyRequestError) as refused:
                client.export_from(proxy.url, max_trajectories=1, retries=0)
            assert refused.value.status == 503 and refused.value.code == ErrorCode.STORAGE_UNAVAILABLE
            assert client.pull(1) == []  # skipped this round, not raised
            timer = threading.Timer(1.0, remount, (dumps, "rw"))
            timer.start()
            try:
                batch = client.export_from(proxy.url, max_trajectories=1)
            finally:
                timer.join()
            assert batch is not None and [t["session_id"] for t in batch.trajectories()] == [sid]
            assert client.ack([batch]) == {batch.batch_id: True}


def test_proxy_server_imports_neither_torch_nor_the_client():
    code = (
        "import sys, rolloutfleet_proxy.main, rolloutfleet_proxy.app; "
        "print('torch' in sys.modules, 'rolloutfleet_client.trainer' in sys.modules); "
        "import rolloutfleet_client.trainer; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_from_fleet_status_takes_the_ready_proxies_of_the_fleet():
    fleet = {"status": {"proxyEndpoints": ["http://a:8000", "http://b:8000/"]}}
    with TrainerClient.from_fleet_status(fleet, ADMIN_KEY) as client:
        assert client.proxy_urls == ["http://a:8000", "http://b:8000"]
    with TrainerClient.from_fleet_status(fleet["status"], ADMIN_KEY) as client:
        assert len(client.proxy_urls) == 2
    with pytest.raises(ValueError, match="no proxyEndpoints"):
        TrainerClient.from_fleet_status({"status": {"proxyEndpoints": []}}, ADMIN_KEY)


def test_a_group_exports_one_row_per_choice_sharing_a_group_id(fleet):
    """n = 3 then a continuation of a choice: exported per leaf, each leaf is a row of to_torch, the
    group's rows share a group id, the continued choice's row is its own group with its own turn."""
    proxy = fleet[0]
    sid, key = proxy.create_session()
    chat = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    first = [{"role": "user", "content": "pick one"}]
    group = httpx.post(chat, headers=auth, json={"messages": first, "max_tokens": 4, "n": 3}).json()
    assert group["rolloutfleet"]["turns"] == [0, 1, 2]
    follow = [*first, group["choices"][1]["message"], {"role": "user", "content": "more"}]
    assert httpx.post(chat, headers=auth, json={"messages": follow, "max_tokens": 4}).status_code == 200
    httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": 0.5, "turn": 0})
    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/finish", headers=auth).is_success
    with TrainerClient(proxy.url, ADMIN_KEY) as client:
        batches = client.pull(1, samples="leaves")
        assert [b.num_sessions for b in batches] == [1]
        infos = [info for b in batches for info in b.trajectories()]
        # The stand-in answers every choice alike, so the continuation goes after the latest of the
        # identical replies (choice 2): leaves are choices 0 and 1 and turn 3.
        assert [i["sample"]["turn"] for i in infos] == [0, 1, 3]
        assert infos[2]["sample"]["path"] == [2, 3]
        tensors = to_torch(batches)
        assert tensors["group_ids"].tolist() == [0, 0, 1]
        assert tensors["rewards"][0].item() == 0.5 and tensors["rewards"][1].isnan()
        assert tensors["loss_mask"][2].sum().item() == 8  # choice 1's output and turn 3's
        assert tensors["loss_mask"][0].sum().item() == 4
        assert client.ack(batches) == {b.batch_id: True for b in batches}


class FirstConnectTimesOut(httpx.BaseTransport):
    """A real transport whose first connection times out, as one to a replaced pod's old address
    does while the per-pod DNS name still resolves to it."""

    def __init__(self) -> None:
        self.real = httpx.HTTPTransport()
        self.refused: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self.refused:
            self.refused.append(str(request.url))
            raise httpx.ConnectTimeout("timed out", request=request)
        return self.real.handle_request(request)

    def close(self) -> None:
        self.real.close()


def test_an_export_whose_connection_timed_out_is_sent_again(fleet):
    """Nothing reached the proxy, so building the batch again is safe (a lost answer is not)."""
    sid, _ = play_session(fleet[0])
    transport = FirstConnectTimesOut()
    with (
        httpx.Client(transport=transport) as http,
        TrainerClient([fleet[0].url], ADMIN_KEY, client=http, backoff=Backoff(initial_s=0.01)) as client,
    ):
        batch = client.export_from(fleet[0].url, session_ids=[sid])
        assert transport.refused == [f"{fleet[0].url}/v1/exports"]
        assert batch is not None and [t["session_id"] for t in batch.trajectories()] == [sid]
        client.ack([batch])
