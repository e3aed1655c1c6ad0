"""A screenshot session through a proxy process that is SIGKILLed (what the OOM killer sends) in the
middle of a turn, then restarted on the same dump directory: every delivered turn is back and replays
byte-identical, each image of a delivered turn is its file (intact, named by its sha256) and nothing
else is, and the turn the kill cut off continues token-exact (the recorded ids are the reference's:
the template + transformers' image processor). Real proxy processes, Qwen's vocabulary with the
Qwen2.5-VL model directory, the SGLang emulator (a stand-in: no GPU here)."""

from __future__ import annotations

import hashlib
import signal
import threading

import httpx
from proxy_harness import ADMIN, bearer, chat_body, proxy_process
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.screenshots import image_part, screenshot
from rolloutfleet_testkit.sglang_emulator.server import create_app as emulator_app
from rolloutfleet_testkit.waiting import wait_for
from transformers import AutoTokenizer
from vl_reference import CLICK, conversation_prompt, image_processor


def user(text: str, shot: bytes) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, image_part(shot)]}


def test_sigkill_mid_turn_keeps_every_delivered_turn_and_its_images(tmp_path):
    directory = VL_FAMILIES["qwen25_vl"].build_cached()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    processor = image_processor(directory)
    shots = [screenshot(640, 360, seed=30 + i) for i in range(4)]
    dumps = tmp_path / "dumps"
    call = {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x": 5}'}}
    delivered: list[tuple[dict, str, bytes]] = []  # (body, idempotency key, answer bytes)

    # Each request waits in the engine, so the kill lands inside the fourth turn's engine call.
    with serve_app(emulator_app(str(directory), seed=0, delay_s=1.0)) as engine:
        process, url = proxy_process(
            engine, directory, dumps, tmp_path / "proxy-1.log", "--tool-call-parser", "qwen25"
        )
        process.wait_ready(f"{url}/readyz", 90)
        created = httpx.post(f"{url}/v1/sessions", headers=ADMIN, json={}).json()
        sid, key = created["session_id"], created["session_key"]
        chat = f"{url}/v1/sessions/{sid}/chat/completions"

        def turn(messages: list[dict], idempotency_key: str, max_tokens: int = 3) -> httpx.Response:
            body = chat_body(list(messages), tools=[CLICK], max_tokens=max_tokens, temperature=0)
            answer = httpx.post(
                chat, headers={**bearer(key), "Idempotency-Key": idempotency_key}, json=body, timeout=120
            )
            assert answer.status_code == 200, answer.text
            delivered.append((body, idempotency_key, answer.content))
            return answer

        messages = [user("Open the settings.", shots[0])]
        messages.append(turn(messages, "t1").json()["choices"][0]["message"])
        messages.append(user("And now?", shots[1]))
        messages.append(turn(messages, "t2").json()["choices"][0]["message"])
        # A click the proxy did not record (a branch after the second reply); the tool answers with
        # the next screenshot, as computer-use agents do.
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": [image_part(shots[2])]})
        messages.append(turn(messages, "t3").json()["choices"][0]["message"])
        messages.append(user("Done?", shots[3]))

        cut_off: list[BaseException | httpx.Response] = []

        def fourth_turn() -> None:
            body = chat_body(list(messages), tools=[CLICK], max_tokens=3, temperature=0)
            try:
                cut_off.append(httpx.post(chat, headers=bearer(key), json=body, timeout=60))
            except httpx.HTTPError as exc:
                cut_off.append(exc)

        sender = threading.Thread(target=fourth_turn)
        sender.start()
        wait_for(
            lambda: httpx.get(f"{url}/v1/generation", headers=ADMIN).json()["generating_turns"] == 1,
            30,
            "the fourth turn to reach the engine",
            0.01,
        )
        process.process.send_signal(signal.SIGKILL)
        process.process.wait(10)
        process.terminate()
        sender.join(30)
        assert len(cut_off) == 1 and isinstance(cut_off[0], httpx.HTTPError)  # never answered

        process, url = proxy_process(
            engine, directory, dumps, tmp_path / "proxy-2.log", "--tool-call-parser", "qwen25"
        )
        try:
            process.wait_ready(f"{url}/readyz", 90)
            chat = f"{url}/v1/sessions/{sid}/chat/completions"
            data = httpx.get(
                f"{url}/v1/sessions/{sid}", params={"tokens": "true"}, headers=bearer(key)
            ).json()
            assert data["num_turns"] == 3
            # The delivered images are their files, intact; the cut-off turn's image (written before
            # its engine call) referenced nothing once the kill undid the turn, and the start removed it.
            files = {p.name.partition(".")[0]: p for p in (dumps / "images").iterdir()}
            assert set(files) == {hashlib.sha256(shot).hexdigest() for shot in shots[:3]}
            for name, path in files.items():
                assert hashlib.sha256(path.read_bytes()).hexdigest() == name
            for body, idempotency_key, answer in delivered:
                again = httpx.post(
                    chat, headers={**bearer(key), "Idempotency-Key": idempotency_key}, json=body, timeout=60
                )
                assert again.status_code == 200 and again.headers.get("Idempotent-Replayed") == "true"
                assert again.content == answer

            # The cut-off turn again: recorded token-exact, on top of the restored turns.
            body = chat_body(list(messages), tools=[CLICK], max_tokens=3, temperature=0)
            answer = httpx.post(chat, headers=bearer(key), json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            trajectory = httpx.get(
                f"{url}/v1/sessions/{sid}", params={"tokens": "true"}, headers=bearer(key)
            ).json()["trajectory"]
            ids = trajectory["input_ids"]
            outputs = [ids[output_start:end] for _, output_start, end in trajectory["turns"]]
            prompt = ids[: trajectory["turns"][-1][1]]
            assert prompt == conversation_prompt(tokenizer, processor, messages, [1, 3, 6], outputs, [CLICK])
            assert len(trajectory["images"]) == 4
            assert len(list((dumps / "images").iterdir())) == 4
        finally:
            assert process.terminate() == 0
