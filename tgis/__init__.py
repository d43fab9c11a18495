"""tgis: a TGIS-compatible text-generation inference server (fmaas gRPC API)."""

__version__ = "0.1.0"
