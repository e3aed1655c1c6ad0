"""A session's turns as a tree: paths, leaves, replaced calls, and linear samples (pure functions).

Every turn's own tokens (`turn_bounds[t]`: its new prompt tokens, then its output) are stored once,
back to back, in the record's flat arrays, in the order the turns were recorded. The tokens a turn
was generated after are the first `turn_keeps[t]` tokens of the path to its parent turn
(`turn_parents[t]`, ROOT for none), so shared prefixes are stored once:

    path(t) = path(parent(t))[:keep(t)] + own(t)

A linear session is the chain 0 <- 1 <- 2 ... with each keep the whole parent path. A branch off an
earlier reply keeps that reply's whole path; a branch inside a turn's prompt (a compaction that
kept the system prompt) keeps the tokens it shares with that prompt. The turns "on" a path are those
whose output lies wholly in it: their outputs are what a sample trains on.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .session_record import (
    DIGEST_BYTES,
    IMAGE_FIELDS,
    NO_DIGEST,
    ROOT,
    TURN_BOUND_FIELDS,
    VERSION_CHANGE_FIELDS,
    ImageSpan,
    SessionRecord,
    turn_finish,
)


def num_turns(record: SessionRecord) -> int:
    return len(record.turn_bounds) // TURN_BOUND_FIELDS


def bounds(record: SessionRecord, turn: int) -> tuple[int, int, int]:
    """(first own prompt token, first output token, end) of a turn in the flat arrays."""
    b = record.turn_bounds
    i = turn * TURN_BOUND_FIELDS
    return b[i], b[i + 1], b[i + 2]


def path_length(record: SessionRecord, turn: int) -> int:
    """Tokens on the path from the root to the end of `turn`'s output; 0 for ROOT."""
    if turn == ROOT:
        return 0
    start, _, end = bounds(record, turn)
    return record.turn_keeps[turn] + end - start


def output_length(record: SessionRecord, turn: int) -> int:
    _, output_start, end = bounds(record, turn)
    return end - output_start


def path_pieces(record: SessionRecord, turn: int) -> list[tuple[int, int]]:
    """The flat ranges whose concatenation is the path to the end of `turn`, root first."""
    pieces: list[tuple[int, int]] = []
    limit = path_length(record, turn)
    node = turn
    while node != ROOT and limit > 0:
        start, _, end = bounds(record, node)
        before = record.turn_keeps[node]  # path tokens before this node's own segment
        take = min(limit - before, end - start)
        if take > 0:
            pieces.append((start, start + take))
        limit = min(limit, before)
        node = record.turn_parents[node]
    pieces.reverse()
    return pieces


def path_turns(record: SessionRecord, turn: int) -> list[int]:
    """The turns whose whole output is on the path to `turn`, root first (`turn` last)."""
    turns: list[int] = []
    limit = path_length(record, turn)
    node = turn
    while node != ROOT:
        if path_length(record, node) <= limit:
            turns.append(node)
        limit = min(limit, record.turn_keeps[node])
        node = record.turn_parents[node]
    turns.reverse()
    return turns


def gather(values: array, pieces: list[tuple[int, int]]) -> array:
    out = array(values.typecode)
    for start, stop in pieces:
        out.extend(values[start:stop])
    return out


def path_ids(record: SessionRecord, turn: int) -> array:
    return gather(record.token_ids, path_pieces(record, turn))


def path_images(record: SessionRecord, turn: int) -> list[ImageSpan]:
    """The images on the path to the end of `turn`, in path order, their offsets in path coordinates
    (what the engine is sent with the path's ids: every image of the prompt, in order)."""
    spans = record.image_spans
    count = len(spans) // IMAGE_FIELDS
    if not count or turn == ROOT:
        return []
    offsets = [spans[i * IMAGE_FIELDS] for i in range(count)]  # ascending: recording order
    found: list[ImageSpan] = []
    position = 0
    for start, stop in path_pieces(record, turn):
        for i in range(bisect.bisect_left(offsets, start), bisect.bisect_left(offsets, stop)):
            at = i * IMAGE_FIELDS
            _, tokens, grid_t, grid_h, grid_w = spans[at : at + IMAGE_FIELDS]
            digest = digest_at(record.image_digests, i)
            found.append(ImageSpan(position + offsets[i] - start, tokens, grid_t, grid_h, grid_w, digest))
        position += stop - start
    return found


