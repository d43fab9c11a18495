"""`convert-to-fast-tokenizer`: a model's `tokenizer.json`, written by AutoTokenizer when missing (§10)."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from tgis.model_files import WeightsError, one_line

FAST_TOKENIZER_FILE = "tokenizer.json"


def convert_to_fast_tokenizer(
    model_name: str, model_dir: Path, output_path: Path | None = None
) -> Path | None:
    """Save the fast tokenizer of `model_dir` to `output_path` (default: the model directory itself).

    Returns where it was saved, or None when the model already has a `tokenizer.json`.
    """
    if (model_dir / FAST_TOKENIZER_FILE).is_file():
        print(f"Model {model_name} already has a fast tokenizer")
        return None
    if output_path is not None and not output_path.is_dir():
        raise WeightsError(f"Output path {output_path} must exist and be a directory")
    destination = output_path or model_dir
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many types for missing or unreadable tokenizer files
        reason = _missing_sentencepiece(model_dir) or one_line(exc)
        raise WeightsError(
            f"No tokenizer could be loaded for model {model_name} from {model_dir}: {reason}"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise WeightsError(f"The tokenizer of model {model_name} cannot be converted to a fast tokenizer")
    into_model_dir = destination.resolve() == model_dir.resolve()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        for saved in sorted(path for path in Path(scratch).iterdir() if path.is_file()):
            _place(saved, destination / saved.name, keep_existing=into_model_dir)
    print(f"Saved tokenizer to {destination}")
    return destination


def _missing_sentencepiece(model_dir: Path) -> str | None:
    # Without the package transformers falls back to other readers and reports *their* failure.
    if (model_dir / "tokenizer.model").is_file() and importlib.util.find_spec("sentencepiece") is None:
        return "reading its tokenizer.model needs the sentencepiece package (pip install sentencepiece)"
    return None


def _place(saved: Path, target: Path, *, keep_existing: bool) -> None:
    # In the model directory only missing files are added: the model's own tokenizer_config.json
    # and friends stay as published (in the HF cache they are links into shared blobs).
    if keep_existing and target.exists():
        return
    if target.is_symlink():
        target.unlink()
    shutil.copyfile(saved, target)
