"""Sessions driven on real proxies (by the e2e tests and the demo), with every turn a client got a
200 for: the ledger that "no delivered turn lost" is counted against. A turn is checked byte for
byte: the output logprobs the client received must be the ones the proxy holds for that turn after
any restart."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import httpx

WORDS = [f"w{i}" for i in range(5000)]


@dataclass
class LedgerSession:
    session_id: str
    key: str
    messages: list[dict] = field(default_factory=list)
    delivered: list[list[float]] = field(default_factory=list)  # each delivered turn's output logprobs

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Losses:
    sessions: int = 0
    turns: int = 0
    checked_turns: int = 0

    def counts(self) -> tuple[int, int]:
        return self.sessions, self.turns


class SessionLedger:
    def __init__(self, admin_key: str, seed: int = 7):
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.sessions: dict[str, list[LedgerSession]] = {}  # by the proxy pod that owns them
        self.random = random.Random(seed)

    def try_create(self, proxy: str, url: str) -> LedgerSession | None:
        """A new session on `proxy`, or None if it refused one (e.g. 503 memory_pressure)."""
        try:
            created = httpx.post(f"{url}/v1/sessions", headers=self.admin, json={}, timeout=30)
        except httpx.HTTPError:
            return None
        if created.status_code != 201:
            return None
        body = created.json()
        session = LedgerSession(body["session_id"], body["session_key"])
        self.sessions.setdefault(proxy, []).append(session)
        return session

    def create(self, proxy: str, url: str) -> LedgerSession:
        session = self.try_create(proxy, url)
        assert session is not None, f"{proxy} at {url} refused a new session"
        return session

    def try_turn(self, url: str, session: LedgerSession, words: int, timeout_s: float = 120) -> bool:
        """One turn of `words` random words; True if delivered (200: then it is in the ledger). A turn
        that fails (the proxy died or is draining) leaves the ledger and the history as they were."""
        content = " ".join(self.random.choices(WORDS, k=words))
        messages = [*session.messages, {"role": "user", "content": content}]
        try:
            reply = httpx.post(
                f"{url}/v1/sessions/{session.session_id}/chat/completions",
                headers=session.auth,
                json={"messages": messages, "max_tokens": 8, "logprobs": True},
                timeout=timeout_s,
            )
        except httpx.HTTPError:
            return False
        if reply.status_code != 200:
            return False
        choice = reply.json()["choices"][0]
        session.messages = [*messages, {"role": "assistant", "content": choice["message"]["content"]}]
        session.delivered.append([entry["logprob"] for entry in choice["logprobs"]["content"]])
        return True

    def turn(self, url: str, session: LedgerSession, words: int) -> None:
        assert self.try_turn(url, session, words), f"turn of {session.session_id} at {url} not delivered"

    def delivered_turns(self) -> int:
        return sum(len(s.delivered) for sessions in self.sessions.values() for s in sessions)

    def check(self, current_urls: dict[str, str]) -> Losses:
        """Sessions and delivered turns missing or different on the proxies that hold them now."""
        losses = Losses()
        for proxy, sessions in self.sessions.items():
            for session in sessions:
                answer = httpx.get(
                    f"{current_urls[proxy]}/v1/sessions/{session.session_id}",
                    params={"tokens": "true"},
                    headers=session.auth,
                    timeout=30,
                )
                if answer.status_code != 200:
                    losses.sessions += 1
                    losses.turns += len(session.delivered)
                    continue
                trajectory = answer.json()["trajectory"]
                for index, logprobs in enumerate(session.delivered):
                    losses.checked_turns += 1
                    if index >= len(trajectory["turns"]):
                        losses.turns += 1
                        continue
                    _, output_start, end = trajectory["turns"][index]
                    if trajectory["logprobs"][output_start:end] != logprobs:
                        losses.turns += 1
        return losses
