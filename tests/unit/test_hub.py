"""Offline model resolution: absolute directories and a hand-built HF hub cache, never a download."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgis.hub import ModelNotFoundError, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def cached_model(
    cache: Path,
    repo_id: str = "org/name",
    *,
    commit: str = COMMIT,
    ref: str = "main",
    config: bool = True,
    weights: str | None = "model.safetensors",
) -> Path:
    """Lay out `models--org--name/{refs/<ref>, snapshots/<commit>/...}` as huggingface_hub does."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    if config:
        (snapshot / "config.json").write_text('{"model_type": "gpt2"}')
    if weights:
        (snapshot / weights).write_bytes(b"\0")
    return snapshot


# ---------------------------------------------------------------- absolute directories


def test_absolute_directory_with_config_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path), revision="main", cache_dir=tmp_path / "cache") == tmp_path


def test_missing_absolute_directory_is_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path(str(missing), revision="main", cache_dir=tmp_path)
    assert str(caught.value) == f"Model {missing} not found: no such directory"


def test_absolute_directory_without_config_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path(str(tmp_path), revision="main", cache_dir=tmp_path)
    assert str(caught.value) == f"Model {tmp_path} not found: the directory {tmp_path} has no config.json"


def test_model_not_found_is_a_file_not_found_error() -> None:
    assert issubclass(ModelNotFoundError, FileNotFoundError)


# ---------------------------------------------------------------- hub cache


def test_cached_hub_id_resolves_to_its_snapshot(tmp_path: Path) -> None:
    snapshot = cached_model(tmp_path)
    assert resolve_model_path("org/name", revision="main", cache_dir=tmp_path) == snapshot


@pytest.mark.parametrize(
    "weights",
    [
        "model.safetensors",
        "pytorch_model.bin",
        "decoder.pt",
        "model.onnx",
        "model-00001-of-00002.safetensors",
    ],
)
def test_any_known_weights_format_counts(tmp_path: Path, weights: str) -> None:
    snapshot = cached_model(tmp_path, weights=weights)
    assert resolve_model_path("org/name", revision="main", cache_dir=tmp_path) == snapshot


def test_revision_selects_the_ref(tmp_path: Path) -> None:
    main = cached_model(tmp_path)
    dev = cached_model(tmp_path, commit=OTHER_COMMIT, ref="dev")
    assert resolve_model_path("org/name", revision="main", cache_dir=tmp_path) == main
    assert resolve_model_path("org/name", revision="dev", cache_dir=tmp_path) == dev


def test_commit_hash_revision_resolves_directly(tmp_path: Path) -> None:
    snapshot = cached_model(tmp_path)
    assert resolve_model_path("org/name", revision=COMMIT, cache_dir=tmp_path) == snapshot


def test_uncached_hub_id_is_not_found(tmp_path: Path) -> None:
    cached_model(tmp_path)
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path("org/other", revision="main", cache_dir=tmp_path)
    assert str(caught.value) == (
        f"Model org/other not found: looked for revision main in the HF cache at {tmp_path} (HF_HUB_CACHE); "
        "fetch it with `text-generation-server download-weights org/other`"
    )


def test_unknown_revision_is_not_found(tmp_path: Path) -> None:
    cached_model(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"^Model org/name not found: looked for revision v9 "):
        resolve_model_path("org/name", revision="v9", cache_dir=tmp_path)


def test_empty_cache_dir_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"^Model org/name not found: looked for revision main "):
        resolve_model_path("org/name", revision="main", cache_dir=tmp_path / "empty")


def test_cached_snapshot_without_config_reports_the_config(tmp_path: Path) -> None:
    cached_model(tmp_path, config=False)
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path("org/name", revision="main", cache_dir=tmp_path)
    assert str(caught.value) == "Config file not found in local cache for model org/name, revision main"


def test_cached_snapshot_without_weights_reports_the_weights(tmp_path: Path) -> None:
    snapshot = cached_model(tmp_path, weights=None)
    (snapshot / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path("org/name", revision="main", cache_dir=tmp_path)
    assert str(caught.value) == "Weights not found in local cache for model org/name"


def test_missing_config_is_reported_before_missing_weights(tmp_path: Path) -> None:
    cached_model(tmp_path, config=False, weights=None)
    with pytest.raises(ModelNotFoundError, match=r"^Config file not found in local cache"):
        resolve_model_path("org/name", revision="main", cache_dir=tmp_path)


def test_an_existing_relative_directory_is_served_as_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("models/tiny", revision="main", cache_dir=tmp_path / "cache") == model
