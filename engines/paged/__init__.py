"""The paged, flat-batch engine step: KV blocks, the registered attention function and the step runner."""
