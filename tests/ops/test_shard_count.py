"""The shard count of SPEC §9.3 and the operational settings added to §9.1."""

from __future__ import annotations

import pydantic
import pytest

from tgis.config import DEFAULT_SHUTDOWN_GRACE_SECONDS, Settings, shard_count


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.mark.parametrize(
    ("settings", "environ", "expected"),
    [
        ({}, {}, 1),
        ({"num_gpus": 4}, {"CUDA_VISIBLE_DEVICES": "0,1"}, 4),
        ({"num_shard": 2}, {}, 2),
        ({"num_gpus": 2, "num_shard": 2}, {}, 2),
        ({}, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3),
        ({}, {"CUDA_VISIBLE_DEVICES": "3"}, 1),
        ({}, {"CUDA_VISIBLE_DEVICES": ""}, 1),  # as in TGIS: an empty list still counts one entry
        ({}, {"NVIDIA_VISIBLE_DEVICES": "0,1"}, 2),
        ({}, {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "0,1,2,3"}, 1),
        ({}, {"NVIDIA_VISIBLE_DEVICES": "all"}, 1),
    ],
)
def test_shard_count_rules(settings: dict, environ: dict[str, str], expected: int) -> None:
    assert shard_count(Settings(**settings), environ) == expected


def test_num_gpus_and_num_shard_must_agree() -> None:
    with pytest.raises(pydantic.ValidationError, match="NUM_GPUS and num_shard are set to different values"):
        Settings(num_gpus=2, num_shard=4)


def test_shard_count_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUM_GPUS", "0")
    with pytest.raises(pydantic.ValidationError):
        Settings()


def test_shutdown_grace_defaults_inside_the_pod_grace_and_reads_its_env_var(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().shutdown_grace_seconds == DEFAULT_SHUTDOWN_GRACE_SECONDS < 120
    monkeypatch.setenv("SHUTDOWN_GRACE_SECONDS", "12.5")
    assert Settings().shutdown_grace_seconds == 12.5


@pytest.mark.parametrize("given", ["INFO", "warn", "trace", "warn,tower=error", "loud"])
def test_log_level_is_kept_as_given_and_parsed_when_logging_is_configured(given: str) -> None:
    """A bad LOG_LEVEL no longer stops the start: tgis.log_filter falls back to info with a warning."""
    assert Settings(log_level=given).log_level == given
