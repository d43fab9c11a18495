"""What both front doors share: validation, tokenization, adapters, permits, submission and event streams."""
