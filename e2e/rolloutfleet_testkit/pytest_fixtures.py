"""Fixtures shared by the unit suite (tests/) and the e2e suite (e2e/tests/), loaded by both through
pytest's `-p rolloutfleet_testkit.pytest_fixtures` (pyproject.toml's addopts): two test trees, one
definition of the test tokenizer and the session-wide SGLang emulator."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import pytest

from rolloutfleet_testkit.processes import serve_app

# Nothing in the tests may reach a model hub; a hub lookup must fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    # Like promtool's tests, these build their Go binary on first use (cached per version).
    config.addinivalue_line(
        "markers", "registry: builds (Go module proxy, cached) and runs the OCI distribution registry"
    )


@pytest.fixture(scope="session")
def test_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The locally built test tokenizer, built once per test session."""
    from rolloutfleet_testkit.tokenizer_builder import build_test_tokenizer

    return build_test_tokenizer(tmp_path_factory.mktemp("test-tokenizer"))


@pytest.fixture(scope="session")
def sglang_emulator_url(test_tokenizer_dir: pathlib.Path) -> Iterator[str]:
    """Base URL of an SGLang emulator (weights of seed 0, no delay) served for the whole test session,
    started as with SGLang's --enable-deterministic-inference so that sampling_seed counts."""
    from rolloutfleet_testkit.sglang_emulator.server import create_app

    with serve_app(create_app(str(test_tokenizer_dir), seed=0, deterministic_inference=True)) as url:
        yield url
