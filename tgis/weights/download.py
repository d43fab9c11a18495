"""`download-weights`, the only command going online: hub files into the HF cache, then auto-convert (§10)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import tqdm

from tgis.hub import cached_snapshot
from tgis.weights import WeightsError, one_line
from tgis.weights.selection import local_files, parse_extensions, select_hub_files

PARALLEL_DOWNLOADS = 5
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class HubModel:
    """One hub repository at one revision, and where its files land."""

    name: str
    revision: str | None
    token: str | None
    cache_dir: Path

    @property
    def revision_name(self) -> str:
        return self.revision or DEFAULT_REVISION


def download_weights(model: HubModel, extension: str, *, auto_convert: bool) -> list[Path]:
    """Fetch the wanted files; with auto-convert, make safetensors and tokenizer.json exist locally."""
    extensions = parse_extensions(extension)
    hub_files = list_hub_files(model)
    files = fetch(model, _wanted(model, hub_files, extensions))
    if not auto_convert:
        return files
    from tgis.weights.convert import convert_to_safetensors
    from tgis.weights.tokenizer import convert_to_fast_tokenizer

    model_dir = cached_snapshot(model.name, revision=model.revision_name, cache_dir=model.cache_dir)
    if ".safetensors" in extensions:
        if not local_files(model_dir, ".safetensors"):
            if ".bin" not in extensions:
                bin_files = _wanted(model, hub_files, [".bin"], instead_of=".safetensors")
                print(".safetensors weights not found, downloading pytorch weights to convert...")
                files += fetch(model, bin_files)
            print(".safetensors weights not found, converting from pytorch weights...")
            convert_to_safetensors(model_dir)
        elif not any(path.name.endswith(".safetensors") for path in files):
            print(
                ".safetensors weights not found on the hub, but were found locally. "
                "Remove them first to re-convert"
            )
    convert_to_fast_tokenizer(model.name, model_dir)
    return files


def _wanted(
    model: HubModel, hub_files: Sequence[str], extensions: Sequence[str], instead_of: str = ""
) -> list[str]:
    names = select_hub_files(hub_files, extensions)
    if not names:
        wanted = " or ".join(filter(None, [instead_of, *extensions]))
        raise WeightsError(
            f"No {wanted} files found for model {model.name} at revision {model.revision_name}"
        )
    return names


def list_hub_files(model: HubModel) -> list[str]:
    """Every file path of the repository at the revision (model_info: one request, no retry loop)."""
    try:
        info = HfApi().model_info(model.name, revision=model.revision, token=model.token)
    except (HTTPError, OSError) as exc:
        raise hub_error(model, exc) from exc
    return [sibling.rfilename for sibling in info.siblings or []]


def fetch(model: HubModel, filenames: Sequence[str]) -> list[Path]:
    """Download `filenames` into the HF cache, PARALLEL_DOWNLOADS at a time, with progress bars."""
    print(f"Downloading {len(filenames)} files for model {model.name}")
    with ThreadPoolExecutor(max_workers=PARALLEL_DOWNLOADS) as pool:
        futures = [pool.submit(_fetch_one, model, filename) for filename in filenames]
        try:
            return _collect(futures)
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _collect(futures: list[Future[Path]]) -> list[Path]:
    paths = []
    with tqdm(total=len(futures), unit="file", desc="Files") as progress:
        for future in as_completed(futures):
            paths.append(future.result())
            progress.update()
    return sorted(paths)


def _fetch_one(model: HubModel, filename: str) -> Path:
    try:
        return Path(
            hf_hub_download(
                model.name,
                filename,
                revision=model.revision,
                token=model.token,
                cache_dir=model.cache_dir,
            )
        )
    except (HTTPError, OSError) as exc:
        raise hub_error(model, exc, filename) from exc


def hub_error(model: HubModel, error: BaseException, filename: str | None = None) -> WeightsError:
    """One line saying what could not be had from the hub, and why."""
    what = f"file {filename} of model {model.name}" if filename else f"the file list of model {model.name}"
    if isinstance(error, OfflineModeIsEnabled):
        return WeightsError(
            f"Cannot download {what}: HF_HUB_OFFLINE is set, so the Hugging Face Hub is not contacted"
        )
    if isinstance(error, GatedRepoError):
        return WeightsError(
            f"Model {model.name} is gated on the Hugging Face Hub: pass a --token with access"
        )
    if isinstance(error, RepositoryNotFoundError):
        return WeightsError(
            f"Model {model.name} not found on the Hugging Face Hub (a private model needs --token)"
        )
    if isinstance(error, RevisionNotFoundError):
        return WeightsError(
            f"Revision {model.revision_name} not found for model {model.name} on the Hugging Face Hub"
        )
    if isinstance(error, LocalEntryNotFoundError) or (
        isinstance(error, HTTPError) and not isinstance(error, HfHubHTTPError)
    ):
        return WeightsError(
            f"Cannot download {what}: the Hugging Face Hub at {constants.ENDPOINT} cannot be reached "
            f"({one_line(error)})"
        )
    if isinstance(error, EntryNotFoundError):
        return WeightsError(f"Cannot download {what}: not found on the Hugging Face Hub")
    return WeightsError(f"Cannot download {what}: {one_line(error)}")
