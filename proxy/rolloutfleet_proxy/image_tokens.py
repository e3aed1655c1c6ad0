"""Image placeholders in token ids: one per image on the wire, a run per image in the record (pure).

A chat template writes one placeholder token per image (Qwen-VL's `<|image_pad|>` between
`<|vision_start|>` and `<|vision_end|>`). SGLang, given `input_ids` and `image_data`, requires
exactly one placeholder per image and expands each to that image's token count
(`_expand_input_ids`, on by default since SGLang's PR #26555). The session records the expanded ids
(what the model saw, what logprobs and M-RoPE positions refer to); every request sends them
collapsed back to one placeholder per image, with every image of the prompt in order.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from rolloutfleet_wire.session_record import ImageSpan


def placeholder_offsets(ids: Sequence[int], image_token_id: int) -> list[int]:
    """Where the single placeholders are, in order."""
    return [i for i, token in enumerate(ids) if token == image_token_id]


def expand(
    ids: array, image_token_id: int, images: Sequence[tuple[int, int, int, int, bytes]]
) -> tuple[array, list[ImageSpan]]:
    """Ids with one placeholder per image, each placeholder repeated to its image's token count;
    `images` are (tokens, t, h, w, digest) in order, one per placeholder (the caller checked the
    count). Returns the expanded ids and each image's span in them."""
    expanded = array("i")
    spans: list[ImageSpan] = []
    previous = 0
    for at, (tokens, t, h, w, digest) in zip(placeholder_offsets(ids, image_token_id), images, strict=True):
        expanded.extend(ids[previous:at])
        spans.append(ImageSpan(len(expanded), tokens, t, h, w, digest))
        expanded.extend(array("i", [image_token_id]) * tokens)
        previous = at + 1
    expanded.extend(ids[previous:])
    return expanded, spans


def collapse(ids: array, images: Sequence[ImageSpan]) -> array:
    """Expanded ids back to one placeholder per image (each run keeps its first token)."""
    if not images:
        return ids
    collapsed = array("i")
    previous = 0
    for image in images:
        collapsed.extend(ids[previous : image.offset + 1])
        previous = image.offset + image.tokens
    collapsed.extend(ids[previous:])
    return collapsed


def runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of placeholder tokens."""
    found: list[tuple[int, int]] = []
    start = -1
    for i, token in enumerate(ids):
        if token == image_token_id:
            if start < 0:
                start = i
        elif start >= 0:
            found.append((start, i - start))
            start = -1
    if start >= 0:
        found.append((start, len(ids) - start))
    return found


def expansion_problem(
    answered: Sequence[int],
    expected: array,
    images: Sequence[ImageSpan],
    recorded: int,
    image_token_id: int,
) -> str | None:
    """Why the engine's expanded prompt ids (`answered`) are not the expected ones, or None. The
    first `recorded` images were recorded on earlier turns (their counts may never change); the
    others' counts come from the model directory's image processor."""
    if len(answered) == len(expected) and array("i", answered) == expected:
        return None
    found = runs(answered, image_token_id)
    if len(found) != len(images):
        return (
            f"the engine's prompt ids hold {len(found)} image token runs for the prompt's {len(images)} "
            "images: it did not expand one placeholder per image"
        )
    for index, ((_, length), image) in enumerate(zip(found, images, strict=True)):
        if length == image.tokens:
            continue
        if index < recorded:
            return (
                f"the engine expanded image {index} (recorded on an earlier turn with {image.tokens} tokens) "
                f"to {length} tokens: an image's token count may not change across turns"
            )
        return (
            f"the engine expanded image {index} ({image.grid_t}x{image.grid_h}x{image.grid_w} patches) to "
            f"{length} tokens; the model directory's preprocessor_config.json gives {image.tokens}: the "
            "engine runs with another image processor configuration (its --mm-process-config, or another "
            "model)"
        )
    collapsed = collapse(array("i", answered), [ImageSpan(o, n, 1, 1, 1, b"") for o, n in found])
    sent = collapse(expected, images)
    if collapsed != sent:
        return "the engine's expanded prompt ids do not collapse back to the ids the proxy sent"
    return "the engine's expanded prompt ids differ from the expected ones"