def image_digests_of(record: SessionRecord) -> set[bytes]:
    """The distinct images a record's prompts hold (what keeps their files on disk)."""
    digests = record.image_digests
    return {digests[i : i + DIGEST_BYTES].tobytes() for i in range(0, len(digests), DIGEST_BYTES)}


def digest_at(digests: array, turn: int) -> bytes:
    return digests[turn * DIGEST_BYTES : (turn + 1) * DIGEST_BYTES].tobytes()


def continued(record: SessionRecord) -> list[bool]:
    """Per turn: does a later turn continue after its reply (keeping its whole path). A turn that
    only shares part of its prompt (a regeneration, a sibling sample) does not continue it."""
    flags = [False] * num_turns(record)
    for turn, parent in enumerate(record.turn_parents):
        if parent != ROOT and record.turn_keeps[turn] == path_length(record, parent):
            flags[parent] = True
    return flags


def leaves(record: SessionRecord) -> list[int]:
    """Turns nothing continues after: one per branch, in recording order."""
    return [t for t, is_continued in enumerate(continued(record)) if not is_continued]


def calls(record: SessionRecord) -> dict[int, list[int]]:
    """Each call (a request that recorded turns) and its turns, by its first turn."""
    grouped: dict[int, list[int]] = {}
    for turn, call in enumerate(record.turn_calls):
        grouped.setdefault(call, []).append(turn)
    return grouped


def replaced_calls(record: SessionRecord) -> set[int]:
    """Calls whose request was recorded again later (a regeneration asked for a new sample of the
    same request): the later call replaces them."""
    latest: dict[bytes, int] = {}
    replaced: set[int] = set()
    for call in calls(record):
        digest = digest_at(record.turn_request_digests, call)
        if digest == NO_DIGEST:
            continue
        if digest in latest:
            replaced.add(latest[digest])
        latest[digest] = call
    return replaced


def latest_call_of(record: SessionRecord, request_digest: bytes) -> int | None:
    """The latest call that answered this request, if any."""
    found = None
    for call in calls(record):
        if digest_at(record.turn_request_digests, call) == request_digest:
            found = call
    return found


def path_record(
    record: SessionRecord, turn: int, reward: float | None, only_turn_output: bool = False
) -> SessionRecord:
    """The path to `turn` as a linear record (what a sample exports): its tokens, loss mask 1 on the
    outputs of the turns on it (only `turn`'s with `only_turn_output`), their per-turn values, and
    turn bounds as a linear session of that conversation would have them."""
    pieces = path_pieces(record, turn)
    on_path = path_turns(record, turn)
    token_ids = gather(record.token_ids, pieces)
    logprobs = gather(record.logprobs, pieces)
    loss_mask = array("B", bytes(len(token_ids)))
    turn_bounds = array("i")
    version_changes = array("i")
    previous_end = 0
    for u in on_path:
        flat_output, flat_end = bounds(record, u)[1:]
        end = path_length(record, u)
        output_start = end - (flat_end - flat_output)
        turn_bounds.extend((previous_end, output_start, end))
        if u == turn or not only_turn_output:
            loss_mask[output_start:end] = array("B", b"\x01" * (end - output_start))
        else:
            logprobs[output_start:end] = array("f", bytes(4 * (end - output_start)))
        changes = record.version_changes
        for i in range(0, len(changes), VERSION_CHANGE_FIELDS):
            if flat_output <= changes[i] < flat_end:
                version_changes.extend((changes[i] - flat_output + output_start, changes[i + 1]))
        previous_end = end
    image_spans = array("i")
    image_digests = array("B")
    for image in path_images(record, turn):
        image_spans.extend((image.offset, image.tokens, image.grid_t, image.grid_h, image.grid_w))
        image_digests.frombytes(image.digest)
    rewards = record.turn_rewards or {}
    return SessionRecord(
        session_id=record.session_id,
        key_digest=record.key_digest,
        created_at=record.created_at,
        metadata=record.metadata,
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        turn_bounds=turn_bounds,
        turn_versions=array("i", (record.turn_versions[u] for u in on_path)),
        version_changes=version_changes,
        turn_temperatures=array("f", (record.turn_temperatures[u] for u in on_path)),
        turn_tempered=array("B", (record.turn_tempered[u] for u in on_path)),
        turn_rewards={i: rewards[u] for i, u in enumerate(on_path) if u in rewards},
        turn_finishes=array("B", (turn_finish(record, u) for u in on_path)),
        image_spans=image_spans,
        image_digests=image_digests,
        reward=reward,
        finished=record.finished,
    )


