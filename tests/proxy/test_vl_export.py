"""Exports of vision-language sessions (Qwen2.5-VL model directory, Qwen's vocabulary, the SGLang
emulator): each sample carries its images (bytes in prompt order, sha256, grid) and the model
directory's preprocessor_config.json; the image files stay on disk while an unacknowledged batch
references them (across a restart too); the trainer client rebuilds pixel_values and image_grid_thw
exactly as transformers' image processor makes them of the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
from array import array

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from proxy_harness import ADMIN, bearer, chat_body, running_proxy
from rolloutfleet_client.trainer import PulledBatch, to_torch
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.screenshots import image_part, screenshot
from rolloutfleet_testkit.sglang_emulator.server import create_app as emulator_app
from rolloutfleet_testkit.waiting import wait_for
from rolloutfleet_wire.export_format import FORMAT, BatchFormatError, ExportImages, decode_batch, encode_batch
from rolloutfleet_wire.session_record import SessionRecord
from safetensors.numpy import save
from transformers import AutoTokenizer
from vl_reference import IMAGE_PAD_ID, expanded_prompt, image_processor


@pytest.fixture(scope="module")
def model_dir():
    return VL_FAMILIES["qwen25_vl"].build_cached()


def user(text: str, shot: bytes) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, image_part(shot)]}


def play(proxy, shots: list[bytes]) -> tuple[str, str, list[dict]]:
    """A finished session: one turn per screenshot (the first one shown again last), rewarded."""
    sid, key = proxy.create_session()
    messages: list[dict] = []
    for i, shot in enumerate([*shots, shots[0]]):
        messages.append(user(f"Step {i}: what next?", shot))
        messages.append(
            proxy.chat_turn(sid, key, messages, max_tokens=2, temperature=0)["choices"][0]["message"]
        )
    rewarded = httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", headers=bearer(key), json={"reward": 1.0})
    assert rewarded.status_code == 200, rewarded.text
    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/finish", headers=bearer(key)).status_code == 200
    return sid, key, messages


def export(proxy, sid: str) -> httpx.Response:
    created = httpx.post(f"{proxy.url}/v1/exports", headers=ADMIN, json={"session_ids": [sid]}, timeout=60)
    assert created.status_code == 201, created.text
    return created


def image_files(proxy) -> set[str]:
    return {p.name.partition(".")[0] for p in (proxy.dump_dir / "images").iterdir()}


def test_a_batch_carries_its_images_and_keeps_their_files_until_acknowledged(model_dir, tmp_path):
    shots = [screenshot(640, 360, seed=10), screenshot(320, 640, seed=11)]
    digests = [hashlib.sha256(s).hexdigest() for s in shots]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    processor = image_processor(model_dir)
    dumps = tmp_path / "dumps"
    with (
        serve_app(emulator_app(str(model_dir), seed=0)) as engine,
        running_proxy(engine, model_dir, dumps, cleanup_interval_s=0.05) as proxy,
    ):
        sid, _, messages = play(proxy, shots)
        created = export(proxy, sid)
        batch = decode_batch(created.content)
        (sample,) = [batch.trajectory(0)]
        prompt = sample["input_ids"][: sample["turn_bounds"][-1][1]]  # the last turn's prompt
        # The images as the reference sees them: the processor's grids and counts, in prompt order.
        reference = expanded_prompt(tokenizer, processor, messages[:-1])
        images = sample["images"]
        assert [i["sha256"] for i in images] == [digests[0], digests[1], digests[0]]
        assert [tuple(i["grid_thw"]) for i in images] == reference.image_grid_thw
        assert [i["tokens"] for i in images] == reference.image_token_counts
        for image in images:
            start, end = image["offset"], image["offset"] + image["tokens"]
            assert prompt[start:end] == [IMAGE_PAD_ID] * image["tokens"]
            assert prompt[start - 1] != IMAGE_PAD_ID and prompt[end] != IMAGE_PAD_ID  # the whole run
            assert not any(sample["loss_mask"][start:end])
        assert prompt.count(IMAGE_PAD_ID) == sum(reference.image_token_counts)
        # Each distinct image's bytes once, as the client sent them; the processor's configuration.
        assert batch.tensors["image_digests"].shape == (2, 32)
        assert [batch.image_bytes(k) for k in batch.image_range(0)] == [shots[0], shots[1], shots[0]]
        assert batch.tensors["image_refs"].tolist() == [0, 1, 0]
        preprocessor = json.loads((model_dir / "preprocessor_config.json").read_text())
        assert batch.vision == {"image_token_id": IMAGE_PAD_ID, "processor_config": preprocessor}

        # The session has left the store; the unacknowledged batch keeps its image files.
        cycles = proxy.stats()["totals"]["cleanup_cycles"]
        wait_for(lambda: proxy.stats()["totals"]["cleanup_cycles"] >= cycles + 3, 10, "cleanup cycles", 0.02)
        assert image_files(proxy) == set(digests)
        assert proxy.stats()["totals"]["images_deleted"] == 0
    # Restarted with the batch unacknowledged: the restored batch still holds its images.
    with (
        serve_app(emulator_app(str(model_dir), seed=0)) as engine,
        running_proxy(engine, model_dir, dumps, cleanup_interval_s=0.05) as proxy,
    ):
        assert proxy.stats()["totals"]["batches_restored"] == 1
        cycles = proxy.stats()["totals"]["cleanup_cycles"]
        wait_for(lambda: proxy.stats()["totals"]["cleanup_cycles"] >= cycles + 3, 10, "cleanup cycles", 0.02)
        assert image_files(proxy) == set(digests)
        fetched = httpx.get(f"{proxy.url}/v1/exports/{batch.batch_id}", headers=ADMIN)
        assert fetched.content == created.content
        acknowledged = httpx.post(f"{proxy.url}/v1/exports/{batch.batch_id}/ack", headers=ADMIN)
        assert acknowledged.status_code == 200
        # Nothing references them now: the next cycle deletes them.
        wait_for(lambda: not image_files(proxy), 10, "the image files to be deleted", 0.02)
        assert proxy.stats()["totals"]["images_deleted"] == 2


def test_to_torch_rebuilds_the_image_inputs_as_the_processor_makes_them(model_dir, tmp_path):
    shots = [screenshot(640, 360, seed=20), screenshot(1280, 720, seed=21)]
    with (
        serve_app(emulator_app(str(model_dir), seed=0)) as engine,
        running_proxy(engine, model_dir, tmp_path / "dumps") as proxy,
    ):
        sid, _, _ = play(proxy, shots)
        created = export(proxy, sid)
        text_sid, text_key = proxy.create_session()  # a text-only row beside it
        answer = httpx.post(
            f"{proxy.url}/v1/sessions/{text_sid}/chat/completions",
            headers=bearer(text_key),
            json=chat_body([{"role": "user", "content": "Hi"}], max_tokens=2),
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        finished = httpx.post(f"{proxy.url}/v1/sessions/{text_sid}/finish", headers=bearer(text_key))
        assert finished.status_code == 200, finished.text
        text_only = export(proxy, text_sid)
    batches = [
        PulledBatch(proxy.url, created.headers["x-rolloutfleet-batch-id"], created.content),
        PulledBatch(proxy.url, text_only.headers["x-rolloutfleet-batch-id"], text_only.content),
    ]
    tensors = to_torch(batches, images=True)

    # The processor run directly on the same bytes, in the rows' prompt order.
    processor = image_processor(model_dir)
    rgb = [Image.open(io.BytesIO(data)).convert("RGB") for data in (shots[0], shots[1], shots[0])]
    direct = processor(images=rgb, return_tensors="pt")
    assert tensors["image_counts"].tolist() == [3, 0]
    assert torch.equal(tensors["image_grid_thw"], direct["image_grid_thw"].to(torch.int64))
    assert tensors["pixel_values"].dtype == torch.float32
    assert torch.equal(tensors["pixel_values"], direct["pixel_values"].float())
    # The grids are the ones the engine expanded the images by.
    counts = (tensors["image_grid_thw"].prod(dim=1) // processor.merge_size**2).tolist()
    assert counts == [299, 1196, 299]
    assert counts == batches[0].decoded.tensors["image_spans"][:, 1].tolist()

    # Another processor configuration than the engine's (Qwen3-VL's patch 16) is refused.
    other = image_processor(VL_FAMILIES["qwen3_vl"].build_cached())
    with pytest.raises(ValueError, match="another processor configuration"):
        to_torch(batches, images=True, image_processor=other)


def test_batches_of_earlier_format_versions_read_without_images_and_bad_image_tensors_are_refused():
    image = screenshot(64, 64, seed=1)
    digest = hashlib.sha256(image).digest()
    record = SessionRecord(
        session_id="s1",
        key_digest=bytes(32),
        created_at=0.0,
        metadata={},
        token_ids=array("i", [1, IMAGE_PAD_ID, IMAGE_PAD_ID, 2, 7]),
        loss_mask=array("B", [0, 0, 0, 0, 1]),
        logprobs=array("f", [0, 0, 0, 0, -0.5]),
        turn_bounds=array("i", [0, 4, 5]),
        turn_versions=array("i", [3]),
        turn_temperatures=array("f", [1.0]),
        turn_tempered=array("B", [0]),
        turn_parents=array("i", [-1]),
        turn_keeps=array("i", [0]),
        turn_calls=array("i", [0]),
        turn_finishes=array("B", [1]),
        image_spans=array("i", [1, 2, 1, 2, 4]),
        image_digests=array("B", digest),
        finished=True,
    )
    with pytest.raises(ValueError, match="no image store"):
        encode_batch("b-1", [record], 3)
    vision = ExportImages({digest: image}.__getitem__, IMAGE_PAD_ID, {"patch_size": 14})
    batch = decode_batch(encode_batch("b-1", [record], 3, images=vision))
    assert batch.trajectory(0)["images"] == [
        {"offset": 1, "tokens": 2, "grid_thw": [1, 2, 4], "sha256": digest.hex()}
    ]
    assert batch.image_bytes(0) == image and batch.image_digest_set() == {digest}

    header = dict(batch.header, format_version=3)
    older = {k: v for k, v in batch.tensors.items() if not k.startswith(("image_", "cu_image"))}
    old = decode_batch(save(older, metadata={FORMAT: json.dumps(header)}))
    assert old.trajectory(0)["images"] == [] and old.image_digest_set() == frozenset()
    assert old.trajectory(0)["input_ids"] == list(record.token_ids)

    broken = dict(batch.tensors, image_refs=np.array([1], np.int32))  # no distinct image 1
    with pytest.raises(BatchFormatError):
        decode_batch(save(broken, metadata={FORMAT: json.dumps(batch.header)}))
