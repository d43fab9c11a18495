"""Pure-Python batching: which queued requests join the running batch (no torch)."""
