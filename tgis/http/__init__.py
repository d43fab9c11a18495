"""The HTTP side: health, metrics, the OpenAI-compatible API and TGI's REST API."""
