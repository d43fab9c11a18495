"""QUANTIZE is served through the checkpoint's quantization_config, or refused at start with why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgis.config import Settings, StartupError
from tgis.quantization import check_quantization

GPTQ_CONFIG = {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}


def _check(quantize: str | None, model_config: dict, *, cuda: bool = True, installed: bool = True) -> None:
    check_quantization(
        quantize,
        framework="hf_transformers",
        model_config=model_config,
        cuda=cuda,
        installed=lambda name: installed,
    )


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "GPTQ"])
def test_a_matching_checkpoint_is_passed_through(method: str) -> None:
    config = {"quantization_config": {"quant_method": method.lower()}}
    _check(method, config)  # no error: transformers loads the checkpoint's own quantization


def test_unset_leaves_the_checkpoint_to_transformers() -> None:
    _check(None, GPTQ_CONFIG, cuda=False, installed=False)


def test_unknown_method_names_the_spec_error_and_what_works() -> None:
    with pytest.raises(StartupError) as error:
        _check("fp4x", GPTQ_CONFIG)
    assert str(error.value).startswith("fp4x quantization not supported by hf_transformers engine. ")
    assert "gptq, awq or bitsandbytes" in str(error.value)


def test_other_engines_refuse() -> None:
    with pytest.raises(StartupError, match=r"^gptq quantization not supported by hf_optimum_ort engine"):
        check_quantization("gptq", framework="hf_optimum_ort", model_config=GPTQ_CONFIG, cuda=True)


def test_unquantized_checkpoint_is_refused_not_ignored() -> None:
    with pytest.raises(
        StartupError, match=r"^QUANTIZE=bitsandbytes: the checkpoint has no quantization_config"
    ):
        _check("bitsandbytes", {"model_type": "gpt2"})


def test_mismatched_method_is_refused() -> None:
    with pytest.raises(StartupError) as error:
        _check("awq", GPTQ_CONFIG)
    assert str(error.value) == (
        "QUANTIZE=awq but the checkpoint is quantized with gptq: set QUANTIZE=gptq or leave it unset"
    )


def test_no_cuda_is_refused() -> None:
    with pytest.raises(StartupError, match=r"^Quantization requires CUDA: QUANTIZE=gptq and no CUDA device"):
        _check("gptq", GPTQ_CONFIG, cuda=False)


def test_missing_package_is_named() -> None:
    with pytest.raises(StartupError) as error:
        _check("awq", {"quantization_config": {"quant_method": "awq"}}, installed=False)
    assert (
        str(error.value)
        == "QUANTIZE=awq needs the autoawq package, which is not installed (pip install autoawq)"
    )


def test_load_model_refuses_before_loading_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's load path runs the check: QUANTIZE is never read and then ignored."""
    from tgis.startup import model as app

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine must not be loaded")

    monkeypatch.setattr(app, "load_engine", no_engine)
    with pytest.raises(StartupError, match=r"^QUANTIZE=gptq: the checkpoint has no quantization_config"):
        app.load_model(Settings(model_name=str(tmp_path), quantize="gptq"), {})
