"""Turning chat messages into the exact token ids the model sees, turn after turn.

The first turn renders the chat template over the messages. Later turns never re-render or
re-tokenize history: the stored ids (including the model's own output ids) stay as they were, and
only the tokens that close the last assistant reply plus the new messages are appended. Those are
found by rendering the new messages after a fixed probe exchange and taking the text after it.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from typing import Any

_PROBE_USER = "rolloutfleet probe question"
_PROBE_ASSISTANT = "rolloutfleet probe answer"
_PROBE = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]


class TemplateError(ValueError):
    """The chat template cannot be applied incrementally to these messages."""


class TurnTokenizer:
    def __init__(self, tokenizer: Any):
        self._hf = tokenizer
        self._backend = tokenizer.backend_tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")
        probe_text = self.render(_PROBE, add_generation_prompt=False)
        end = probe_text.find(_PROBE_ASSISTANT)
        if end < 0:
            raise TemplateError("the chat template does not render assistant content verbatim")
        self._probe_text = probe_text
        # What the template puts after an assistant reply, e.g. "<|im_end|>\n".
        self.assistant_close = probe_text[end + len(_PROBE_ASSISTANT) :]
        self.eos_token_id: int | None = tokenizer.eos_token_id

    @classmethod
    def from_path(cls, path: str) -> TurnTokenizer:
        # The proxy runs without torch; transformers would print an advisory about it on stderr.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from transformers import AutoTokenizer  # heavy import, only where a tokenizer is loaded

        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True))

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> array:
        return array("i", self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (not the vocabulary piece, e.g. "Ġword" in byte-level BPE)."""
        return [self._backend.decode([i], skip_special_tokens=False) for i in ids]

    def first_turn_ids(self, messages: Sequence[dict[str, Any]]) -> array:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation_ids(self, new_messages: Sequence[dict[str, Any]], last_stop_token: int | None) -> array:
        """Ids that follow a recorded assistant reply: its closing tokens, then the new messages."""
        full = self.render([*_PROBE, *new_messages], add_generation_prompt=True)
        if not full.startswith(self._probe_text):
            raise TemplateError(
                "the chat template renders earlier turns differently once new messages follow"
            )
        return self.encode(self.closing_text(last_stop_token) + full[len(self._probe_text) :])

    def closing_text(self, last_stop_token: int | None) -> str:
        """The part of the template's assistant closing that the model did not generate itself."""
        if last_stop_token is None:
            return self.assistant_close
        stop_text = self._backend.decode([last_stop_token], skip_special_tokens=False)
        if stop_text and self.assistant_close.startswith(stop_text):
            return self.assistant_close[len(stop_text) :]
        return self.assistant_close
