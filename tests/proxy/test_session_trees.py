"""Sessions as trees, through the official openai client, with the real vocabularies and chat templates
of four families (Qwen3 thinking, DeepSeek-R1, Llama 3.1, gpt-oss): compaction, retries, branches off an
earlier turn, sub-agents with their own tools.

The upstream is the scripted stand-in (`rolloutfleet_testkit.scripted_upstream`; no model here writes
these families' formats). Every prompt the proxy sends is compared with a reference computed here,
independently of the proxy: the model's own output ids as generated, and for every other span what
the family's template renders in that branch's real conversation (`reference_ids`).
"""

from __future__ import annotations

import json

import httpx
import pytest
from family_reference import span_after_reply, template_messages
from openai import OpenAI
from proxy_harness import ADMIN, ADMIN_KEY, running_proxy
from rolloutfleet_client.trainer import TrainerClient
from rolloutfleet_testkit.model_families import FAMILIES, ModelFamily
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream
from transformers import AutoTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
SUB_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful research agent."}


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1", "llama31", "gpt_oss"])
def family(request) -> ModelFamily:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def family_tokenizer(family):
    directory = family.build_cached()
    return directory, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def reference_ids(tokenizer, family, messages: list[dict], outputs: dict[int, list[int]], tools) -> list[int]:
    """The ids of a branch's whole conversation up to its generation prompt: the template's first
    prompt, then each reply's own output ids and what the template renders after it. `outputs` maps
    the index of each assistant message to the ids the model generated for it."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant") if outputs else len(messages)
    ids = tokenizer.apply_chat_template(
        template_messages(messages[:first]), tools=tools, tokenize=True, add_generation_prompt=True
    )["input_ids"]
    for index in sorted(outputs):
        ids += outputs[index]
        stop_text = tokenizer.convert_ids_to_tokens(outputs[index][-1])
        ids += span_after_reply(tokenizer, family, messages, index, tools, stop_text)
    return ids


class Agent:
    """Drives one session with the openai client and keeps, per assistant message it received, the
    output ids the scripted model generated for it (by the message's content, which is unique here)."""

    def __init__(self, proxy, upstream, tokenizer, family):
        self.proxy, self.upstream, self.tokenizer, self.family = proxy, upstream, tokenizer, family
        self.sid, self.key = proxy.create_session()
        self.base_url = f"{proxy.url}/v1/sessions/{self.sid}"
        self.client = OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0)
        self.generated: dict[str, list[int]] = {}
        self.recorded: dict[int, tuple[list[int], list[int]]] = {}  # turn id -> (prompt, output ids)

    def reply_ids(self, content: str, reasoning: str | None = None, calls=()) -> list[int]:
        thinks = self.family.reasoning_parser is not None
        text = self.family.model_reply_text(reasoning if thinks else None, content, calls)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def outputs_of(self, messages: list[dict]) -> dict[int, list[int]]:
        return {i: self.generated[self._key(m)] for i, m in enumerate(messages) if m["role"] == "assistant"}

    @staticmethod
    def _key(message: dict) -> str:
        return message.get("content") or json.dumps(message.get("tool_calls"), sort_keys=True)

    def turn(self, messages: list[dict], content: str, calls=(), tools=TOOLS, **extra) -> dict:
        """One turn; checks the prompt sent upstream against the reference; returns the assistant
        message as the client would send it back."""
        output_ids = self.reply_ids(content, f"Thinking about: {content[:20]}", calls)
        self.upstream.script(output_ids)
        before = len(self.upstream.prompts)
        response = self.client.chat.completions.create(
            model="m", messages=messages, tools=tools, max_tokens=256, temperature=1.0, **extra
        )
        assert len(self.upstream.prompts) == before + 1, "one engine call per new turn"
        expected = reference_ids(self.tokenizer, self.family, messages, self.outputs_of(messages), tools)
        assert self.upstream.prompts[-1] == expected, "the prompt sent upstream differs from the reference"
        message = response.choices[0].message.model_dump(exclude_none=True)
        self.generated[self._key(message)] = output_ids
        self.recorded[response.model_extra["rolloutfleet"]["turn"]] = (expected, output_ids)
        return message

    def export(self, samples: str, drop_replaced: bool = False) -> list[dict]:
        assert httpx.post(
            f"{self.base_url}/finish", headers={"Authorization": f"Bearer {self.key}"}
        ).is_success
        with TrainerClient(self.proxy.url, ADMIN_KEY) as trainer:
            batch = trainer.export_from(
                self.proxy.url, session_ids=[self.sid], samples=samples, drop_replaced=drop_replaced
            )
            assert batch is not None
            trainer.ack([batch])
            return [batch.decoded.trajectory(i) for i in range(batch.num_trajectories)]

    def check_sample(self, sample: dict, only_turn: bool) -> None:
        """A sample equals the reference: the turn's prompt (checked against the template when it
        was sent) and its output ids; loss mask 1 on the outputs of the turns on its path."""
        turn = sample["sample"]["turn"]
        prompt, output = self.recorded[turn]
        assert sample["input_ids"] == prompt + output
        trained = [output] if only_turn else [self.recorded[t][1] for t in sample["sample"]["path"]]
        assert sum(sample["loss_mask"]) == sum(len(o) for o in trained)
        assert sample["loss_mask"][-len(output) :] == [1] * len(output)

    def summary(self) -> dict:
        return self.proxy.get(self.sid, self.key, tokens=True).json()


