"""Trainer-side client for a fleet of proxies: pull finished trajectories, make torch tensors, ack.

    from rolloutfleet_client.trainer import TrainerClient, to_torch

    with TrainerClient.from_fleet_status(fleet_status, admin_key) as fleet:
        batches = fleet.pull(256, timeout_s=30)      # up to 256 trajectories across the proxies
        tensors = to_torch(batches)                  # padded [B, T] tensors with attention_mask
        train_step(tensors)
        fleet.ack(batches)                           # only now do the proxies free them
        fleet.update_weights(step + 1, model_path=checkpoint_dir)  # pause, load, version, resume

Acknowledge a batch only once it is used: a batch not acknowledged within the proxy's export TTL is
written to its `exported/` directory and freed. The proxy server never imports this module. It
needs httpx (and numpy and safetensors, as the proxy does); torch is imported by `to_torch` only.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from rolloutfleet_wire.errors import ErrorCode
from rolloutfleet_wire.export_format import DecodedBatch, decode_batch

from .errors import NoAnswerCode, ProxyRequestError, proxy_error
from .retry import Backoff, not_sent, nothing_done, retry_after_s, trainer_should_retry

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rolloutfleet.trainer_client")

# SGLang's /pause_generation modes: abort running requests (they answer with their partial tokens,
# which the proxies continue after the resume), retract them to the waiting queue, or hold them in
# place; both of the latter resume under the new weights.
PAUSE_MODES = ("abort", "retract", "in_place")
ENGINE_UPDATE_TIMEOUT_S = 1800.0  # loading a checkpoint from disk can take minutes


class EngineCallError(RuntimeError):
    """An SGLang engine refused or failed a pause, weight update or resume."""

    def __init__(self, url: str, status: int | None, message: str):
        super().__init__(f"{url}: {status}: {message}")
        self.url, self.status, self.message = url, status, message


# The name this client's error had before both clients shared one (docs/proxy.md names it).
ProxyCallError = ProxyRequestError


@dataclass
class PulledBatch:
    """One exported batch as a proxy sent it (the safetensors bytes, decoded on first use)."""

    proxy_url: str
    batch_id: str
    data: bytes = field(repr=False)

    @cached_property
    def decoded(self) -> DecodedBatch:
        return decode_batch(self.data)

    @property
    def num_trajectories(self) -> int:
        """Samples in the batch (one per session by default; per leaf or per turn when asked)."""
        return self.decoded.num_trajectories

    @property
    def num_sessions(self) -> int:
        return len({info["session_id"] for info in self.decoded.header["trajectories"]})

    def trajectories(self) -> list[dict[str, Any]]:
        """Per trajectory: proxy, batch, session id, session metadata, reward, model versions."""
        batch = self.decoded
        tensors = batch.tensors
        infos = []
        for i, info in enumerate(batch.header["trajectories"]):
            start, end = int(tensors["cu_seqlens"][i]), int(tensors["cu_seqlens"][i + 1])
            reward = float(tensors["rewards"][i])
            infos.append(
                {
                    "proxy_url": self.proxy_url,
                    "batch_id": self.batch_id,
                    "session_id": info["session_id"],
                    "metadata": info["metadata"],
                    "num_tokens": end - start,
                    "reward": None if np.isnan(reward) else reward,
                    "sample": info.get("sample"),  # its place in the session's tree
                }
            )
        return infos


class TrainerClient:
    """Synchronous client for one or many proxies (a fleet's `status.proxyEndpoints`).

    Calls that are safe to repeat are retried on connection failures and on the answers that say
    nothing was done (`retry.nothing_done`: the shared `RETRY_LATER` codes, such as a proxy draining
    or restarting, whose batches and state continue on its replacement at the same URL). Creating
    an export is retried only when the request never reached the proxy or the proxy itself said it
    built nothing; after a lost answer the batch is still held there, and `pending()` finds it.
    """

    def __init__(
        self,
        proxy_urls: Sequence[str] | str,
        admin_key: str,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        retries: int = 10,
        backoff: Backoff | None = None,
        client: httpx.Client | None = None,
        engine_urls: Sequence[str] = (),
        engine_api_key: str | None = None,
    ):
        urls = [proxy_urls] if isinstance(proxy_urls, str) else list(proxy_urls)
        if not urls:
            raise ValueError("no proxy URLs")
        self.proxy_urls = [u.rstrip("/") for u in urls]
        # The SGLang engines (the fleet's status.engineEndpoints): the router has no pause or
        # weight-update routes, so those go to each engine.
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self._engine_headers = {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        # A short connect timeout: a proxy being replaced keeps its DNS name while its old address
        # answers nothing, and a connection never made is retried at once (see _call).
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        self._owns_client = client is None
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._retries = retries
        self._backoff = backoff or Backoff(initial_s=0.5)  # the rollout client's policy
        self._next_proxy = 0  # pulls start at a rotating proxy, so none is always asked last

    @classmethod
    def from_fleet_status(cls, status: dict[str, Any], admin_key: str, **kwargs: Any) -> TrainerClient:
        """For every proxy the fleet lists as ready: `status` is the RolloutFleet's status (or the
        whole object, as `kubectl get rolloutfleet NAME -o json` prints it)."""
        status = status.get("status", status)
        endpoints = status.get("proxyEndpoints") or []
        if not endpoints:
            raise ValueError("the fleet's status lists no proxyEndpoints (no proxy is Ready yet)")
        kwargs.setdefault("engine_urls", status.get("engineEndpoints") or [])
        return cls(endpoints, admin_key, **kwargs)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- HTTP with retries ---------------------------------------------------------------------

    def _call(
        self, method: str, url: str, *, repeatable: bool = True, retries: int | None = None, **kwargs: Any
    ) -> httpx.Response:
        retries = self._retries if retries is None else retries
        for attempt in range(retries + 1):
            last = attempt == retries
            retry_after = None
            try:
                response = self._client.request(method, url, headers=self._headers, **kwargs)
            except httpx.TransportError as exc:
                # Not sent at all: always safe to retry. Sent but unanswered: only if repeatable.
                if last or not (repeatable or not_sent(exc)):
                    raise ProxyRequestError(
                        url, None, NoAnswerCode.UNREACHABLE, f"{type(exc).__name__}: {exc}"
                    ) from exc
            else:
                status = response.status_code
                if last or status not in (502, 503):  # the body is read only when it may matter
                    return response
                if not trainer_should_retry(status, proxy_error(response)[0], repeatable=repeatable):
                    return response
                retry_after = retry_after_s(response.headers.get("retry-after"))
            time.sleep(self._backoff.delay(attempt, retry_after, rand=random.random()))
        raise AssertionError("unreachable")

    def _checked(self, response: httpx.Response, *ok: int) -> httpx.Response:
        if response.status_code not in ok:
            code, message = proxy_error(response)
            raise ProxyRequestError(str(response.request.url), response.status_code, code, message)
        return response

    def _each(self, call: Callable[[str], Any]) -> dict[str, Any]:
        return {url: call(url) for url in self.proxy_urls}

    # --- trajectories ----------------------------------------------------------------------------

    def export_from(
        self,
        proxy_url: str,
        *,
        max_trajectories: int | None = None,
        session_ids: list[str] | None = None,
        retries: int | None = None,
        samples: str = "latest",
        drop_replaced: bool = False,
    ) -> PulledBatch | None:
        """One export request to one proxy; None when it has nothing ready. `max_trajectories`
        counts sessions; each session becomes the samples `samples` asks: "latest" (the path to its
        latest turn: all of a linear session), "leaves" (one per branch) or "turns" (one per turn,
        loss mask on that turn's output); `drop_replaced` leaves out samples through a regenerated
        call."""
        body: dict[str, Any] = (
            {"session_ids": session_ids}
            if session_ids is not None
            else {"max_trajectories": max_trajectories}
        )
        if samples != "latest":
            body["samples"] = samples
        if drop_replaced:
            body["drop_replaced"] = True
        # Not repeatable: an answer lost after the proxy built the batch must not build a second one.
        response = self._call("POST", f"{proxy_url}/v1/exports", repeatable=False, retries=retries, json=body)
        self._checked(response, 201, 204)
        if response.status_code == 204:
            return None
        return PulledBatch(proxy_url, response.headers["x-rolloutfleet-batch-id"], response.content)

    def pull(
        self,
        max_trajectories: int,
        *,
        timeout_s: float = 0.0,
        poll_interval_s: float = 0.5,
        samples: str = "latest",
        drop_replaced: bool = False,
    ) -> list[PulledBatch]:
        """Up to `max_trajectories` ready sessions in total, from the proxies in turn (each asked
        only for what is still missing, so nothing beyond the total is taken out of a proxy), each
        as the samples `samples` asks (`export_from`). Waits up to `timeout_s` for more to become
        ready. A proxy that is unreachable or restarting is skipped for this round."""
        deadline = time.monotonic() + timeout_s
        batches: list[PulledBatch] = []
        missing = max_trajectories
        while True:
            start = self._next_proxy % len(self.proxy_urls)
            self._next_proxy += 1
            for url in self.proxy_urls[start:] + self.proxy_urls[:start]:
                if missing <= 0:
                    break
                try:
                    # No retries within a round: an unavailable proxy must not hold up the others.
                    batch = self.export_from(
                        url,
                        max_trajectories=missing,
                        retries=0,
                        samples=samples,
                        drop_replaced=drop_replaced,
                    )
                except ProxyRequestError as exc:
                    if exc.status is not None and not nothing_done(exc.status, exc.code):
                        raise
                    log.warning("skipping proxy %s this round: %s", url, exc)
                    continue
                if batch is not None:
                    batches.append(batch)
                    missing -= batch.num_sessions
            if missing <= 0 or time.monotonic() >= deadline:
                return batches
            time.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))

    def fetch(self, proxy_url: str, batch_id: str) -> PulledBatch:
        """A batch not acknowledged yet, again: the same bytes as when it was exported."""
        response = self._checked(self._call("GET", f"{proxy_url}/v1/exports/{batch_id}"), 200)
        return PulledBatch(proxy_url, batch_id, response.content)

    def pending(self) -> list[PulledBatch]:
        """Every batch the proxies hold unacknowledged (after a trainer restart or a lost answer)."""
        batches = []
        for url, listing in self._each(
            lambda url: self._checked(self._call("GET", f"{url}/v1/exports"), 200).json()
        ).items():
            batches += [self.fetch(url, b["batch_id"]) for b in listing["batches"]]
        return batches

    def ack(self, batches: Iterable[PulledBatch]) -> dict[str, bool]:
        """Acknowledge batches, so their proxies free them. Per batch id: True when this call
        acknowledged it, False when it already was (by an earlier call or another trainer)."""
        results = {}
        for batch in batches:
            response = self._call("POST", f"{batch.proxy_url}/v1/exports/{batch.batch_id}/ack")
            if (
                response.status_code == 410
                and proxy_error(response)[0] == ErrorCode.BATCH_ALREADY_ACKNOWLEDGED
            ):
                results[batch.batch_id] = False
                continue
            self._checked(response, 200)
            results[batch.batch_id] = True
        return results

    # --- model version and pause -----------------------------------------------------------------

    def set_model_version(self, version: int) -> dict[str, Any]:
        """Publish the model version to every proxy; per URL, the proxy's answer."""
        return self._each(
            lambda url: self._checked(
                self._call("PUT", f"{url}/v1/generation/model_version", json={"model_version": version}), 200
            ).json()
        )

    def pause(self, wait_s: float = 0.0) -> dict[str, Any]:
        """Pause generation everywhere; with `wait_s`, each proxy answers once its generating turns
        finished (`generating_turns` 0) or `wait_s` passed."""
        return self._each(
            lambda url: self._checked(
                self._call("POST", f"{url}/v1/generation/pause", params={"wait_s": wait_s}), 200
            ).json()
        )

    def resume(self) -> dict[str, Any]:
        return self._each(
            lambda url: self._checked(self._call("POST", f"{url}/v1/generation/resume"), 200).json()
        )

    # --- SGLang engines: pause, weights, resume --------------------------------------------------

    def _engine_post(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            response = self._client.post(
                f"{url}{path}", json=body, headers=self._engine_headers, timeout=timeout_s
            )
        except httpx.TransportError as exc:
            raise EngineCallError(url, None, f"{path}: {type(exc).__name__}: {exc}") from exc
        try:
            answer = response.json() if response.content else {}
        except ValueError:
            answer = {"message": response.text[:300]}
        if response.status_code != 200 or (isinstance(answer, dict) and answer.get("success") is False):
            message = answer.get("message") if isinstance(answer, dict) else None
            raise EngineCallError(url, response.status_code, f"{path}: {message or response.text[:300]}")
        return answer if isinstance(answer, dict) else {"answer": answer}

    def _each_engine(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        """POST to every engine at once (a checkpoint load takes as long on one engine as on all)."""
        if not self.engine_urls:
            raise ValueError("no engine URLs: pass engine_urls (the fleet's status.engineEndpoints)")
        with ThreadPoolExecutor(max_workers=min(16, len(self.engine_urls))) as pool:
            futures = {
                url: pool.submit(self._engine_post, url, path, body, timeout_s) for url in self.engine_urls
            }
            return {url: future.result() for url, future in futures.items()}

    def pause_engines(self, mode: str = "abort") -> dict[str, Any]:
        """SGLang's /pause_generation on every engine, in `mode` (PAUSE_MODES)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}")
        return self._each_engine("/pause_generation", {"mode": mode})

    def continue_engines(self) -> dict[str, Any]:
        return self._each_engine("/continue_generation", {})

    def update_weights(
        self,
        version: int,
        *,
        model_path: str | None = None,
        update: Callable[[list[str]], None] | None = None,
        mode: str = "abort",
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """One weight update across the fleet, in the order that loses nothing:

        1. pause the proxies (new turns, and turns an abort interrupted, wait at their gate);
        2. pause the engines in `mode` (abort: running generations answer with their partial tokens,
           which the proxies keep and continue after step 5; in_place / retract: they wait inside
           the engine and finish under the new weights);
        3. load the weights: `model_path` with SGLang's /update_weights_from_disk, or your own
           `update(engine_urls)` (NCCL, tensors) followed by /update_weight_version; either way the
           engines report `str(version)` as their `weight_version`, which the proxies record;
        4. publish `version` to the proxies; 5. continue the engines; 6. resume the proxies.

        Steps 5 and 6 run even when 3 or 4 fail (the engines then keep the weights they have), and
        the error is raised after them. Returns each step's answers."""
        if (model_path is None) == (update is None):
            raise ValueError("give exactly one of model_path and update")
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}")
        steps: dict[str, Any] = {"proxies_paused": self.pause()}
        try:
            steps["engines_paused"] = self.pause_engines(mode)
            try:
                if model_path is not None:
                    body: dict[str, Any] = {"model_path": model_path, "weight_version": str(version)}
                    if load_format is not None:
                        body["load_format"] = load_format
                    steps["weights"] = self._each_engine(
                        "/update_weights_from_disk", body, ENGINE_UPDATE_TIMEOUT_S
                    )
                else:
                    assert update is not None
                    update(list(self.engine_urls))
                    steps["weights"] = self._each_engine(
                        "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
                    )
                steps["model_version"] = self.set_model_version(version)
            finally:
                steps["engines_continued"] = self.continue_engines()
        finally:
            steps["proxies_resumed"] = self.resume()
        return steps


def to_torch(
    batches: Sequence[PulledBatch],
    *,
    pad_token_id: int = 0,
    device: str | None = None,
    images: bool = False,
    image_processor: Any = None,
    routed_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """All trajectories of `batches` as right-padded tensors, in batch order:

    input_ids [B, T] int64 (padded with `pad_token_id`), attention_mask [B, T] bool, loss_mask
    [B, T] bool, logprobs [B, T] float32, versions [B, T] int64 (-1 on prompt tokens and padding),
    rewards [B] float32 (NaN where no reward was set), seq_lens [B] int64, group_ids [B] int64
    (rows sampled from the same prompt by one call, e.g. a GRPO group of n, share a group id; every
    other row has its own). Per-trajectory ids, metadata and tree places:
    `PulledBatch.trajectories()`, in the same order.

    With `images` (a vision-language model's batches; needs transformers and Pillow), also the
    model's image inputs, rebuilt from the exported image bytes by transformers' image processor
    with the exported `preprocessor_config.json` (or `image_processor`, your own): pixel_values
    [patches, C * temporal_patch * patch**2] float32 and image_grid_thw [I, 3] int64 of every image
    of every row, row by row in prompt order (what Qwen-VL models take), and image_counts [B] int64
    (images per row). Each image's grid is checked against the one the engine expanded it by.

    With `routed_experts` (routing replay of a mixture-of-experts model's batches), also
    routed_experts [B, T, layers, top_k] (uint8 when the expert count fits, else int32: torch's
    unsigned 16- and 32-bit types index nothing) with the experts each token was routed to, aligned
    with input_ids, and routed_experts_mask [B, T] bool, True where a row was recorded: every token
    but a trajectory's last (it was never forwarded), none of a trajectory recorded without routing.
    """
    import torch  # lazily: the proxy process never imports this module, but keep it torch-free anyway

    decoded = [b.decoded for b in batches]
    lengths = np.concatenate([np.diff(d.tensors["cu_seqlens"]) for d in decoded]) if decoded else np.zeros(0)
    rows, width = len(lengths), int(lengths.max()) if len(lengths) else 0
    out = {
        "input_ids": np.full((rows, width), pad_token_id, np.int64),
        "attention_mask": np.zeros((rows, width), np.bool_),
        "loss_mask": np.zeros((rows, width), np.bool_),
        "logprobs": np.zeros((rows, width), np.float32),
        "versions": np.full((rows, width), -1, np.int64),
    }
    row = 0
    for d in decoded:
        t, cu = d.tensors, d.tensors["cu_seqlens"]
        for i in range(d.num_trajectories):
            start, end = int(cu[i]), int(cu[i + 1])
            n = end - start
            out["input_ids"][row, :n] = t["input_ids"][start:end]
            out["attention_mask"][row, :n] = True
            out["loss_mask"][row, :n] = t["loss_mask"][start:end].astype(bool)
            out["logprobs"][row, :n] = t["logprobs"][start:end]
            out["versions"][row, :n] = t["versions"][start:end]
            row += 1
    tensors = {name: torch.from_numpy(array) for name, array in out.items()}
    tensors["rewards"] = torch.from_numpy(
        np.concatenate([d.tensors["rewards"] for d in decoded]) if decoded else np.zeros(0, np.float32)
    )
    tensors["seq_lens"] = torch.from_numpy(lengths.astype(np.int64))
    groups: dict[tuple, int] = {}
    group_ids = []
    for d in decoded:
        for i, info in enumerate(d.header["trajectories"]):
            sample = info.get("sample") or {}
            call = sample.get("call")
            key = (info["session_id"], call) if call is not None else (d.batch_id, i)
            group_ids.append(groups.setdefault(key, len(groups)))
    tensors["group_ids"] = torch.tensor(group_ids, dtype=torch.int64)
    if images:
        tensors.update(image_inputs(decoded, image_processor))
    if routed_experts:
        tensors.update(routing_inputs(decoded, width))
    if device is not None:
        tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
    return tensors


def routing_inputs(decoded: Sequence[DecodedBatch], width: int) -> dict[str, torch.Tensor]:
    """`to_torch`'s routed_experts and routed_experts_mask, right-padded to `width` tokens."""
    import torch

    shapes = {d.routing for d in decoded if d.routing is not None}
    if len(shapes) != 1:
        raise ValueError(f"the batches hold routing of {len(shapes)} shapes (one is needed): {shapes}")
    (shape,) = shapes
    dtype = np.uint8 if shape.dtype == np.uint8 else np.int32
    rows = sum(d.num_trajectories for d in decoded)
    experts = np.zeros((rows, width, shape.layers, shape.top_k), dtype)
    mask = np.zeros((rows, width), np.bool_)
    row = 0
    for d in decoded:
        for i in range(d.num_trajectories):
            routed = d.routed_experts(i) if d.routing is not None else ()
            experts[row, : len(routed)] = routed
            mask[row, : len(routed)] = True
            row += 1
    return {"routed_experts": torch.from_numpy(experts), "routed_experts_mask": torch.from_numpy(mask)}


def image_inputs(decoded: Sequence[DecodedBatch], image_processor: Any = None) -> dict[str, torch.Tensor]:
    """pixel_values, image_grid_thw and image_counts of the batches' rows (see `to_torch`). Each
    distinct image of a batch is processed once, however many of its rows repeat it."""
    import torch

    pixel_values: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    counts: list[int] = []
    for batch in decoded:
        processor = image_processor
        if processor is None and len(batch.tensors["image_refs"]):
            processor = exported_image_processor(batch)
        processed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        refs = batch.tensors["image_refs"]
        for row in range(batch.num_trajectories):
            span = batch.image_range(row)
            counts.append(len(span))
            for k in span:
                distinct = int(refs[k])
                if distinct not in processed:
                    processed[distinct] = process_image(processor, batch.image_bytes(k))
                values, grid = processed[distinct]
                exported = batch.tensors["image_grid_thw"][k].tolist()
                check_grid(grid, exported, f"batch {batch.batch_id}: image {k}")
                pixel_values.append(values)
                grids.append(grid)
    return {
        "pixel_values": torch.cat(pixel_values) if pixel_values else torch.zeros((0, 0), dtype=torch.float32),
        "image_grid_thw": torch.stack(grids) if grids else torch.zeros((0, 3), dtype=torch.int64),
        "image_counts": torch.tensor(counts, dtype=torch.int64),
    }


def check_grid(grid: torch.Tensor, expanded_by: Sequence[int], what: str) -> None:
    """The grid the processor made of an image must be the one the engine expanded it by."""
    if grid.tolist() != list(expanded_by):
        raise ValueError(
            f"{what}: the image processor makes a {tuple(grid.tolist())} grid; the engine expanded it by "
            f"{tuple(expanded_by)}: another processor configuration than the engine's"
        )


def process_image(processor: Any, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's pixel_values and (t, h, w) grid, as the processor makes them of its RGB pixels."""
    import io

    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as opened:
        rgb = opened.convert("RGB")
    out = processor(images=[rgb], return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"][0].to(torch.int64)


_PROCESSORS: dict[str, Any] = {}


def exported_image_processor(batch: DecodedBatch) -> Any:
    """transformers' image processor for the batch's exported `preprocessor_config.json` (one per
    distinct configuration, kept for the process's life)."""
    vision = batch.vision
    if not vision or not isinstance(vision.get("processor_config"), dict):
        raise ValueError(f"batch {batch.batch_id} has images but no processor configuration")
    return image_processor_for(vision["processor_config"])


def image_processor_for(config: dict[str, Any]) -> Any:
    """transformers' image processor for a `preprocessor_config.json` document (one per distinct
    configuration, kept for the process's life)."""
    key = json.dumps(config, sort_keys=True)
    if key not in _PROCESSORS:
        from transformers import AutoImageProcessor

        with tempfile.TemporaryDirectory() as directory:
            (Path(directory) / "preprocessor_config.json").write_text(key)
            _PROCESSORS[key] = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    return _PROCESSORS[key]


__all__ = [
    "PAUSE_MODES",
    "EngineCallError",
    "ProxyCallError",
    "ProxyRequestError",
    "PulledBatch",
    "TrainerClient",
    "to_torch",
]
