"""The example rollout's tool mode: the calculator tool (untrusted expressions), the tool-using model
stand-in's rule, and the example run against a real proxy whose upstream calls the tool."""

from __future__ import annotations

import json

import pytest
from proxy_harness import ADMIN_KEY, running_proxy
from rolloutfleet_client.calculator import CalculatorError, evaluate, run_tool_call
from rolloutfleet_testkit.calculator_model import CalculatorModel
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app
from transformers import AutoTokenizer


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2 + 3", "5"), ("17 * 23", "391"), ("(1 + 2) * -3", "-9"), ("7 / 2", "3.5"), ("1 - 0.25", "0.75")],
)
def test_calculator_evaluates(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "2 ** 10", "x + 1", "1 / 0", "9" * 16 + " * 2", "1 +", "1" + " + 1" * 100, "[1]"],
)
def test_calculator_refuses(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_tool_call_answers_are_text():
    def call(name: str, arguments: str) -> dict:
        return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}

    assert run_tool_call(call("calculator", '{"expression": "40 + 2"}')) == "42"
    assert run_tool_call(call("calculator", "{oops")).startswith("error:")
    assert run_tool_call(call("calculator", '{"expr": "1"}')).startswith("error:")
    assert run_tool_call(call("search", "{}")) == "error: unknown tool 'search'"


def test_the_stand_in_calls_the_tool_then_answers_with_its_result(test_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    model = CalculatorModel(test_tokenizer_dir)
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    question = [{"role": "user", "content": "What is 12 + 30?"}]

    def reply(messages, with_tools=True) -> str | None:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools if with_tools else None, add_generation_prompt=True, tokenize=True
        )["input_ids"]
        out = model(ids)
        return None if out is None else tokenizer.decode(out, skip_special_tokens=False)

    assert reply(question, with_tools=False) is None
    call = reply(question)
    expected_call = {"name": "calculator", "arguments": {"expression": "12 + 30"}}
    assert call == f"<tool_call>\n{json.dumps(expected_call)}\n</tool_call><|im_end|>"
    called = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "12 + 30"}},
            }
        ],
    }
    history = [*question, called, {"role": "tool", "tool_call_id": "c", "content": "42"}]
    assert reply(history) == "The answer is 42.<|im_end|>"
    assert reply(
        [
            *history,
            {"role": "assistant", "content": "The answer is 42."},
            {"role": "user", "content": "Sure?"},
        ]
    ) == ("The answer is 42.<|im_end|>")


def test_the_example_rollout_with_tools(test_tokenizer_dir, tmp_path, monkeypatch, capsys):
    from rolloutfleet_client.rollout_example import main

    model = CalculatorModel(test_tokenizer_dir)
    stub = create_stub_app(0.0, 4, ruled=model.replies())
    with (
        serve_app(stub) as url,
        running_proxy(url, test_tokenizer_dir, tmp_path / "dumps", tool_call_parser="qwen25") as proxy,
    ):
        monkeypatch.setenv("ROLLOUTFLEET_PROXY_ADMIN_KEY", ADMIN_KEY)
        with pytest.raises(SystemExit) as exited:
            main(
                [
                    "--endpoints",
                    proxy.url,
                    "--sessions",
                    "4",
                    "--turns",
                    "3",
                    "--tools",
                    "--log-level",
                    "warning",
                ]
            )
        assert exited.value.code == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        # Turn 1 calls the calculator, turn 2 answers with its result, turn 3 repeats it.
        assert (summary["completed"], summary["turns"], summary["tool_calls"]) == (4, 12, 4)
        assert summary["mean_reward"] == 1.0
        assert summary["trajectories_exported"] == 4
