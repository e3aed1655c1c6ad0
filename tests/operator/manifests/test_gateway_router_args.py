"""The gateway's command line as sglang-router 0.3.2 itself reads it: the router's own argument parser
(`sglang_router.launch_router.parse_router_args`, what `python -m sglang_router.launch_router` runs)
parses the arguments the operator generates, so a misspelled flag or a value the router refuses
fails here, and every spec setting arrives as the router's setting of the same meaning."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest
from fleet_samples import GPU, MINIMAL, sample
from rolloutfleet_operator.fleet import labels, parse_fleet
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.gateway import gateway_deployment
from sglang_router.launch_router import parse_router_args
from sglang_router.router_args import RouterArgs


def _container(fleet) -> dict[str, Any]:
    (container,) = gateway_deployment(fleet)["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python3", "-m", "sglang_router.launch_router"]
    return container


def _router_args(fleet) -> RouterArgs:
    parsed = parse_router_args(_container(fleet)["args"])
    parsed._validate_router_args()  # what launch_router checks before starting
    return parsed


def _with_gateway(gateway: dict[str, Any]):
    raw = sample("gpu")
    raw["spec"]["gateway"] = {**copy.deepcopy(raw["spec"].get("gateway") or {}), **gateway}
    return parse_fleet(raw)


def test_every_flag_is_one_the_router_declares_in_full():
    """argparse takes a flag's unambiguous prefix too: the args must name each flag in full, as the
    router declares it, so a later router with a longer flag of the same prefix cannot steal it."""
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    declared = set(parser._option_string_actions)
    for fleet in (GPU, MINIMAL, _with_gateway({"tracing": {"otlpEndpoint": "otel:4317"}})):
        flags = [arg for arg in _container(fleet)["args"] if arg.startswith("--")]
        assert flags and set(flags) <= declared, set(flags) - declared


def test_the_defaults_reach_the_router():
    args = _router_args(GPU)
    assert args.policy == "manual" and args.assignment_mode == "min_load"  # miles' default
    assert (args.retry_max_retries, args.retry_initial_backoff_ms, args.retry_max_backoff_ms) == (
        5,
        50,
        30000,
    )
    assert (args.retry_backoff_multiplier, args.retry_jitter_factor) == (1.5, 0.2)
    assert (args.cb_failure_threshold, args.cb_success_threshold) == (10, 3)
    assert (args.cb_timeout_duration_secs, args.cb_window_duration_secs) == (60, 120)
    assert not args.disable_circuit_breaker and not args.enable_trace
    assert args.service_discovery and args.selector == labels(GPU, "engine")
    assert args.service_discovery_namespace == GPU.namespace
    assert args.service_discovery_port == GPU.engines.port
    assert (args.port, args.prometheus_port) == (GPU.gateway.port, GPU.gateway.metrics_port)


def test_the_spec_settings_reach_the_router():
    fleet = _with_gateway(
        {
            "assignmentMode": "min_group",
            "retries": {
                "maxRetries": 2,
                "initialBackoffMillis": 100,
                "maxBackoffMillis": 2000,
                "backoffMultiplier": 2.0,
                "jitterFactor": 0.5,
            },
            "circuitBreaker": {
                "failureThreshold": 4,
                "successThreshold": 1,
                "timeoutSeconds": 15,
                "windowSeconds": 30,
            },
            "tracing": {"otlpEndpoint": "otel-collector.monitoring:4317"},
        }
    )
    args = _router_args(fleet)
    assert args.assignment_mode == "min_group"
    assert (args.retry_max_retries, args.retry_initial_backoff_ms, args.retry_max_backoff_ms) == (
        2,
        100,
        2000,
    )
    assert (args.retry_backoff_multiplier, args.retry_jitter_factor) == (2.0, 0.5)
    assert (args.cb_failure_threshold, args.cb_success_threshold) == (4, 1)
    assert (args.cb_timeout_duration_secs, args.cb_window_duration_secs) == (15, 30)
    assert args.enable_trace and args.otlp_traces_endpoint == "otel-collector.monitoring:4317"


def test_a_disabled_circuit_breaker_is_the_routers_flag():
    assert _router_args(_with_gateway({"circuitBreaker": {"enabled": False}})).disable_circuit_breaker


def test_external_engines_are_the_routers_worker_urls():
    args = _router_args(MINIMAL)
    assert args.worker_urls == list(MINIMAL.external_engine_urls) and not args.service_discovery


def test_a_misspelled_flag_fails_the_routers_parser():
    """The check above can fail: the router's parser refuses what it does not declare."""
    with pytest.raises(SystemExit):
        parse_router_args([*_container(GPU)["args"], "--assignment-modes", "min_load"])


def test_the_gateway_has_a_disruption_budget():
    (budget,) = [
        c
        for c in desired_children(GPU)
        if c["kind"] == "PodDisruptionBudget" and c["metadata"]["name"] == f"{GPU.name}-gateway"
    ]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels(GPU, "gateway")}}
    held = [
        c
        for c in desired_children(_with_gateway({"maxUnavailable": 0}))
        if c["kind"] == "PodDisruptionBudget" and c["metadata"]["name"] == f"{GPU.name}-gateway"
    ]
    assert held[0]["spec"]["maxUnavailable"] == 0
