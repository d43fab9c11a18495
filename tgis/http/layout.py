"""Where the HTTP generation routes are served, and over what:

- TLS not configured: on PORT, plaintext like gRPC (or on HTTP_GENERATION_PORT when set);
- TLS configured: always over TLS with gRPC's certificates, and with a client CA a verified client
  certificate is required. PORT stays plaintext for probes and Prometheus, as TGIS's HTTP port is, so
  generation gets its own port (HTTP_GENERATION_PORT, default 3001), unless HTTP_TLS puts PORT itself
  under TLS, in which case generation stays on it;
- HTTP_GENERATION_ROUTES=false: nowhere; PORT serves /health and /metrics only, TGIS's surface exactly.

Pure: preflight checks it before anything loads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tgis.config import Settings
from tgis.errors import StartupError
from tgis.tls import TlsFiles

# Where generation goes when TLS keeps it off PORT and HTTP_GENERATION_PORT is unset (PORT + 1).
DEFAULT_TLS_GENERATION_PORT = 3001


class GenerationPlace(enum.Enum):
    OFF = "off"
    ON_PORT = "on PORT"
    OWN_PORT = "on its own port"


@dataclass(frozen=True)
class HttpLayout:
    """Which port serves what, and which listeners use TLS."""

    port: int
    port_tls: bool
    generation: GenerationPlace
    generation_port: int | None = None  # its own listener's port (GenerationPlace.OWN_PORT)
    generation_tls: bool = False


def http_layout(settings: Settings, tls: TlsFiles | None) -> HttpLayout:
    """Where the HTTP generation routes are served, and over what; StartupError for a combination that
    would serve generation with less protection than gRPC has."""
    if settings.http_tls and tls is None:
        raise StartupError("HTTP_TLS needs TLS_CERT_PATH and TLS_KEY_PATH")
    port, port_tls = settings.port, settings.http_tls
    if not settings.http_generation_routes:
        return HttpLayout(port, port_tls, GenerationPlace.OFF)
    chosen = settings.http_generation_port
    if tls is None or port_tls:  # PORT is as protected as gRPC: generation may share it
        if chosen is None or chosen == port:
            return HttpLayout(port, port_tls, GenerationPlace.ON_PORT)
        return HttpLayout(port, port_tls, GenerationPlace.OWN_PORT, chosen, port_tls)
    if chosen is None:  # PORT=0 (free ports) picks a free one for generation too
        chosen = DEFAULT_TLS_GENERATION_PORT if port else 0
    if chosen == port and port != 0:
        raise StartupError(
            f"HTTP_GENERATION_PORT {chosen} is PORT, which serves plaintext: with TLS configured, HTTP "
            "generation is served over TLS only. Set another HTTP_GENERATION_PORT, or HTTP_TLS=true to "
            "put PORT under TLS too"
        )
    return HttpLayout(port, False, GenerationPlace.OWN_PORT, chosen, True)
