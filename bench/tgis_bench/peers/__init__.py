"""Peer servers (vLLM, llama.cpp) started from their own environments and timed as tgis is."""