# --- samples: what an export makes of a session ---------------------------------------------------

SAMPLES_LATEST = "latest"  # one sample: the path to the latest turn (a linear session: all of it)
SAMPLES_LEAVES = "leaves"  # one sample per leaf
SAMPLES_TURNS = "turns"  # one sample per turn, loss mask on that turn's output only
SAMPLE_MODES = (SAMPLES_LATEST, SAMPLES_LEAVES, SAMPLES_TURNS)


@dataclass(frozen=True)
class SampleShape:
    """What an export makes of each session: `mode` (one of SAMPLE_MODES) and whether samples
    through a replaced call (one a regeneration asked for again) are left out."""

    mode: str = SAMPLES_LATEST
    drop_replaced: bool = False


def sample_reward(record: SessionRecord, turn: int) -> float | None:
    """A reward given for the turn, else the session's reward on its latest turn."""
    rewards = record.turn_rewards or {}
    if turn in rewards:
        return rewards[turn]
    return record.reward if turn == num_turns(record) - 1 else None


def sample_turns(record: SessionRecord, mode: str, drop_replaced: bool = False) -> list[int]:
    """The turns whose paths an export makes samples of."""
    total = num_turns(record)
    if mode == SAMPLES_LATEST:
        return [total - 1] if total else []
    chosen = leaves(record) if mode == SAMPLES_LEAVES else list(range(total))
    if not drop_replaced:
        return chosen
    replaced = replaced_calls(record)
    if not replaced:
        return chosen
    return [t for t in chosen if not any(record.turn_calls[u] in replaced for u in path_turns(record, t))]


def samples(record: SessionRecord, shape: SampleShape) -> Iterator[tuple[SessionRecord, dict[str, Any]]]:
    """Each sample of a session as (linear record, its place in the tree)."""
    mode = shape.mode
    for turn in sample_turns(record, mode, shape.drop_replaced):
        if mode == SAMPLES_LATEST:
            # Today's trajectory: the session reward, and every turn's reward.
            linear = path_record(record, turn, record.reward)
        else:
            linear = path_record(record, turn, sample_reward(record, turn), mode == SAMPLES_TURNS)
        yield (
            linear,
            {
                "turn": turn,
                "parent": record.turn_parents[turn],
                "call": record.turn_calls[turn],
                "path": path_turns(record, turn),
            },
        )


def shape_problem(record: SessionRecord) -> str | None:
    """What makes a record's tree impossible (a file altered or damaged), or None."""
    for turn in range(num_turns(record)):
        parent, keep, call = record.turn_parents[turn], record.turn_keeps[turn], record.turn_calls[turn]
        if not ROOT <= parent < turn:
            return f"turn {turn} continues turn {parent}, which is not before it"
        if not 0 <= keep <= path_length(record, parent):
            return f"turn {turn} keeps {keep} tokens of a path of {path_length(record, parent)}"
        if not 0 <= call <= turn:
            return f"turn {turn} names call {call}, which is not before it"
    return _image_problem(record)


def _image_problem(record: SessionRecord) -> str | None:
    """An image whose tokens do not lie inside one turn's own prompt tokens, in ascending order."""
    spans = record.image_spans
    if len(spans) % IMAGE_FIELDS or len(record.image_digests) != len(spans) // IMAGE_FIELDS * DIGEST_BYTES:
        return "the image spans and digests disagree in count"
    prompts = sorted(bounds(record, turn)[:2] for turn in range(num_turns(record)))
    starts = [start for start, _ in prompts]
    previous_end = 0
    for i in range(0, len(spans), IMAGE_FIELDS):
        offset, tokens = spans[i], spans[i + 1]
        holder = bisect.bisect_right(starts, offset) - 1
        if tokens < 1 or offset < previous_end or holder < 0 or offset + tokens > prompts[holder][1]:
            return f"image {i // IMAGE_FIELDS} ({tokens} tokens at {offset}) is not inside a turn's prompt"
        previous_end = offset + tokens
    return None
