"""tgis-bench: load, soak and peer comparisons against a tgis server, beside it rather than in it."""
