"""gpt-oss replies (OpenAI's harmony format) split into their messages, from the decoded text (pure).

A reply is a run of messages, `<|start|>ROLE HEADER<|message|>BODY` closed by `<|end|>`, `<|call|>` or
`<|return|>`; the first one's `<|start|>assistant` is the generation prompt's, so the text starts at its
header (`<|channel|>analysis`). The header holds the channel (`analysis`, `commentary`, `final`), a
recipient (`to=functions.NAME`, before or after the channel) and a constraint (`<|constrain|>json`).
The stop token that ended the reply has been removed, so the last message may be unterminated.

Both the `gpt-oss` reasoning parser (analysis bodies are the reasoning) and tool-call parser (messages
with a recipient are calls) read replies through `harmony_messages`, as SGLang's detectors share its
`HarmonyParser`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MARKER = re.compile(r"<\|(start|channel|constrain|message|end|call|return)\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    start: int  # offset of the message's first marker in the text
    end: int = -1  # offset after its terminator (or the text's end)
    header_parts: list[str] = field(default_factory=list)  # role, channel, recipient, constraint
    channel: str | None = None
    body: str | None = None  # None: the header never reached <|message|>
    terminated: bool = False  # closed by <|end|>, <|call|> or <|return|>, not cut off by the text's end

    @property
    def recipient(self) -> str | None:
        """Whom the message is addressed to (`functions.get_weather`), None for the user."""
        found = _RECIPIENT.search(" ".join(self.header_parts))
        return None if found is None else found.group(1)


def is_harmony(text: str) -> bool:
    return MARKER.search(text) is not None


def harmony_messages(text: str) -> tuple[list[HarmonyMessage], list[str]]:
    """The messages in harmony text, and the stray text between them. Lenient as SGLang's parser: a
    message whose body is not closed ends where the next one starts (the model skipped <|end|>)."""
    messages: list[HarmonyMessage] = []
    stray: list[str] = []
    current: HarmonyMessage | None = None
    in_body = False
    at = 0
    for found in MARKER.finditer(text):
        following_start = found.end()
        next_found = MARKER.search(text, following_start)
        following = text[following_start : next_found.start() if next_found else len(text)]
        marker = found.group(1)
        if at == 0 and found.start() > 0:
            stray.append(text[: found.start()])
        at = found.end()
        if marker in ("end", "call", "return"):
            if current is not None:
                current.terminated = True
                current.end = found.end()
            current, in_body = None, False
            stray.append(following)
            continue
        if current is None or in_body or marker == "start":
            if current is not None:
                current.end = found.start()
            current, in_body = HarmonyMessage(found.start()), False
            messages.append(current)
        if marker == "message":
            current.body, in_body = following, True
            continue
        if marker == "channel":
            current.channel = following.split(None, 1)[0] if following.strip() else ""
        current.header_parts.append(following)
    if at == 0:
        stray.append(text)
    for message in messages:
        if message.end < 0:
            message.end = len(text)
    return messages, stray
