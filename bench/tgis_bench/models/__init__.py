"""The benchmark models: named shapes, random weights and a local tokenizer, built once and cached."""
