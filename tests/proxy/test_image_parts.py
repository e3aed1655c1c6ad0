"""Images in chat messages (issue 27): what is taken and refused, how images are named and recorded,
and the refusals over HTTP against a real vision-language model directory (Qwen2.5-VL's, from the
test kit: Qwen's real vocabulary, a template written for the tests, the family's
preprocessor_config.json). Refusals come before any engine call, so no engine is needed here; turns
with images against the SGLang emulator are in test_vl_turns.py.
"""

from __future__ import annotations

import base64
import hashlib
import io
from array import array

import httpx
import pytest
from proxy_harness import bearer, chat_body, running_proxy
from rolloutfleet_proxy.branching import attach
from rolloutfleet_proxy.history import (
    InvalidMessage,
    UnsupportedContent,
    canonical_message,
    extend_canonical_digest,
)
from rolloutfleet_proxy.image_tokens import collapse, expand, expansion_problem
from rolloutfleet_proxy.images import ImageRefused, ImageSource, decode_source, digest_of, inspect
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.storage import journal_records as records
from rolloutfleet_proxy.storage.dumps import encode_record, load_session_file
from rolloutfleet_testkit.model_families import FAMILIES, VL_FAMILIES
from rolloutfleet_testkit.screenshots import data_uri, image_part, screenshot
from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.session_record import ROOT, ImageSpan, image_spans
from vl_reference import image_processor

SID = "session-images-1"
PAD = 151655  # <|image_pad|>
START, END = 151652, 151653
FORMATS = frozenset({"png", "jpeg", "webp"})


def gif_bytes() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 20, 30)).save(out, format="GIF")
    return out.getvalue()


# --- decoding ---------------------------------------------------------------------------------------


def test_a_data_uri_and_bare_base64_give_the_same_bytes_and_name():
    png = screenshot(64, 48, seed=1)
    assert decode_source(data_uri(png), 1 << 20) == png
    assert decode_source(base64.b64encode(png).decode(), 1 << 20) == png
    info = inspect(png, digest_of(png), FORMATS)
    assert (info.format, info.width, info.height, info.size) == ("png", 64, 48, len(png))
    assert info.digest == hashlib.sha256(png).digest()


@pytest.mark.parametrize(
    ("url", "kind", "says"),
    [
        ("data:image/png;base64,@@@notbase64", "invalid", "not valid base64"),
        ("data:image/png,rawbytes", "invalid", "data:<media type>;base64"),
        ("data:video/mp4;base64,AAAA", "unsupported", "video"),
        ("file:///etc/passwd", "invalid", "file URLs are not taken"),
    ],
)
def test_undecodable_sources_are_refused_with_their_reason(url, kind, says):
    with pytest.raises(ImageRefused) as refused:
        decode_source(url, 1 << 20)
    assert refused.value.kind == kind and says in refused.value.message


def test_an_image_over_the_limit_is_refused_before_it_is_decoded():
    png = screenshot(64, 48, seed=1)
    with pytest.raises(ImageRefused) as refused:
        decode_source(data_uri(png), len(png) - 1)
    assert refused.value.kind == "too_large"


def test_formats_not_allowed_and_bytes_that_are_no_image_are_refused():
    with pytest.raises(ImageRefused, match="format gif is not taken"):
        inspect(gif_bytes(), b"x" * 32, FORMATS)
    broken = screenshot(64, 48, seed=1)[:200]  # a PNG cut short
    with pytest.raises(ImageRefused, match="could not be read"):
        inspect(broken, b"x" * 32, FORMATS)


def test_an_image_source_gives_its_text_once():
    source = ImageSource("abc")
    assert source.take() == "abc"
    with pytest.raises(RuntimeError):
        source.take()


# --- canonical messages -------------------------------------------------------------------------------


def resolved(message: dict, *images: bytes) -> dict:
    """The canonical message with its image parts named as the intake names them."""
    canonical = canonical_message(message)
    parts = [p for p in canonical["content"] if p["type"] == "image"]
    for part, data in zip(parts, images, strict=True):
        part["image"] = hashlib.sha256(data).hexdigest()
    return canonical


def test_image_parts_keep_their_place_among_the_text_and_are_digested_by_their_bytes():
    one, two = screenshot(64, 48, seed=1), screenshot(64, 48, seed=2)
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "a"},
            {"type": "text", "text": "b"},
            image_part(one, detail="low"),
        ],
    }
    canonical = resolved(message, one)
    assert canonical["content"] == [
        {"type": "text", "text": "ab"},
        {"type": "image", "image": digest_of(one).hex()},
    ]
    same = resolved({"role": "user", "content": [{"type": "text", "text": "ab"}, image_part(one)]}, one)
    changed = resolved({"role": "user", "content": [{"type": "text", "text": "ab"}, image_part(two)]}, two)
    digest = extend_canonical_digest(bytes(32), [canonical])
    assert extend_canonical_digest(bytes(32), [same]) == digest  # detail is not part of it
    assert extend_canonical_digest(bytes(32), [changed]) != digest  # another image: another history
    # Text-only parts stay a string, as before images (recorded digests do not change).
    assert canonical_message({"role": "user", "content": [{"type": "text", "text": "x"}]})["content"] == "x"


