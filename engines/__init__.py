"""Model execution engines: token ids in, next-token logits out. Never imports tgis."""
