"""Reference ids for model-family conversations, computed independently of the proxy's method: the
template's own rendering of the real conversation, with the model's output ids kept as generated.
Shared by the tests that drive the proxy with real vocabularies and templates."""

from __future__ import annotations

import json

SENTINEL = "rolloutfleetreferencesentinel"


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as a template receives them: None fields dropped, tool-call arguments as objects."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
        out.append(message)
    return out


def span_after_reply(
    tokenizer,
    family,
    messages: list[dict],
    reply_index: int,
    tools,
    stop_text: str,
    stopped: bool = True,
    next_reply: int | None = None,
) -> list[int]:
    """What the template renders after the model's reply at `reply_index` in the real conversation
    `messages`, up to the next reply (`next_reply`, by default the next assistant message) or the
    generation prompt, minus the closing the model wrote itself (`stop_text`, its last token, unless
    the reply was cut off without a stop token: not `stopped`)."""
    messages = template_messages(messages)
    following = next_reply or next(
        (i for i in range(reply_index + 1, len(messages)) if messages[i]["role"] == "assistant"),
        len(messages),
    )
    reply = messages[reply_index]
    # The sentinel goes where the template renders the reply last: into its last tool call's
    # arguments when it has calls (Llama 3.1 renders no content beside a call), else its content.
    if reply.get("tool_calls"):
        calls = reply["tool_calls"]
        last_call = {**calls[-1], "function": {**calls[-1]["function"], "arguments": {"s": SENTINEL}}}
        reply = {**reply, "tool_calls": [*calls[:-1], last_call]}
    else:
        reply = {**reply, "content": SENTINEL}
    marked = [*messages[:reply_index], reply, *messages[reply_index + 1 : following]]
    text = tokenizer.apply_chat_template(marked, tools=tools, tokenize=False, add_generation_prompt=True)
    after = text[text.index(SENTINEL) + len(SENTINEL) :]
    # The template's own rendering of the reply's tool calls comes before its closing text.
    end = family.call_end if reply.get("tool_calls") and family.call_end else family.assistant_end
    if end:
        tail = after[after.index(end) + len(end) :]
        # The model's stop token stands in for the template's closing token (gpt-oss's <|return|> for
        # the <|end|> the template writes mid-conversation); the rest of the closing follows it.
        closer = tokenizer.convert_ids_to_tokens(tokenizer.encode(end, add_special_tokens=False)[0])
        if stopped:
            assert stop_text in (closer, tokenizer.eos_token, *family.stop_tokens)
            span = end[len(closer) :] + tail
        else:  # cut off: the whole closing
            span = end + tail
    else:  # no closing text: the model's stop token is the next message's opener (GLM-4.5)
        assert stopped
        span = after[after.index(stop_text) + len(stop_text) :]
    return tokenizer.encode(span, add_special_tokens=False)
