"""A TEST STAND-IN for a tool-using model behind SGLang, for rollouts that exercise tool turns.

No model here decides to call a tool, so this one follows a rule over the prompt it is sent, and
writes its replies as Qwen2.5/Qwen3 models do (hermes `<tool_call>` JSON, ended by `<|im_end|>`),
tokenized with the test tokenizer:
- a prompt without tools: None (the caller answers as it would without this stand-in);
- a user question "What is A + B?": a call of the calculator with the expression "A + B";
- a tool result: "The answer is R." with the result R;
- any other user message: "The answer is R." with the last tool result of the conversation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .upstream_stub import RuledReplies

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


class CalculatorModel:
    def __init__(self, tokenizer_dir: str | Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        self.stop_id = self._tokenizer.token_to_id(IM_END)

    def reply_text(self, prompt: str) -> str | None:
        if "<tools>" not in prompt:
            return None
        messages = [m.removesuffix("\n").removesuffix(IM_END) for m in prompt.split(IM_START)[1:]]
        role, _, content = messages[-2].partition("\n")  # the last one is the generation prompt
        question = QUESTION.search(content) if role == "user" else None
        if question:
            call = {"name": "calculator", "arguments": {"expression": f"{question[1]} + {question[2]}"}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>{IM_END}"
        results = [m.partition("\n")[2] for m in messages if m.startswith("tool\n")]
        return f"The answer is {results[-1].strip() if results else 'unknown'}.{IM_END}"

    def __call__(self, input_ids: list[int]) -> list[int] | None:
        text = self.reply_text(self._tokenizer.decode(input_ids, skip_special_tokens=False))
        return None if text is None else self._tokenizer.encode(text, add_special_tokens=False).ids

    def replies(self) -> RuledReplies:
        """For the upstream stub: this model's replies, stopping on `<|im_end|>`."""
        return RuledReplies(self, frozenset({self.stop_id}), lambda ids: self._tokenizer.decode(ids))
