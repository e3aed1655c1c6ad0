"""The adapters' shared pieces that need no server: an export sample read as an Episode, and where
the fleet is found."""

from __future__ import annotations

import pytest
from rolloutfleet_client.adapters import FleetConfig, episode_from_sample

# Two turns: prompt [1, 2, 3], generated [10, 11], the user's next turn [4, 5], generated [12].
SAMPLE = {
    "session_id": "s-1",
    "metadata": {"task": "t"},
    "input_ids": [1, 2, 3, 10, 11, 4, 5, 12],
    "loss_mask": [0, 0, 0, 1, 1, 0, 0, 1],
    "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0],
    "versions": [-1, -1, -1, 3, 3, -1, -1, 4],
    "reward": 0.5,
    "turn_bounds": [[0, 3, 5], [5, 7, 8]],
    "turn_finishes": ["stop", "length"],
}


def test_a_sample_splits_at_its_first_generated_token():
    episode = episode_from_sample(SAMPLE)
    assert episode.prompt_ids == [1, 2, 3] and episode.response_ids == [10, 11, 4, 5, 12]
    assert episode.response_mask == [1, 1, 0, 0, 1]
    assert episode.response_logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert episode.versions == [3, 3, -1, -1, 4] and episode.weight_versions == [3, 4]
    assert episode.tokens == SAMPLE["input_ids"] and episode.num_turns == 2
    assert episode.truncated and not episode.aborted and episode.reward == 0.5


def test_a_batch_without_finishes_reads_them_as_unknown_and_an_empty_session_has_no_response():
    older = {k: v for k, v in SAMPLE.items() if k != "turn_finishes"}
    assert episode_from_sample(older).finishes == ["unknown", "unknown"]
    assert not episode_from_sample(older).truncated
    empty = {**SAMPLE, "input_ids": [], "loss_mask": [], "logprobs": [], "versions": [], "turn_bounds": []}
    episode = episode_from_sample({**empty, "turn_finishes": []})
    assert episode.prompt_ids == episode.response_ids == [] and episode.num_turns == 0


def test_the_fleet_is_found_from_the_environment():
    config = FleetConfig.from_env(
        {"ROLLOUTFLEET_ADMIN_KEY": "k", "ROLLOUTFLEET_ENDPOINTS": "http://a:8000, http://b:8000"}
    )
    assert config.endpoints == ["http://a:8000", "http://b:8000"] and config.client_url is None
    assert "k" not in repr(config)  # the admin key is a secret
    service = FleetConfig.from_env({"ROLLOUTFLEET_ADMIN_KEY": "k", "ROLLOUTFLEET_CLIENT_URL": "http://svc"})
    assert service.client_url == "http://svc" and service.endpoints is None


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"ROLLOUTFLEET_ENDPOINTS": "http://a"}, "ROLLOUTFLEET_ADMIN_KEY"),
        ({"ROLLOUTFLEET_ADMIN_KEY": "k"}, "one of"),
        (
            {
                "ROLLOUTFLEET_ADMIN_KEY": "k",
                "ROLLOUTFLEET_ENDPOINTS": "http://a",
                "ROLLOUTFLEET_CLIENT_URL": "x",
            },
            "one of",
        ),
    ],
)
def test_a_missing_or_ambiguous_fleet_is_a_clear_error(env, says):
    with pytest.raises(ValueError, match=says):
        FleetConfig.from_env(env)
