"""Who may generate, whichever door they come in by: the API key (API_KEY) and, over mutual TLS, a
verified client certificate. Both doors ask the same AccessGuard, and every refusal is logged with the
client's address and counted (`tgi_request_unauthorized{door,reason}`)."""

from __future__ import annotations

import enum
import hmac
import logging

from tgis.metrics import Metrics

logger = logging.getLogger(__name__)

API_KEY_MISSING = "missing or invalid API key (authorization: Bearer <key>)"
CLIENT_CERTIFICATE_MISSING = "a client certificate signed by the server's client CA is required"


class Door(enum.Enum):
    GRPC = "grpc"
    HTTP = "http"


class Refusal(enum.Enum):
    """Why a request was refused, as the metric's `reason` label reads it."""

    API_KEY = "api_key"
    CLIENT_CERTIFICATE = "client_certificate"

    @property
    def message(self) -> str:
        return API_KEY_MISSING if self is Refusal.API_KEY else CLIENT_CERTIFICATE_MISSING


class AccessGuard:
    """The checks a generation request passes before anything else runs."""

    def __init__(self, metrics: Metrics, *, api_key: str | None) -> None:
        self.metrics = metrics
        self.api_key = api_key

    def check_api_key(self, authorization: str | None) -> Refusal | None:
        """None when no key is configured or `authorization` is `Bearer <key>` (compared in constant
        time); the refusal otherwise."""
        if self.api_key is None:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return Refusal.API_KEY

    def refused(self, door: Door, refusal: Refusal, *, peer: str, target: str) -> None:
        """Log and count one refusal."""
        self.metrics.request_unauthorized.labels(door=door.value, reason=refusal.value).inc()
        logger.warning(f"Refused {door.value} {target} from {peer}: {refusal.message}")