@pytest.fixture
def stand(family, family_tokenizer, tmp_path):
    directory, tokenizer = family_tokenizer
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
    upstream = ScriptedUpstream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop_ids)
    with (
        serve_app(upstream) as upstream_url,
        running_proxy(
            upstream_url,
            directory,
            tmp_path / "dumps",
            tool_call_parser=family.tool_call_parser,
            reasoning_parser=family.reasoning_parser,
        ) as proxy,
    ):
        yield Agent(proxy, upstream, tokenizer, family)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_compaction_branches_at_the_system_prompt_and_at_the_root(stand):
    history = [SYSTEM, user("Find the population of Lyon.")]
    for step in range(3):
        history.append(stand.turn(history, f"Step {step}: still searching for Lyon."))
        history.append(user(f"Continue, step {step + 1}."))
    # The agent compacts: a summary replaces everything but the system prompt.
    compacted = [SYSTEM, user("Summary so far: three searches, nothing found. Continue.")]
    compacted.append(stand.turn(compacted, "After compaction: Lyon has 520k people."))
    # A compaction that keeps nothing branches at the root.
    bare = [user("Summary: Lyon, population wanted, 520k found. Confirm.")]
    bare.append(stand.turn(bare, "Confirmed: about 520k."))
    # Every branch goes on: the compacted one, the bare one, and the original.
    compacted.append(user("Is that the metropolitan area?"))
    stand.turn(compacted, "No, the city proper.")
    bare.append(user("Source?"))
    stand.turn(bare, "INSEE, 2021.")
    history.pop()
    history.append(user("Give up and answer from memory."))
    stand.turn(history, "From memory: around half a million.")
    session = stand.summary()
    assert session["num_branches"] == 3
    assert session["num_turns"] == 8
    leaves = stand.export("leaves")
    assert len(leaves) == 3
    for sample in leaves:
        stand.check_sample(sample, only_turn=False)


def test_a_retried_request_gets_the_recorded_reply_without_the_engine(stand):
    history = [SYSTEM, user("What is the capital of Peru?")]
    history.append(stand.turn(history, "Lima."))
    history.append(user("And its population?"))
    body = {"model": "m", "messages": history, "tools": TOOLS, "max_tokens": 256, "temperature": 1.0}
    headers = {"Authorization": f"Bearer {stand.key}"}
    url = f"{stand.base_url}/chat/completions"
    stand.upstream.script(stand.reply_ids("About ten million.", "Peru's capital population"))
    first = httpx.post(url, json=body, headers=headers)
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    calls = len(stand.upstream.prompts)
    # The client never got that answer and sends the same request again: same bytes, no engine call.
    again = httpx.post(url, json=body, headers=headers)
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert len(stand.upstream.prompts) == calls
    # The same through the official client, streaming: the same reply.
    stream = stand.client.chat.completions.create(**{**body, "stream": True})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == first.json()["choices"][0]["message"]["content"]
    assert len(stand.upstream.prompts) == calls
    # An explicit new sample records a sibling; a plain retry now replays that newer sample.
    stand.upstream.script(stand.reply_ids("Roughly 10.1 million.", "again"))
    regenerated = httpx.post(url, json={**body, "regenerate": True}, headers=headers)
    assert regenerated.status_code == 200
    assert regenerated.json()["choices"][0]["message"]["content"].strip() == "Roughly 10.1 million."
    assert len(stand.upstream.prompts) == calls + 1
    assert stand.upstream.prompts[-1] == stand.upstream.prompts[-2]  # the same prompt, a new sample
    retried = httpx.post(url, json=body, headers=headers)
    assert retried.content == regenerated.content
    session = stand.summary()
    assert session["num_turns"] == 3 and session["num_branches"] == 2
    # Per turn, every turn is a sample; without the replaced call, the first sample of it is gone.
    turns = stand.export("turns", drop_replaced=True)
    assert [s["sample"]["turn"] for s in turns] == [0, 2]
    assert turns[1]["sample"]["path"] == [0, 2] and turns[1]["sample"]["parent"] == 1
    assert turns[1]["input_ids"][: len(stand.upstream.prompts[-1])] == stand.upstream.prompts[-1]
    assert sum(turns[1]["loss_mask"]) == len(turns[1]["input_ids"]) - len(stand.upstream.prompts[-1])