@pytest.mark.parametrize("kind", ["video_url", "input_audio", "file"])
def test_video_audio_and_file_parts_are_unsupported(kind):
    with pytest.raises(UnsupportedContent, match=f"{kind} parts are not supported"):
        canonical_message({"role": "user", "content": [{"type": kind, kind: {"url": "x"}}]})


def test_images_are_taken_in_user_and_tool_messages_only():
    part = image_part(screenshot(32, 32))
    canonical_message({"role": "tool", "tool_call_id": "c", "content": [part]})
    for role in ("system", "assistant"):
        with pytest.raises(InvalidMessage, match="user and tool messages only"):
            canonical_message({"role": role, "content": [part]})
    with pytest.raises(InvalidMessage, match="detail"):
        canonical_message({"role": "user", "content": [image_part(screenshot(32, 32), detail="huge")]})


# --- placeholders and their expansion ---------------------------------------------------------------


def test_expand_then_collapse_gives_back_the_sent_ids():
    ids = array("i", [1, START, PAD, END, 2, START, PAD, END, 3])
    expanded, spans = expand(ids, PAD, [(4, 1, 4, 4, b"a" * 32), (2, 1, 2, 4, b"b" * 32)])
    assert expanded.tolist() == [1, START, PAD, PAD, PAD, PAD, END, 2, START, PAD, PAD, END, 3]
    assert [(s.offset, s.tokens) for s in spans] == [(2, 4), (9, 2)]
    assert collapse(expanded, spans) == ids
    assert expansion_problem(expanded.tolist(), expanded, spans, 0, PAD) is None


def test_an_expansion_that_differs_is_named():
    ids = array("i", [1, START, PAD, END, 2, START, PAD, END])
    expanded, spans = expand(ids, PAD, [(4, 1, 4, 4, b"a" * 32), (2, 1, 2, 4, b"b" * 32)])
    other, _ = expand(ids, PAD, [(4, 1, 4, 4, b"a" * 32), (3, 1, 2, 6, b"b" * 32)])
    problem = expansion_problem(other.tolist(), expanded, spans, 1, PAD)
    assert "image 1" in problem and "to 3 tokens" in problem and "gives 2" in problem
    changed, _ = expand(ids, PAD, [(5, 1, 4, 5, b"a" * 32), (2, 1, 2, 4, b"b" * 32)])
    assert "may not change across turns" in expansion_problem(changed.tolist(), expanded, spans, 1, PAD)
    assert "one placeholder per image" in expansion_problem(ids.tolist()[:4], expanded, spans, 1, PAD)


# --- the record --------------------------------------------------------------------------------------


def image(offset: int, tokens: int, seed: int) -> ImageSpan:
    return ImageSpan(offset, tokens, 1, 2, tokens * 2, bytes([seed]) * 32)


def turn(new_ids: list[int], images=(), parent=None, keep=None) -> RecordedTurn:
    return RecordedTurn(
        array("i", new_ids),
        array("i", [7, 8]),
        array("f", [-0.5, -0.25]),
        message_count=2,
        history_digest=bytes([len(new_ids)]) * 32,
        stopped=True,
        stop_token=8,
        parent=parent,
        keep=keep,
        images=tuple(images),
    )


def session_with_images() -> Session:
    session = Session(SID, b"k" * 32)
    session.append_turn(turn([1, START, PAD, PAD, PAD, END, 2], [image(2, 3, 1)]))
    session.append_turn(turn([3, START, PAD, PAD, END], [image(2, 2, 2)]))  # continues turn 0
    session.append_turn(turn([4, START, PAD, PAD, END], [image(2, 2, 3)], parent=0))  # a branch after 0
    return session


def test_a_path_holds_its_images_in_path_coordinates():
    session = session_with_images()
    assert [(i.offset, i.tokens, i.digest[0]) for i in tree.path_images(session, 1)] == [
        (2, 3, 1),
        (11, 2, 2),
    ]
    assert [(i.offset, i.digest[0]) for i in tree.path_images(session, 2)] == [(2, 1), (11, 3)]
    linear = tree.path_record(session, 2, None)
    assert [(i.offset, i.digest[0]) for i in image_spans(linear)] == [(2, 1), (11, 3)]
    assert all(
        linear.token_ids[i.offset : i.offset + i.tokens].tolist() == [PAD] * i.tokens
        for i in image_spans(linear)
    )
    assert tree.image_digests_of(session) == {bytes([n]) * 32 for n in (1, 2, 3)}
    trajectory = session.trajectory()
    assert [i["offset"] for i in trajectory["images"]] == [2, 11] and trajectory["images"][1]["grid_thw"] == [
        1,
        2,
        4,
    ]


def test_a_rolled_back_turn_takes_its_images_with_it():
    session = session_with_images()
    mark = session.mark()
    session.append_turn(turn([5, START, PAD, END], [image(2, 1, 4)], parent=2))
    session.rollback(mark)
    assert [i.digest[0] for i in image_spans(session)] == [1, 2, 3]


