"""Unimplemented TGIS settings: each one set is accepted with one warning naming its effect."""

from __future__ import annotations

import logging

import pytest

from tgis.unimplemented import UNIMPLEMENTED_TGIS_SETTINGS, warn_unimplemented

ISSUE_LIST = (
    "GPTQ_CUDA_TYPE",
    "EXLLAMA_VERSION",
    "DISABLE_EXLLAMA",
    "FP32_LOGITS_PROCESS",
    "LOG_GPU_USAGE_INTERVAL",
    "CUDA_PAD_TO_MULT_OF_8",
    "COMPACT_BEFORE_PREFILL",
    "BLOOM_SLOW_BUT_EXACT",
    "OPTIMIZE_ONNX_MODEL",
    "MERGE_ONNX_GRAPHS",
    "DISABLE_CUSTOM_KERNELS",
)


@pytest.mark.parametrize("name", (*ISSUE_LIST, "SPECULATOR_NAME", "SPECULATOR_N_CANDIDATES"))
def test_each_unimplemented_setting_warns_once_with_its_effect(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.unimplemented"):
        warn_unimplemented({name: "x", "MODEL_NAME": "m"})
    assert len(caplog.records) == 1
    message = caplog.messages[0]
    assert message.startswith(f"{name}=x is accepted but not implemented by this server: ")
    assert len(message.split(": ", 1)[1]) > 10  # an effect, not just a name


def test_every_listed_setting_is_known() -> None:
    assert set(ISSUE_LIST) <= set(UNIMPLEMENTED_TGIS_SETTINGS)


def test_nothing_set_means_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.unimplemented"):
        warn_unimplemented({"MODEL_NAME": "m", "CUDA_PAD_TO_MULT_OF_8": ""})
    assert caplog.records == []
