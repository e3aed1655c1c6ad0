"""Proxy settings: the single source of truth for CLI flags and environment variables.

The operator injects some of these settings into proxy pods; which ones, and the variables' names,
are the contract in rolloutfleet_wire.proxy_settings, which this model must satisfy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from rolloutfleet_wire import fleet_defaults as fleet
from rolloutfleet_wire.proxy_settings import ENV_PREFIX, INJECTED_SETTINGS
from rolloutfleet_wire.proxy_settings import env_var_name as contract_env_var_name

from .images import DEFAULT_FORMATS, KNOWN_FORMATS, ImageLimits


class ProxySettings(BaseSettings):
    """Configuration of one proxy process (CLI flag > environment variable > default)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_prog_name="rolloutfleet-proxy",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="forbid",
    )

    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    upstream_url: str = Field(description="SGLang gateway or engine base URL (serves /generate).")
    tokenizer_path: str = Field(description="Local directory of the Hugging Face tokenizer.")
    admin_key: SecretStr = Field(description="Bearer key for admin routes (creating sessions, listing).")
    model_name: str = Field("rolloutfleet", description="Model name reported in OpenAI responses.")
    tool_call_parser: str | None = Field(
        None,
        description="SGLang --tool-call-parser name: tool calls in replies become OpenAI tool_calls "
        "(qwen25, llama3, deepseekv3, gpt-oss, glm45, kimi_k2). Unset: requests with tools are refused.",
    )
    reasoning_parser: str | None = Field(
        None,
        description="SGLang --reasoning-parser name: the reasoning part of a reply becomes "
        "message.reasoning_content (qwen3, deepseek-r1, ...). Unset: reasoning stays in content.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='Default chat template keywords (JSON object, e.g. {"enable_thinking": false}); '
        "a request's chat_template_kwargs override them key by key.",
    )
    routed_experts: bool = Field(
        fleet.PROXY_ROUTED_EXPERTS,
        description="Routing replay (R3) for mixture-of-experts models: ask SGLang for the experts every "
        "token was routed to, keep them on the dump volume and export them with the tokens. The engines "
        "need --enable-return-routed-experts and the gateway must pass return_routed_experts "
        "(sglang-router 0.3.2 drops it); the shape is read from config.json in the tokenizer (model) "
        "directory. A turn whose answer lacks routing fails with 502 upstream_routing_missing.",
    )
    public_url: str | None = Field(
        None, description="This proxy's own stable URL, returned with new sessions (per-pod DNS name)."
    )

    upstream_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Timeout of one upstream /generate call (sglang-router's own default is 1800 s; a "
        "shorter one gives up on long generations the router still runs).",
    )
    engine_logprobs: Literal["tempered", "original"] = Field(
        fleet.PROXY_ENGINE_LOGPROBS,
        description="What the engines' logprobs are: 'tempered' (SGLang's default: log_softmax(logits / "
        "temperature) when sampling) or 'original' (engines run with SGLANG_RETURN_ORIGINAL_LOGPROB=1). "
        "Recorded per turn in exports, so the trainer knows which it got.",
    )
    upstream_max_connections: int = Field(1024, ge=1, description="Connection pool size to the upstream.")
    default_max_tokens: int = Field(1024, ge=1, description="max_new_tokens when a request sets none.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest accepted request body.")
    max_metadata_bytes: int = Field(4096, ge=0, description="Largest accepted session metadata (JSON).")
    max_request_bytes_in_flight: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Request body bytes all requests being handled may hold at once; beyond it requests get "
        "503 request_budget_exhausted with Retry-After (bounds what many large bodies at once cost).",
    )
    max_new_message_bytes: int = Field(
        512 * 1024,
        ge=1024,
        description="Largest text of the new messages of one turn (what is templated and tokenized); "
        "beyond it the turn gets 400 new_messages_too_large. Tokenizing costs ~500 bytes of transient "
        "memory per token: at 512 KiB a turn peaks ~75-95 MiB above rest.",
    )
    offload_templating_bytes: int = Field(
        32 * 1024,
        ge=0,
        description="New-message text from which templating and tokenizing run in a worker thread, so "
        "the event loop keeps serving other sessions (smaller turns run inline: a thread hop costs more).",
    )

    max_image_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest image (decoded bytes) a message may carry; beyond it 400 image_too_large.",
    )
    max_request_image_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Most image bytes (decoded) of one request, its history's images included; beyond it "
        "400 image_too_large. With a vision-language model the body limit grows by its base64 size "
        "(4/3 of it) over max_body_bytes.",
    )
    image_formats: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FORMATS),
        description="Image formats taken (Pillow's names in lower case: png, jpeg, webp, gif, bmp, tiff); "
        "others get 400 invalid_image.",
    )
    fetch_image_urls: bool = Field(
        False,
        description="Fetch http(s) image URLs (off: a rollout must be reproducible, so such images get "
        "400 unsupported_content; send data URIs or base64).",
    )

    max_branches_per_session: int = Field(
        256,
        ge=1,
        description="Branches (leaves of the session's tree: regenerations, compactions, sub-agents, "
        "group samples) a session may hold; a turn that would add more gets 409 too_many_branches.",
    )
    abort_ride_through_s: float = Field(
        600.0,
        gt=0,
        description="How long a turn whose generation the engine keeps aborting (a trainer aborting "
        "SGLang around a weight update, or pausing it) resubmits it, backing off while aborts make no "
        "token, before it fails with 503 upstream_aborted; longer than a weight update takes.",
    )
    max_samples: int = Field(
        16,
        ge=1,
        le=128,
        description="Largest n (samples of one prompt, a GRPO group) a chat request may ask.",
    )

    cleanup_enabled: bool = Field(True, description="Dump and evict sessions idle past the timeout.")
    stale_session_timeout_s: float = Field(
        float(fleet.PROXY_STALE_SESSION_TIMEOUT_SECONDS),
        gt=0,
        description="Idle time after which a session is stale.",
    )
    cleanup_interval_s: float = Field(
        float(fleet.PROXY_CLEANUP_INTERVAL_SECONDS),
        gt=0,
        description="Time between stale-session cleanup cycles.",
    )
    # Unlike the fleet's proxy.dump.path, no default on purpose: a standalone proxy has no dump volume
    # unless given one, and the operator gives each of a fleet's proxies its own `<path>/<pod>`.
    dump_dir: Path | None = Field(None, description="Directory for session dumps (stale/ and live/ areas).")
    allow_dropping_sessions: bool = Field(
        False,
        description="Without a dump directory, drop stale and drained sessions instead of refusing to start.",
    )
    dump_write_concurrency: int = Field(8, ge=1, le=64, description="Dump files written in parallel.")
    durability: Literal["sync", "async"] = Field(
        fleet.PROXY_DUMP_DURABILITY,
        description="'sync': a change (session created, turn, reward, finish, delete, export) is fsynced "
        "to the journal before the client hears of it; 'async': replies do not wait, and a crash loses at "
        "most the last journal_flush_interval_s of acknowledged changes.",
    )
    journal_flush_interval_s: float = Field(
        0.05,
        gt=0,
        le=10,
        description="With durability 'async': the longest time a change waits for its sync.",
    )
    journal_compact_bytes: int = Field(
        256 * 1024 * 1024,
        ge=4096,
        description="Journal size at which it is compacted into per-session snapshots (bounds restart time).",
    )
    storage_check_interval_s: float = Field(
        5.0, gt=0, description="Interval of the dump volume's write probe (1 s while it is failing)."
    )
    drain_grace_s: float = Field(
        float(fleet.PROXY_DRAIN_GRACE_SECONDS),
        ge=0,
        description="On SIGTERM, how long in-flight turns may finish.",
    )
    trim_heap: bool = Field(
        True, description="Return freed heap pages to the OS (malloc_trim) after cleanup."
    )
    heartbeat_interval_s: float = Field(60.0, gt=0, description="Interval of the stats heartbeat log line.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_requests: bool = Field(True, description="One structured log line per request.")
    tombstone_capacity: int = Field(
        10000,
        ge=0,
        description="Recently ended session ids remembered, so late calls get 410 instead of 404.",
    )

    export_ttl_s: float = Field(
        float(fleet.PROXY_EXPORT_TTL_SECONDS),
        gt=0,
        description="How long an exported batch waits for the trainer's ack before it is dumped and freed.",
    )
    paused_turn_timeout_s: float = Field(
        300.0, gt=0, description="How long a turn waits while generation is paused before it gets 503."
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Off-policy bound in model versions for admitting new sessions (unset: no bound).",
    )
    staleness_batch_share: int = Field(
        1, ge=1, description="This proxy's share of the trainer's batch size (batch / replicas rounded up)."
    )
    max_concurrent_sessions: int = Field(
        fleet.PROXY_ADMISSION_MAX_CONCURRENT_SESSIONS,
        ge=0,
        description="Most running (created, unfinished) sessions admitted at once (0: unlimited).",
    )
    rss_soft_limit_bytes: int = Field(
        0, ge=0, description="RSS from which new sessions get 503, so load shifts to siblings (0: off)."
    )

    @field_validator("image_formats")
    @classmethod
    def _known_image_formats(cls, formats: list[str]) -> list[str]:
        names = [name.strip().lower() for name in formats]
        unknown = sorted(set(names) - KNOWN_FORMATS)
        if unknown or not names:
            raise ValueError(f"image formats must be among {sorted(KNOWN_FORMATS)}, got {formats}")
        return names

    def body_limit(self, takes_images: bool) -> int:
        """The largest request body: with images, room for the request's images in base64 as well."""
        if not takes_images:
            return self.max_body_bytes
        return self.max_body_bytes + (self.max_request_image_bytes + 2) // 3 * 4

    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            self.max_image_bytes,
            self.max_request_image_bytes,
            frozenset(self.image_formats),
            self.fetch_image_urls,
        )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, name: str | None) -> str | None:
        if name is not None:
            from .tool_parsers import tool_call_parser  # raises ValueError naming the known parsers

            tool_call_parser(name)
        return name

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        if name is not None:
            from .reasoning_parsers import reasoning_parser  # raises ValueError naming the known parsers

            reasoning_parser(name)
        return name

    @model_validator(mode="after")
    def _refuse_silent_data_loss(self) -> ProxySettings:
        if self.dump_dir is None and not self.allow_dropping_sessions:
            raise ValueError(
                f"no dump directory: set {env_var_name('dump_dir')} (--dump-dir) so stale and drained "
                "sessions are written before they are dropped, or set "
                f"{env_var_name('allow_dropping_sessions')} (--allow-dropping-sessions) to drop them"
            )
        return self


def env_var_name(field: str) -> str:
    """The environment variable that sets `field` (raises KeyError for unknown fields)."""
    if field not in ProxySettings.model_fields:
        raise KeyError(f"unknown proxy setting {field!r}")
    return contract_env_var_name(field)


ENV: dict[str, str] = {field: env_var_name(field) for field in ProxySettings.model_fields}

_uncontracted = sorted({setting.name for setting in INJECTED_SETTINGS} - set(ProxySettings.model_fields))
if _uncontracted:  # the operator would inject variables this proxy ignores (extra="forbid" refuses them)
    raise ImportError(f"proxy settings lack the injected settings {_uncontracted}")


def effective_settings(settings: ProxySettings) -> dict[str, object]:
    """The settings the process runs with, as JSON values, the admin key left out: lets an operator
    (or a person) check that what it injected is what the proxy uses."""
    return settings.model_dump(mode="json", exclude={"admin_key"})


def load_settings(argv: list[str] | None = None) -> ProxySettings:
    """Settings from CLI arguments (if given) and the environment."""
    if argv is None:
        return ProxySettings()
    return ProxySettings(_cli_parse_args=argv)