def test_images_must_lie_inside_the_new_input():
    with pytest.raises(ValueError, match="not inside the new input"):
        Session("s", b"k" * 32).append_turn(turn([1, PAD], [image(1, 2, 1)]))


def test_dumps_and_journal_records_keep_the_images(tmp_path):
    session = session_with_images()
    path = tmp_path / "s1.safetensors"
    path.write_bytes(encode_record(session.to_record(), "test"))
    assert image_spans(load_session_file(path)) == image_spans(session)
    recorded = turn([1, START, PAD, PAD, END], [image(2, 2, 9)])
    framed = records.turn_record(SID, b"k" * 32, 0, recorded)
    decoded = records.scan(framed).records[0]
    assert records.recorded_turn(decoded).images == recorded.images


def test_a_dump_whose_image_is_outside_a_prompt_is_refused(tmp_path):
    session = session_with_images()
    record = session.to_record()
    record.image_spans[0] = len(record.token_ids) - 2  # now over turn 2's output
    path = tmp_path / "s1.safetensors"
    path.write_bytes(encode_record(record, "test"))
    with pytest.raises(ValueError, match="not inside a turn's prompt"):
        load_session_file(path)


def test_a_new_prompt_shares_no_tokens_past_an_image_that_differs():
    """Two images of one size expand to the same ids: what is stored once stops at the image."""
    session = Session("s", b"k" * 32)
    session.append_turn(turn([1, START, PAD, PAD, END, 2], [image(2, 2, 1)]))
    same_size_other_image = array("i", [1, START, PAD, PAD, END, 2])
    parent, keep = attach(session, ROOT, same_size_other_image, [image(2, 2, 5)])
    assert (parent, keep) == (0, 2)  # [1, START] shared; the image is the branch's own
    parent, keep = attach(session, ROOT, same_size_other_image, [image(2, 2, 1)])
    assert (parent, keep) == (0, 6)  # the same image: all shared


# --- over HTTP: refusals with a real VL model directory -------------------------------------------


@pytest.fixture(scope="module")
def qwen25_vl():
    model_dir = VL_FAMILIES["qwen25_vl"].build_cached()
    # transformers' image processors import torch when it is installed (the test environment; the
    # proxy's has none): once here, not inside a proxy's start-up timeout.
    image_processor(model_dir)
    return model_dir


@pytest.fixture
def vl_proxy(qwen25_vl, tmp_path):
    # No engine: every refusal comes before the engine would be called.
    with running_proxy(
        "http://127.0.0.1:9", qwen25_vl, tmp_path, max_image_bytes=50_000, max_request_image_bytes=40_000
    ) as proxy:
        yield proxy


def send(proxy, sid, key, content) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers=bearer(key),
        json=chat_body([{"role": "user", "content": content}]),
        timeout=30,
    )


def test_bad_images_get_clear_400s_and_leave_nothing_behind(vl_proxy):
    sid, key = vl_proxy.create_session()
    png = screenshot(320, 200, seed=1)
    big = screenshot(640, 480, seed=2)  # a few hundred KB: over max_image_bytes
    cases = [
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}],
            "invalid_image",
            "base64",
        ),
        ([image_part(big)], "image_too_large", "max_image_bytes"),
        (
            [
                image_part(png),
                image_part(screenshot(320, 200, seed=3)),
                image_part(screenshot(320, 200, seed=4)),
            ],
            "image_too_large",
            "max_request_image_bytes",
        ),
        (
            [
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/gif;base64," + base64.b64encode(gif_bytes()).decode()},
                }
            ],
            "invalid_image",
            "gif",
        ),
        (
            [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}],
            "unsupported_content",
            "video",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
            "unsupported_content",
            "not fetched",
        ),
    ]
    assert len(png) < 50_000 < len(big) and 3 * len(png) > 40_000, (len(png), len(big))
    for content, code, says in cases:
        answer = send(vl_proxy, sid, key, [{"type": "text", "text": "look"}, *content])
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == code and says in error["message"], error
    summary = vl_proxy.get(sid, key, tokens=False).json()
    assert summary["num_turns"] == 0 and not summary["busy"]
    images = vl_proxy.runtime.storage.images
    assert images._pins == {}  # every refused request let go of what it pinned


def test_a_model_without_images_refuses_them(tmp_path):
    with running_proxy("http://127.0.0.1:9", FAMILIES["qwen25"].build_cached(), tmp_path) as proxy:
        sid, key = proxy.create_session()
        answer = send(proxy, sid, key, [image_part(screenshot(32, 32))])
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "unsupported_content"
        assert "preprocessor_config.json" in answer.json()["error"]["message"]


def test_a_vl_model_directory_raises_the_body_limit_by_the_images_base64(vl_proxy):
    settings = vl_proxy.runtime.settings
    assert vl_proxy.runtime.takes_images
    assert vl_proxy.runtime.max_body_bytes == settings.max_body_bytes + (40_000 + 2) // 3 * 4