def test_idempotency_keys_name_one_request(stand):
    history = [SYSTEM, user("Name a prime above 100.")]
    headers = {"Authorization": f"Bearer {stand.key}", "Idempotency-Key": "rollout-7-turn-0"}
    body = {"model": "m", "messages": history, "max_tokens": 64}
    url = f"{stand.base_url}/chat/completions"
    stand.upstream.script(stand.reply_ids("101.", "prime"))
    first = httpx.post(url, json=body, headers=headers)
    assert first.status_code == 200
    again = httpx.post(url, json=body, headers=headers)
    assert again.content == first.content and again.headers["Idempotent-Replayed"] == "true"
    other = httpx.post(url, json={**body, "max_tokens": 65}, headers=headers)
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    # The key wins over regenerate: the same request under the same key is answered once.
    again = httpx.post(url, json={**body, "regenerate": True}, headers=headers)
    assert again.content == first.content
    assert stand.summary()["num_turns"] == 1


def test_a_branch_off_turn_2_of_5_then_back_to_the_first_branch(stand):
    history = [SYSTEM, user("Plan a trip: day 1.")]
    for day in range(1, 6):
        history.append(stand.turn(history, f"Day {day}: museum number {day}."))
        history.append(user(f"Day {day + 1}?"))
    history.pop()
    # Back to turn 2 (the reply for day 2), and ask something else there.
    fork = history[:5]  # system, day 1, its reply, day 2, its reply
    assert fork[-1]["role"] == "assistant" and fork[-1]["content"].startswith("Day 2")
    fork.append(user("Actually, make day 3 a beach day."))
    fork.append(stand.turn(fork, "Day 3: the beach at Cassis."))
    fork.append(user("And day 4?"))
    stand.turn(fork, "Day 4: calanques hike.")
    # The first branch goes on as if nothing happened.
    history.append(user("Day 6?"))
    stand.turn(history, "Day 6: rest.")
    session = stand.summary()
    assert session["num_turns"] == 8 and session["num_branches"] == 2
    assert session["trajectory"]["path"] == [0, 1, 2, 3, 4, 7]
    leaves = stand.export("leaves")
    assert [s["sample"]["turn"] for s in leaves] == [6, 7]
    assert leaves[0]["sample"]["path"] == [0, 1, 5, 6]
    for sample in leaves:
        stand.check_sample(sample, only_turn=False)


def test_a_sub_agent_runs_as_its_own_branch_with_its_own_tools(stand):
    history = [SYSTEM, user("Summarise README.md in the repo.")]
    call = {"name": "search", "arguments": {"query": "README.md"}}
    history.append(stand.turn(history, "", calls=[(call["name"], call["arguments"])]))
    # A sub-agent: another system prompt, other tools, its own conversation in the same session.
    sub = [{"role": "system", "content": "You read files."}, user("Read README.md and summarise it.")]
    sub.append(stand.turn(sub, "", calls=[("read_file", {"path": "README.md"})], tools=SUB_TOOLS))
    sub.append({"role": "tool", "tool_call_id": sub[-1]["tool_calls"][0]["id"], "content": "# Demo\nA demo."})
    stand.turn(sub, "The README describes a demo.", tools=SUB_TOOLS)
    # The main agent gets the sub-agent's answer as its tool result and goes on.
    history.append({"role": "tool", "tool_call_id": history[-1]["tool_calls"][0]["id"], "content": "A demo."})
    stand.turn(history, "README.md describes a demo project.")
    session = stand.summary()
    assert session["num_turns"] == 4 and session["num_branches"] == 2
    for sample in stand.export("turns"):
        stand.check_sample(sample, only_turn=True)


