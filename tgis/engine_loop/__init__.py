"""The engine-loop thread, composed: intake, a small core, batch runners, outputs and their metrics."""
