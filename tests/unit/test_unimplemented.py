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


@pytest.mark.parametrize("name", ISSUE_LIST)
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


def test_the_migration_table_lists_every_tgis_setting() -> None:
    """Each unimplemented setting, and every Settings field, appears in docs/migrating-from-tgis.md's
    table of TGIS settings."""
    from pathlib import Path

    from tgis.config import Settings

    page = (Path(__file__).parents[2] / "docs" / "migrating-from-tgis.md").read_text()
    section = page.split("## Every TGIS setting", 1)[1].split("\n## ", 1)[0]
    tgis_settings = [*UNIMPLEMENTED_TGIS_SETTINGS, "OTLP_SERVICE_NAME", "SHARD_UDS_PATH"]
    # The settings this server added (no TGIS counterpart) are in the configuration table instead.
    added_here = {"CPU_MEMORY_BUDGET_MB", "KV_BLOCK_SIZE", "MAX_STEP_TOKENS", "PREFIX_CACHING",
                  "SHUTDOWN_GRACE_SECONDS", "TRANSFORMERS_ATTN_IMPL", "OTEL_SERVICE_NAME",
                  "PROMPT_CACHE_SIZE_MB", "NUM_SHARD", "API_KEY", "SERVED_MODEL_NAME",
                  "HTTP_MAX_BODY_BYTES", "HTTP_REQUEST_TIMEOUT", "HTTP_TLS",
                  "REQUIRE_MODEL_NAME", "WATERMARK_GAMMA", "WATERMARK_DELTA",
                  "SPECULATOR_TOKENS", "CUDA_GRAPHS", "HTTP_GENERATION_ROUTES", "HTTP_GENERATION_PORT",
                  "ALLOW_TF32", "QUANTIZE_GROUP_SIZE", "GENERATION_CONFIG",
                  "ALLOW_RUNTIME_LORA_UPDATING"}  # fmt: skip
    fields = [name.upper() for name in Settings.model_fields if name.upper() not in added_here]
    missing = []
    for name in [*tgis_settings, *fields]:
        stem = name.removesuffix("*")
        listed = f"`{name}`" in section or (stem != name and stem in section)
        grouped = name.startswith("ESTIMATE_MEMORY") and "`ESTIMATE_MEMORY*`" in section
        if not (listed or grouped):
            missing.append(name)
    assert missing == []


def test_the_configuration_reference_lists_every_setting() -> None:
    """Every Settings field has its own row in docs/configuration.md's table."""
    from pathlib import Path

    from tgis.config import Settings

    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    table = page.split("## Every setting", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    missing = [
        name.upper()
        for name in Settings.model_fields
        if not any(f"`{name.upper()}`" in row.split(" | ", 1)[0] for row in rows)
    ]
    assert missing == []


def test_speculator_settings_are_implemented_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.unimplemented"):
        warn_unimplemented({"SPECULATOR_NAME": "ngram", "SPECULATOR_MAX_BATCH_SIZE": "8"})
    assert caplog.records == []
