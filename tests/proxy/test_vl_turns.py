"""Vision-language sessions through the proxy against the SGLang emulator (which takes images as
SGLang's Qwen-VL path does: one placeholder per image, expanded by the processor's grid), for
Qwen2.5-VL and Qwen3-VL model directories with Qwen's real vocabulary. The recorded expanded ids are
compared with an independent reference (tests/vl_reference.py: the template's rendering of the whole
conversation, tokenized, each placeholder expanded by transformers' image processor).
"""

from __future__ import annotations

import httpx
import pytest
from proxy_harness import bearer, chat_body, running_proxy
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.screenshots import image_part, screenshot
from rolloutfleet_testkit.sglang_emulator.server import create_app as emulator_app
from transformers import AutoTokenizer
from vl_reference import CLICK, conversation_prompt, expanded_prompt, image_processor


@pytest.fixture(scope="module", params=["qwen25_vl", "qwen3_vl"])
def family(request):
    directory = VL_FAMILIES[request.param].build_cached()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return directory, tokenizer, image_processor(directory)  # (also imports torch outside start-up)


def prompt_of(trajectory: dict) -> list[int]:
    """The recorded prompt of the path's last turn (everything before its output)."""
    return trajectory["input_ids"][: trajectory["turns"][-1][1]]


def outputs_of(trajectory: dict) -> list[list[int]]:
    """The model's output ids of each turn on the path, in order."""
    ids = trajectory["input_ids"]
    return [ids[output_start:end] for _, output_start, end in trajectory["turns"]]


def reference(
    tokenizer, processor, messages: list[dict], replies: list[int], outputs: list[list[int]], tools=(CLICK,)
):
    """The reference prompt (`vl_reference.conversation_prompt`) with the click tool offered."""
    return conversation_prompt(tokenizer, processor, messages, replies, outputs, list(tools) or None)


def test_a_screenshot_session_is_recorded_as_the_reference_expands_it(family, tmp_path):
    """Images in user and tool messages over four turns, a branch whose earlier screenshot changed,
    then a restart: the recorded prompt ids are the reference's, image tokens are masked out, each
    distinct image is one file."""
    directory, tokenizer, processor = family
    shots = [screenshot(640, 360, seed=i) for i in range(4)]
    call = {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x": 3}'}}

    def user(text: str, shot: bytes) -> dict:
        return {"role": "user", "content": [{"type": "text", "text": text}, image_part(shot)]}

    with (
        serve_app(emulator_app(str(directory), seed=0)) as engine,
        running_proxy(engine, directory, tmp_path, tool_call_parser="qwen25") as proxy,
    ):
        sid, key = proxy.create_session()
        url = f"{proxy.url}/v1/sessions/{sid}/chat/completions"

        def turn(messages: list[dict]) -> httpx.Response:
            body = chat_body(messages, tools=[CLICK], max_tokens=1, temperature=0)
            answer = httpx.post(url, headers=bearer(key), json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            return answer

        def reply(messages: list[dict]) -> dict:
            return turn(messages).json()["choices"][0]["message"]

        messages = [user("Open the menu.", shots[0])]
        messages.append(reply(messages))
        messages.append(user("Next?", shots[1]))
        messages.append(reply(messages))
        # The agent clicked (a call the proxy did not record: a branch after the second reply), and the
        # tool answers with the next screenshot, as computer-use agents do.
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": [image_part(shots[2])]})
        messages.append(reply(messages))
        data = proxy.get(sid, key).json()
        trajectory = data["trajectory"]
        expected = expanded_prompt(tokenizer, processor, messages[:-1], tools=[CLICK])
        assert data["num_turns"] == 3
        assert prompt_of(trajectory) == reference(
            tokenizer, processor, messages[:-1], [1, 3], outputs_of(trajectory)
        )
        assert [tuple(i["grid_thw"]) for i in trajectory["images"]] == expected.image_grid_thw
        assert [i["tokens"] for i in trajectory["images"]] == expected.image_token_counts
        mask = trajectory["loss_mask"]
        assert not any(mask[i["offset"] + k] for i in trajectory["images"] for k in range(i["tokens"]))

        # The first screenshot changed: another history, so a branch at the root with its own image.
        changed = [user("Open the menu.", shots[3])]
        turn(changed)
        data = proxy.get(sid, key).json()
        assert data["num_branches"] == 2
        assert (
            prompt_of(data["trajectory"])
            == expanded_prompt(tokenizer, processor, changed, tools=[CLICK]).input_ids
        )
        assert len(list((tmp_path / "images").iterdir())) == 4  # each distinct image once

    # After a restart the session is back with its images, and the branch with the tool result
    # continues in expanded ids.
    with (
        serve_app(emulator_app(str(directory), seed=0)) as engine,
        running_proxy(engine, directory, tmp_path, tool_call_parser="qwen25") as proxy,
    ):
        turn_after = [*messages, user("Done?", shots[0])]
        url = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
        turn(turn_after)
        trajectory = proxy.get(sid, key).json()["trajectory"]
        expected_ids = reference(tokenizer, processor, turn_after, [1, 3, 6], outputs_of(trajectory))
        assert prompt_of(trajectory) == expected_ids
        assert len(trajectory["images"]) == 4  # shots 0, 1, 2 and 0 again: a repeated image is a new span
        assert proxy.stats()["totals"]["images_deleted"] == 0


@pytest.mark.router
def test_behind_the_real_router_the_counts_stand_in_for_the_expanded_ids(tmp_path):
    """sglang-router 0.3.2 passes `image_data` but drops `return_prompt_token_ids`: the proxy then
    records its own expansion, checked against the engine's `meta_info.prompt_tokens`."""
    from rolloutfleet_testkit.routed_engines import routed_emulators

    directory = VL_FAMILIES["qwen25_vl"].build_cached()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    processor = image_processor(directory)
    shots = [screenshot(640, 360, seed=1), screenshot(1280, 720, seed=2)]
    with (
        routed_emulators(directory, tmp_path, count=1) as (router_url, _engines),
        running_proxy(router_url, directory, tmp_path / "dump") as proxy,
    ):
        sid, key = proxy.create_session()
        messages: list[dict] = []
        for text, shot in (("Look.", shots[0]), ("And now?", shots[1])):
            messages.append({"role": "user", "content": [{"type": "text", "text": text}, image_part(shot)]})
            answer = proxy.chat_turn(sid, key, messages, max_tokens=2, temperature=0)
            messages.append(answer["choices"][0]["message"])
        trajectory = proxy.get(sid, key).json()["trajectory"]
        assert [i["tokens"] for i in trajectory["images"]] == [299, 1196]
        outputs = outputs_of(trajectory)
        messages.pop()
        marked = reference(tokenizer, processor, messages, [1], outputs, tools=())
        assert prompt_of(trajectory) == marked
        assert answer["usage"]["prompt_tokens"] == len(marked)
