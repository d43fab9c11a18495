"""QUANTIZE (and DTYPE=int8): quantized at load, a checkpoint quantized by others served as it is, or
refused at start with why and what works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgis.config import Settings, StartupError
from tgis.quantization import quantization_at_load

PLAIN = {"model_type": "llama"}
GPTQ = {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}
W8A16 = {
    "model_type": "llama",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "strategy": "channel"}}},
    },
}


def resolve(quantize: str | None, config: dict | None = PLAIN, **kwargs) -> str | None:
    return quantization_at_load(
        quantize,
        dtype_name=kwargs.get("dtype_name"),
        framework=kwargs.get("framework", "hf_transformers"),
        model_config=config,
        pt2_compile=kwargs.get("pt2_compile", False),
    )


@pytest.mark.parametrize(
    ("quantize", "method"),
    [("int8", "int8"), ("INT4", "int4"), ("eetq", "int8"), ("bitsandbytes", "int8"), (None, None)],
)
def test_names_that_quantize_at_load(quantize: str | None, method: str | None) -> None:
    assert resolve(quantize) == method
    assert resolve(quantize, framework="hf_custom_tp") == method


def test_dtype_int8_is_tgis_shorthand_for_bitsandbytes() -> None:
    assert resolve(None, dtype_name="int8") == "int8"
    assert resolve("bitsandbytes", dtype_name="int8") == "int8"
    with pytest.raises(
        StartupError, match=r"^DTYPE=int8 means QUANTIZE=bitsandbytes, and QUANTIZE=int4 is set"
    ):
        resolve("int4", dtype_name="int8")


@pytest.mark.parametrize("quantize", [None, "gptq", "int4", "GPTQ"])
def test_a_quantized_checkpoint_is_served_as_it_is_when_quantize_agrees(quantize: str | None) -> None:
    assert resolve(quantize, GPTQ) is None
    assert resolve(None if quantize is None else "int8", W8A16) is None


@pytest.mark.parametrize(
    ("quantize", "config", "message"),
    [
        (
            "int8",
            GPTQ,
            "QUANTIZE=int8 contradicts the checkpoint, quantized with gptq (4-bit): set QUANTIZE=gptq",
        ),
        (
            "awq",
            GPTQ,
            "QUANTIZE=awq but the checkpoint is quantized with gptq: set QUANTIZE=gptq or leave it unset",
        ),
        ("gptq", PLAIN, "QUANTIZE=gptq serves a checkpoint quantized with gptq"),
        ("fp8", PLAIN, "fp8 quantization not supported by hf_transformers engine. QUANTIZE=int8 or int4"),
        (
            "bitsandbytes-nf4",
            PLAIN,
            "bitsandbytes-nf4 quantization not supported by hf_transformers engine. It",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_with_what_works(quantize: str, config: dict, message: str) -> None:
    with pytest.raises(StartupError) as error:
        resolve(quantize, config)
    assert str(error.value).startswith(message)


def test_engines_without_quantized_layers_and_pt2_compile_refuse() -> None:
    with pytest.raises(StartupError, match=r"^int8 quantization not supported by hf_optimum_ort engine"):
        resolve("int8", framework="hf_optimum_ort")
    with pytest.raises(StartupError, match=r"^QUANTIZE=int4 with PT2_COMPILE is served by hf_transformers"):
        resolve("int4", framework="hf_custom_tp", pt2_compile=True)
    assert resolve("int4", pt2_compile=True) == "int4"  # hf_transformers compiles quantized layers


def test_preflight_refuses_before_torch_loads(tmp_path: Path) -> None:
    """A bad QUANTIZE, or one the checkpoint contradicts, fails in preflight: a fraction of a second."""
    from tgis.preflight import preflight

    (tmp_path / "config.json").write_text(json.dumps(GPTQ))
    with pytest.raises(StartupError, match=r"^QUANTIZE=int8 contradicts the checkpoint"):
        preflight(Settings(model_name=str(tmp_path), quantize="int8", port=0, grpc_port=0), {})
    with pytest.raises(StartupError, match=r"^nf4 quantization not supported"):
        preflight(Settings(quantize="nf4", port=0, grpc_port=0), {})


def test_load_model_refuses_before_loading_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's load path runs the check too: QUANTIZE is never read and then ignored."""
    from tgis.startup import model as app

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine must not be loaded")

    monkeypatch.setattr(app, "load_engine", no_engine)
    with pytest.raises(StartupError, match=r"^QUANTIZE=gptq serves a checkpoint quantized with gptq"):
        app.load_model(Settings(model_name=str(tmp_path), quantize="gptq"), {})
