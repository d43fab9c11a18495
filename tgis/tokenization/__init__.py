"""Tokenizer adapter and incremental detokenization (SPEC §5)."""
