"""`download-weights`, the only command going online: hub files into the HF cache, then auto-convert (§10)."""

from __future__ import annotations

import glob
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx2
from huggingface_hub import HfApi, constants, snapshot_download
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
from huggingface_hub.utils import get_session

from tgis.hub import cached_snapshot
from tgis.model_files import WeightsError, one_line
from tgis.model_files.selection import local_files, parse_extensions, select_hub_files

PARALLEL_DOWNLOADS = 5
DEFAULT_REVISION = "main"
DEFAULT_RETRIES = 3
MAX_BACKOFF_SECONDS = 8.0
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
T = TypeVar("T")


@dataclass(frozen=True)
class HubModel:
    """One hub repository at one revision, and where its files land."""

    name: str
    revision: str | None
    token: str | None
    cache_dir: Path
    retries: int = DEFAULT_RETRIES  # further attempts after a transient failure, with backoff

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
    from tgis.model_files.convert import convert_to_safetensors
    from tgis.model_files.tokenizer import convert_to_fast_tokenizer

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
    """Every file path of the repository at the revision (model_info, retried on transient errors)."""
    info = _with_retries(
        model, lambda: HfApi().model_info(model.name, revision=model.revision, token=model.token)
    )
    return [sibling.rfilename for sibling in info.siblings or []]


def fetch(model: HubModel, filenames: Sequence[str]) -> list[Path]:
    """Download exactly `filenames` into the HF cache with huggingface_hub's snapshot_download,
    PARALLEL_DOWNLOADS at a time."""
    print(f"Downloading {len(filenames)} files for model {model.name}")
    folder = _with_retries(
        model,
        lambda: snapshot_download(
            model.name,
            revision=model.revision,
            token=model.token,
            cache_dir=model.cache_dir,
            allow_patterns=[glob.escape(name) for name in filenames],  # literal names, not globs
            max_workers=PARALLEL_DOWNLOADS,
        ),
        what=f"the files of model {model.name}",
    )
    return sorted(Path(folder) / name for name in filenames)


def bound_hub_timeouts() -> None:
    """Give every hub request a connect and read timeout. huggingface_hub sends some requests
    (model_info, repo_info) with no timeout at all, so a hub that accepts the connection and never
    answers would hang them forever; those get HF_HUB_ETAG_TIMEOUT to connect and
    HF_HUB_DOWNLOAD_TIMEOUT to read."""
    session = get_session()
    hooks = session.event_hooks
    if _fill_timeouts not in hooks["request"]:
        hooks["request"] = [*hooks["request"], _fill_timeouts]
        session.event_hooks = hooks


def _fill_timeouts(request: httpx2.Request) -> None:
    timeout = dict(request.extensions.get("timeout") or {})
    defaults = {
        "connect": constants.HF_HUB_ETAG_TIMEOUT,
        "read": constants.HF_HUB_DOWNLOAD_TIMEOUT,
        "write": constants.HF_HUB_DOWNLOAD_TIMEOUT,
        "pool": constants.HF_HUB_ETAG_TIMEOUT,
    }
    for key, value in defaults.items():
        if timeout.get(key) is None:
            timeout[key] = float(value)
    request.extensions["timeout"] = timeout


def is_transient(error: BaseException) -> bool:
    """Worth another attempt: timeouts, dropped connections, and the hub's 408/429/5xx answers."""
    if isinstance(error, HfHubHTTPError):
        response = error.response
        return response is not None and response.status_code in TRANSIENT_STATUS
    return isinstance(error, httpx2.TimeoutException | httpx2.NetworkError | httpx2.RemoteProtocolError)


def _with_retries(model: HubModel, call: Callable[[], T], what: str | None = None) -> T:
    """`call`, tried again up to `model.retries` times on transient errors, waiting 1, 2, 4… s."""
    bound_hub_timeouts()
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except (HTTPError, OSError) as exc:
            if attempt > model.retries or not is_transient(exc):
                raise hub_error(model, exc, what=what, attempts=attempt) from exc
            delay = min(2.0 ** (attempt - 1), MAX_BACKOFF_SECONDS)
            print(f"Hub request failed ({one_line(exc)}); retrying in {delay:g} s")
            time.sleep(delay)


def hub_error(
    model: HubModel, error: BaseException, *, what: str | None = None, attempts: int = 1
) -> WeightsError:
    """One line saying what could not be had from the hub, and why."""
    what = what or f"the file list of model {model.name}"
    if isinstance(error, httpx2.TimeoutException):
        tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
        return WeightsError(
            f"Cannot download {what}: the Hugging Face Hub at {constants.ENDPOINT} did not answer in time "
            f"({tries}; timeouts HF_HUB_ETAG_TIMEOUT={constants.HF_HUB_ETAG_TIMEOUT} s to connect, "
            f"HF_HUB_DOWNLOAD_TIMEOUT={constants.HF_HUB_DOWNLOAD_TIMEOUT} s to read)"
        )
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
