"""Runs of one workload compared: finished runs side by side, or configurations in paired rounds."""
