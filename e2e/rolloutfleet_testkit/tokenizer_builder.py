"""Build the test tokenizer: a TEST STAND-IN for the tokenizer of a real model served by SGLang.

A small byte-level BPE is trained locally on a built-in English corpus, so tests never download
anything from a model hub. Byte-level means any unicode text encodes and decodes losslessly, and
the ChatML special tokens and template match what Qwen2-style models use, so the proxy handles
the same token layout it meets in production.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import tempfile

# Bump whenever anything below changes the produced files; a directory built by another version
# is rebuilt instead of being reused.
BUILDER_VERSION = 2

VOCAB_SIZE = 1000
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML as Qwen2 renders it, without a default system prompt: a system message is rendered only
# when the conversation has one. Tools and tool calls are rendered hermes-style, as Qwen2.5 does
# (a tools block in the first system turn, `<tool_call>` JSON after the reply's content).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MARKER_NAME = "rolloutfleet_test_tokenizer.json"

# Written for this project: plain prose, dialogue, numbers and code-ish text, so common English
# words and punctuation become single tokens and replies decode to readable text.
CORPUS = """\
The morning was cold and clear. A light wind moved across the field, and the grass was still wet
from the rain that had fallen during the night. Anna walked to the station with her brother. They
talked about the weather, the train, and the long day that was waiting for them in the city.
"Do you think it will rain again?" he asked. "Maybe later," she said. "Take your coat anyway."

In the kitchen, the water in the pot began to boil. Add two cups of rice, a pinch of salt, and a
spoon of butter. Cover the pot, turn the heat down, and wait for twenty minutes. Do not lift the
lid while the rice is cooking. When it is ready, let it rest for five minutes before you serve it.
Good food takes time, and a little patience makes every meal better.

A computer follows instructions one step at a time. A program reads its input, keeps some state,
and writes its output. When the input is large, the program must be careful with memory: data
that is never released stays in the process until the process ends. Engineers measure memory,
look for leaks, and fix the code that holds on to things it no longer needs.

The server answered the request in less than a second. Each request carried a session id, a list
of messages, and a few settings for sampling: the temperature, the top p value, and the maximum
number of new tokens. The reply contained the text, the token ids, and the log probability of
every token. The trainer used those numbers to update the model after each batch of rollouts.

What is the capital of France? The capital of France is Paris. What is two plus three? Two plus
three is five. How many days are in a week? There are seven days in a week. Which planet is the
largest? Jupiter is the largest planet in our solar system. Can you help me write a short poem?
Of course. Here is a short poem about the sea, the sky, and the quiet light of the evening.

Numbers appear everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 32, 64, 100, 128, 256,
512, 1000, 1024, 2048, 4096. The year 2024 had 366 days. A meter has 100 centimeters, and a
kilometer has 1000 meters. Prices were 3.50, 12.99 and 100.00 dollars. The score was 21 to 17.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 1))

if value is None:
    raise ValueError("value must not be None")

The old library had tall windows and long wooden tables. Students came in the afternoon to read,
to write, and to think. The librarian knew every book by its color and its place on the shelf.
She liked to say that a good question is worth more than a quick answer, and that people learn
best when they are curious and not afraid to be wrong.

The team met every Monday to plan the week. First they looked at what had been done, then at
what was still open, and finally at what could go wrong. They wrote short notes, kept the list
small, and finished one thing before they started the next. Clear goals and honest reports made
the work go faster than long meetings ever could.

Thank you for your message. I am happy to help. Please tell me more about the problem you see,
what you expected to happen, and what happened instead. If there is an error message, copy it
here. I will read it carefully and suggest a few steps that should fix it. Have a nice day!

The river ran through the valley past the small town. In summer, children swam in the shallow
water near the bridge, and in winter the ice was thick enough to walk on. Farmers grew wheat and
apples on the hills, and on market days the square was full of voices, music, and fresh bread.
People said the town was quiet, but anyone who lived there knew that it was never really still.

Yes. No. Maybe. Hello! Goodbye. Please. Sorry, I do not know. Let me check. That is correct.
That is not right. Here is the answer: 42. Why? Because the rules say so. Where? Over there.
When? Tomorrow at nine. Who? The user, the assistant, and the system. Which one? The first one.
"""


def _train_tokenizer():
    """Train the byte-level BPE on CORPUS; the result depends on nothing but this module."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        # min_frequency=1 lets a few KB of text fill the vocabulary; it is a test tokenizer.
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token even if the corpus never shows it: that is what makes any
        # unicode text round-trip.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _wrap(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def _file_digests(directory: pathlib.Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MARKER_NAME
    }


def _is_complete(out_dir: pathlib.Path) -> bool:
    """True when out_dir holds an intact build of this BUILDER_VERSION (files as recorded)."""
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("builder_version") != BUILDER_VERSION:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, digest in files.items():
        try:
            if hashlib.sha256((out_dir / name).read_bytes()).hexdigest() != digest:
                return False
        except OSError:
            return False
    return True


def build_test_tokenizer(out_dir: str | os.PathLike) -> pathlib.Path:
    """Build the test tokenizer into out_dir (idempotent, deterministic) and return out_dir.

    The files are written to a scratch directory first and moved in one by one, with the marker
    that declares the build complete written last, so an interrupted build is never mistaken for
    a complete one.
    """
    out = pathlib.Path(out_dir)
    if _is_complete(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tokenizer-build-", dir=out) as scratch:
        scratch_dir = pathlib.Path(scratch)
        _wrap(_train_tokenizer()).save_pretrained(scratch_dir)
        files = _file_digests(scratch_dir)
        (out / MARKER_NAME).unlink(missing_ok=True)
        for name in files:
            os.replace(scratch_dir / name, out / name)
        marker = {"builder_version": BUILDER_VERSION, "files": files}
        (scratch_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(scratch_dir / MARKER_NAME, out / MARKER_NAME)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="rolloutfleet-build-test-tokenizer",
        description="Build the locally trained test tokenizer (a stand-in for a real model's tokenizer).",
    )
    parser.add_argument("out_dir", help="directory to write the tokenizer files into")
    args = parser.parse_args(argv)
    print(build_test_tokenizer(args.out_dir))
