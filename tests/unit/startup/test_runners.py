"""The runners' startup choices that need no model: how far PT2_COMPILE's warm-up may go."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from tgis.config import ServingLimits
from tgis.startup.runners import warm_up_length


def engine_with(model_config: dict[str, Any]) -> Any:
    return cast(Any, SimpleNamespace(spec=SimpleNamespace(model_config=model_config)))


@pytest.mark.parametrize(
    ("served", "model_config", "expected"),
    [
        (1024, {"n_positions": 128}, 128),  # MAX_SEQUENCE_LENGTH above the model's positions: only warned
        (64, {"n_positions": 128}, 64),  # the served limit below them
        (4096, {"max_position_embeddings": 8192}, 4096),
        (4096, {}, 2048),  # no key: SPEC §9.2's default stands for the model's positions
    ],
)
def test_the_warm_up_stays_within_the_models_positions(
    served: int, model_config: dict[str, Any], expected: int
) -> None:
    """A warm-up step past the model's positions failed the startup (GPT-2's position table raised an
    IndexError) where MAX_SEQUENCE_LENGTH was set above them, which the SPEC allows with a warning."""
    limits = ServingLimits(max_sequence_length=served, max_new_tokens=served - 1)
    assert warm_up_length(limits, engine_with(model_config)) == expected