def test_the_branch_limit_refuses_more_and_keeps_the_session(family, family_tokenizer, tmp_path):
    directory, tokenizer = family_tokenizer
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
    upstream = ScriptedUpstream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop_ids)
    with (
        serve_app(upstream) as upstream_url,
        running_proxy(upstream_url, directory, None, max_branches_per_session=2) as proxy,
    ):
        agent = Agent(proxy, upstream, tokenizer, family)
        first = [SYSTEM, user("One?")]
        first.append(agent.turn(first, "Answer to one.", tools=None))
        agent.turn([SYSTEM, user("Two?")], "Answer to two.", tools=None)
        before = agent.summary()
        refused = httpx.post(
            f"{agent.base_url}/chat/completions",
            json={"model": "m", "messages": [SYSTEM, user("Three?")]},
            headers={"Authorization": f"Bearer {agent.key}"},
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "too_many_branches"
        assert agent.summary() == before
        # Continuing an existing branch adds no branch: still allowed.
        agent.turn([*first, user("More?")], "More on one.", tools=None)
        assert agent.summary()["num_branches"] == 2
        assert httpx.get(f"{proxy.url}/v1/sessions", headers=ADMIN).status_code == 200


def test_a_group_of_four_then_choice_3_goes_on(stand):
    history = [SYSTEM, user("Write a haiku about rain.")]
    history.append(stand.turn(history, "Soft rain on the roof."))
    history.append(user("Four more, please."))
    contents = [f"Variant {i}: drops on leaves, take {i}." for i in range(4)]
    samples = [stand.reply_ids(c, f"variant {i}") for i, c in enumerate(contents)]
    stand.upstream.script(*samples)
    before = len(stand.upstream.prompts)
    body = {"model": "m", "messages": history, "tools": TOOLS, "max_tokens": 256, "temperature": 1.0, "n": 4}
    response = stand.client.chat.completions.create(**body)
    assert len(stand.upstream.prompts) == before + 4  # one engine call; the stand-in rules each sample
    expected = reference_ids(stand.tokenizer, stand.family, history, stand.outputs_of(history), TOOLS)
    assert stand.upstream.prompts[-1] == expected
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.message.content.strip() for c in response.choices] == contents
    turns = response.model_extra["rolloutfleet"]["turns"]
    assert turns == [1, 2, 3, 4]
    for turn, ids in zip(turns, samples, strict=True):
        stand.recorded[turn] = (expected, ids)
    # The whole group again (a retry): all four choices from the record.
    again = httpx.post(
        f"{stand.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {stand.key}"}
    )
    assert again.headers["Idempotent-Replayed"] == "true"
    assert [c["message"]["content"].strip() for c in again.json()["choices"]] == contents
    # Continue choice 3 (index 2): its message, then a new question.
    chosen = response.choices[2].message.model_dump(exclude_none=True)
    stand.generated[stand._key(chosen)] = samples[2]
    follow = [*history, chosen, user("Translate it to French.")]
    stand.turn(follow, "Gouttes sur les feuilles.")
    session = stand.summary()
    assert session["num_turns"] == 6 and session["num_branches"] == 4
    assert session["trajectory"]["path"] == [0, 3, 5]
    # Stored once: the prompt up to the group and the group's prompt, each sample's output, then
    # only what turn 5 added after choice 3.
    prompt5, output5 = stand.recorded[5]
    added_by_5 = len(prompt5) - len(expected) - len(samples[2]) + len(output5)
    assert session["num_tokens"] == len(expected) + sum(len(ids) for ids in samples) + added_by_5
    leaves = stand.export("leaves")
    assert [s["sample"]["turn"] for s in leaves] == [1, 2, 4, 5]
    assert {s["sample"]["call"] for s in leaves[:3]} == {1}  # one group: one call
    for sample in leaves:
        stand.check_sample(sample, only_turn=False)


def test_a_resent_regeneration_under_its_key_is_sampled_once(stand):
    history = [SYSTEM, user("Pick a colour.")]
    body = {"model": "m", "messages": history, "max_tokens": 32}
    url = f"{stand.base_url}/chat/completions"
    auth = {"Authorization": f"Bearer {stand.key}"}
    stand.upstream.script(stand.reply_ids("Blue."), stand.reply_ids("Green."))
    first = httpx.post(url, json=body, headers={**auth, "Idempotency-Key": "a"})
    # The same request under a new key is still the same request: answered from the record.
    same = httpx.post(url, json=body, headers={**auth, "Idempotency-Key": "b"})
    assert same.content == first.content and same.headers["Idempotent-Replayed"] == "true"
    again = {**body, "regenerate": True}
    regenerated = httpx.post(url, json=again, headers={**auth, "Idempotency-Key": "c"})
    assert regenerated.json()["choices"][0]["message"]["content"].strip() == "Green."
    resent = httpx.post(url, json=again, headers={**auth, "Idempotency-Key": "c"})
    assert resent.content == regenerated.content and resent.headers["Idempotent-Replayed"] == "true"
    assert stand.summary()["num_turns"] == 2
