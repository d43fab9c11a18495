"""Speculative decoding's pure parts: proposing tokens from the sequence itself, and when to speculate."""
