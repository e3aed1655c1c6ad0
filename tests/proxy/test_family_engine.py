"""gpt-oss and Kimi K2 sessions against the SGLang emulator: a tiny model over the family's vocabulary
(gpt-oss's real o200k_harmony, Kimi K2's rebuilt one), decoding as SGLang does, so replies end on the
tokenizer's EOS or at max_tokens, with whatever ids the model samples (special tokens included). The
families' parsers are on and every request offers tools; the agent also adds a tool call of its own and
its result, which the template must render after the call. The recorded prompt ids are compared with a
reference computed without the proxy's method: the template's rendering of the whole conversation with
each reply's generated ids in place of its text."""

from __future__ import annotations

import pytest
from family_reference import span_after_reply, template_messages
from proxy_harness import running_proxy
from rolloutfleet_testkit.model_families import FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.server import create_app as emulator_app
from transformers import AutoTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module", params=["gpt_oss", "kimi_k2"])
def family(request):
    family = FAMILIES[request.param]
    directory = family.build_cached()
    return family, directory, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def reference(
    tokenizer, family, messages: list[dict], replies: list[int], outputs: list[list[int]]
) -> list[int]:
    """The generation prompt after `messages` whose model replies (at indexes `replies`) are the ids it
    generated (`outputs`): the template's first prompt, then each reply's ids and what the template renders
    after it in the whole conversation (family_reference.py)."""
    ids = tokenizer.apply_chat_template(
        template_messages(messages[: replies[0]]), tools=[WEATHER], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    stop_ids = stop_ids_of(tokenizer, family)
    for index, (reply, output) in enumerate(zip(replies, outputs, strict=True)):
        ids += output
        following = replies[index + 1] if index + 1 < len(replies) else None
        stop_text = tokenizer.convert_ids_to_tokens(output[-1])
        stopped = output[-1] in stop_ids
        ids += span_after_reply(tokenizer, family, messages, reply, [WEATHER], stop_text, stopped, following)
    return ids


def stop_ids_of(tokenizer, family) -> set[int]:
    """The ids SGLang (and the proxy) end a reply on: generation_config.json's and the tokenizer's EOS."""
    return set(tokenizer.convert_tokens_to_ids(list(family.stop_tokens))) | {tokenizer.eos_token_id}


def test_a_session_with_sampled_replies_and_the_agents_own_call(family, tmp_path):
    family, directory, tokenizer = family
    call_id = "functions.get_weather:0"  # Kimi's form; any id does for gpt-oss
    with (
        serve_app(emulator_app(str(directory), seed=3)) as engine,
        running_proxy(
            engine,
            directory,
            tmp_path,
            tool_call_parser=family.tool_call_parser,
            reasoning_parser=family.reasoning_parser,
        ) as proxy,
    ):
        sid, key = proxy.create_session()

        def reply(messages: list[dict], max_tokens: int) -> dict:
            answer = proxy.chat_turn(
                sid, key, messages, tools=[WEATHER], max_tokens=max_tokens, temperature=0
            )
            return answer["choices"][0]["message"]

        messages = [
            {"role": "system", "content": "You plan trips. Use tools when useful."},
            {"role": "user", "content": "Plan a day in Lyon, s'il vous plaît."},
        ]
        messages.append(reply(messages, 200))
        messages.append({"role": "user", "content": "And what will the weather be? 天气"})
        messages.append(reply(messages, 6))
        # The agent calls the tool itself (a call the model did not make) and sends its result.
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"temp": 18, "sky": "clear"}'})
        messages.append(reply(messages, 200))
        messages.append({"role": "user", "content": "Thanks!"})
        reply(messages, 4)

        trajectory = proxy.get(sid, key).json()["trajectory"]
        ids = trajectory["input_ids"]
        outputs = [ids[output_start:end] for _, output_start, end in trajectory["turns"]]
        assert len(outputs) == 4
        replies = [2, 4, 7]  # the model's replies among the messages (the call at 5 is the agent's)
        assert ids[: trajectory["turns"][-1][1]] == reference(
            tokenizer, family, messages, replies, outputs[:3]
        )
        # Both ways a reply ends came up: on a stop token (which then closed it) and at max_tokens.
        stop_ids = stop_ids_of(tokenizer, family)
        ended_on_stop = [output[-1] in stop_ids for output in outputs]
        assert True in ended_on_stop and False in ended_on_stop, ended_on_stop
        assert trajectory["loss_mask"].count(1) == sum(len(output) for output in outputs)
