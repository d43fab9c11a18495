"""In-process measurements beside the server: transformers baselines, decode floor, bound, step profile."""
