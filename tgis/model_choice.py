"""Which model a start serves: MODEL_NAME, or the built-in demo model. The demo is served when asked
for (`MODEL_NAME=demo`) or, on the bare launcher, when MODEL_NAME is unset (with a WARNING); with
REQUIRE_MODEL_NAME (set in the image and the manifests) an unset MODEL_NAME refuses to start, so a
misspelled variable never gives a healthy pod serving a toy model."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping

from tgis.config import Settings, StartupError

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo"


def wants_demo_model(settings: Settings, environ: Mapping[str, str]) -> bool:
    """True to serve the demo model; raises StartupError when MODEL_NAME is required and unset.
    Cheap (no torch): the launcher calls it before anything is loaded."""
    if settings.model_name == DEMO_MODEL_NAME:
        return True
    if settings.model_name:
        return False
    hint = _misspelling_hint(environ)
    if settings.require_model_name:
        raise StartupError(
            "MODEL_NAME is not set: set it to a model directory or a hub id in the HF cache "
            f"(or to `{DEMO_MODEL_NAME}` for the built-in demo model){hint}"
        )
    return True


def log_demo_choice(settings: Settings, environ: Mapping[str, str], path: object) -> None:
    if settings.model_name == DEMO_MODEL_NAME:
        logger.info(f"MODEL_NAME={DEMO_MODEL_NAME}: serving the built-in demo model from {path}")
    else:
        logger.warning(
            f"MODEL_NAME is not set: serving the built-in demo model from {path}, a toy model; "
            f"set MODEL_NAME (MODEL_NAME={DEMO_MODEL_NAME} for this one){_misspelling_hint(environ)}"
        )


def _misspelling_hint(environ: Mapping[str, str]) -> str:
    """`; MODEL_NAM is set: did you mean MODEL_NAME?` for variables close to MODEL_NAME."""
    names = [name for name in environ if name.upper() != "MODEL_NAME"]
    close = difflib.get_close_matches("MODEL_NAME", [n.upper() for n in names], n=3, cutoff=0.8)
    found = [name for name in names if name.upper() in close]
    return "".join(f"; {name} is set: did you mean MODEL_NAME?" for name in found)
