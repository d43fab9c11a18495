"""Calibration at start: the memory model probe, KV pool sizing, fit checks, the CUDA memory cap."""
